"""Exactness and validation of the dense row-wise bit packing (formats.packing)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.formats.packing import SUPPORTED_BITS, pack_codes, packed_nbytes, unpack_codes

WIDTHS = tuple(range(2, 9))  # every width the format promises, independent of SUPPORTED_BITS


def test_every_width_from_2_to_8_is_supported():
    assert SUPPORTED_BITS == WIDTHS


def _codes(rows: int, cols: int, bits: int, seed: int, dtype=torch.int64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, (rows, cols), generator=g).to(dtype)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(1, 17),
    cols=st.integers(1, 70),
    bits=st.sampled_from(WIDTHS),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.int64, torch.int32, torch.int16, torch.uint8]),
)
def test_roundtrip_is_exact(rows, cols, bits, seed, dtype):
    codes = _codes(rows, cols, bits, seed, dtype)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (rows, -(-cols // 8) * bits)
    assert packed.numel() == packed_nbytes(rows, cols, bits)
    out = unpack_codes(packed, bits, cols)
    assert out.dtype == torch.int32
    assert out.shape == (rows, cols)
    assert torch.equal(out, codes.to(torch.int32))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 17), cols=st.integers(1, 70), bits=st.sampled_from(WIDTHS))
def test_extreme_values_roundtrip(rows, cols, bits):
    for fill in (0, (1 << bits) - 1):
        codes = torch.full((rows, cols), fill, dtype=torch.int32)
        assert torch.equal(unpack_codes(pack_codes(codes, bits), bits, cols), codes)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(2, 9), cols=st.integers(1, 40), bits=st.sampled_from(WIDTHS))
def test_rows_are_independent(rows, cols, bits):
    codes = _codes(rows, cols, bits, seed=rows * 1000 + cols)
    packed = pack_codes(codes, bits)
    for r in range(rows):
        assert torch.equal(pack_codes(codes[r : r + 1], bits), packed[r : r + 1])


def _oracle_bytes(row: list[int], bits: int) -> list[int]:
    """Independent oracle: a row is one little-endian bit stream, value ``i`` at bits
    ``[i * bits, (i + 1) * bits)``, zero-padded to ``ceil(cols / 8) * bits`` bytes."""
    stream = sum(int(v) << (i * bits) for i, v in enumerate(row))
    return list(stream.to_bytes(-(-len(row) // 8) * bits, "little"))


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(1, 5),
    cols=st.integers(1, 40),
    bits=st.sampled_from(WIDTHS),
    seed=st.integers(0, 2**31 - 1),
)
def test_bytes_match_the_bit_stream_oracle(rows, cols, bits, seed):
    codes = _codes(rows, cols, bits, seed)
    assert pack_codes(codes, bits).tolist() == [_oracle_bytes(r, bits) for r in codes.tolist()]


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("cols", [1, 7, 9, 15, 17, 63, 65])
def test_extremes_in_partial_chunks(bits, cols):
    """Codes 0 and 2**bits - 1 alternating (every bit boundary flips) with a partial last chunk."""
    maxq = (1 << bits) - 1
    codes = torch.tensor([[maxq * ((i + r) % 2) for i in range(cols)] for r in range(3)], dtype=torch.int32)
    codes[2] = maxq
    packed = pack_codes(codes, bits)
    assert packed.tolist() == [_oracle_bytes(r, bits) for r in codes.tolist()]
    assert torch.equal(unpack_codes(packed, bits, cols), codes)


def test_known_bytes_5_6_7bit():
    # 5-bit: 31 at value 1 -> bits 5..9 -> byte0 0xE0, byte1 0x03
    assert pack_codes(torch.tensor([[0, 31]]), 5).tolist() == [[0xE0, 0x03, 0, 0, 0]]
    # 6-bit: value 7 = 63 at bits 42..47 -> top six bits of byte 5
    assert pack_codes(torch.tensor([[0] * 7 + [63]]), 6).tolist() == [[0, 0, 0, 0, 0, 0xFC]]
    # 7-bit: 127 at value 1 -> bits 7..13 -> byte0 bit 7, byte1 bits 0..5
    assert pack_codes(torch.tensor([[0, 127]]), 7).tolist() == [[0x80, 0x3F, 0, 0, 0, 0, 0]]


def test_packed_sizes():
    assert packed_nbytes(1, 8, 3) == 3
    assert packed_nbytes(1, 9, 3) == 6
    assert packed_nbytes(4, 576, 4) == 4 * 288
    assert packed_nbytes(4, 576, 3) == 4 * 216
    assert packed_nbytes(2, 70, 2) == 2 * 18
    assert packed_nbytes(3, 5, 8) == 3 * 8
    for bits in WIDTHS:  # dense at every width: ceil(cols / 8) * bits bytes per row
        assert packed_nbytes(2, 17, bits) == 2 * 3 * bits
        assert packed_nbytes(1, 64, bits) * 8 == 64 * bits
    # 3-bit is dense: strictly smaller than 4-bit slots for any non-trivial width.
    for cols in (8, 64, 576, 1536):
        assert packed_nbytes(1, cols, 3) < packed_nbytes(1, cols, 4)
        assert packed_nbytes(1, cols, 3) * 8 == cols * 3


def test_known_bytes_2bit():
    codes = torch.tensor([[1, 2, 3, 0, 0, 0, 0, 0]])
    # 1 | 2<<2 | 3<<4 = 0b00111001 = 0x39
    assert pack_codes(codes, 2).tolist() == [[0x39, 0x00]]
    codes = torch.tensor([[0, 0, 0, 0, 3, 0, 0, 1]])
    assert pack_codes(codes, 2).tolist() == [[0x00, 0x43]]


def test_known_bytes_3bit():
    assert pack_codes(torch.tensor([[7, 0, 0, 0, 0, 0, 0, 0]]), 3).tolist() == [[0x07, 0x00, 0x00]]
    # value 2 spans bytes 0 and 1: bits 6..8 -> 0b101 = low two bits (01) in byte0 top, 1 in byte1 bit0
    assert pack_codes(torch.tensor([[0, 0, 5, 0, 0, 0, 0, 0]]), 3).tolist() == [[0x40, 0x01, 0x00]]
    # value 7 occupies bits 21..23 -> top three bits of byte 2
    assert pack_codes(torch.tensor([[0, 0, 0, 0, 0, 0, 0, 7]]), 3).tolist() == [[0x00, 0x00, 0xE0]]
    # a partial chunk is padded with zero codes
    assert pack_codes(torch.tensor([[1, 1, 1]]), 3).tolist() == [[0x49, 0x00, 0x00]]


def test_known_bytes_4bit_and_8bit():
    assert pack_codes(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]]), 4).tolist() == [[0x21, 0x43, 0x65, 0xF7]]
    assert pack_codes(torch.tensor([[255, 0, 7]]), 8).tolist() == [[255, 0, 7, 0, 0, 0, 0, 0]]


@pytest.mark.parametrize("bits", [1, 9, 16, 0, -1, 4.0, True])
def test_bad_bits_rejected(bits):
    with pytest.raises(ValueError, match=r"unsupported bit width.*\(2, 3, 4, 5, 6, 7, 8\)"):
        pack_codes(torch.zeros(2, 8, dtype=torch.int32), bits)
    with pytest.raises(ValueError, match="unsupported bit width"):
        unpack_codes(torch.zeros(2, 3, dtype=torch.uint8), bits, 8)


@pytest.mark.parametrize("bits", WIDTHS)
def test_out_of_range_rejected_with_details(bits):
    maxq = (1 << bits) - 1
    codes = torch.zeros(3, 10, dtype=torch.int32)
    codes[0, 0] = maxq + 1
    codes[2, 9] = -1
    with pytest.raises(ValueError) as exc:
        pack_codes(codes, bits)
    msg = str(exc.value)
    assert "2 of 30 codes" in msg
    assert "min -1" in msg and f"max {maxq + 1}" in msg
    assert f"[0, {maxq}]" in msg


def test_non_2d_and_non_integer_rejected():
    with pytest.raises(ValueError, match="2-D"):
        pack_codes(torch.zeros(8, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="2-D"):
        pack_codes(torch.zeros(2, 2, 8, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="integer dtype"):
        pack_codes(torch.zeros(2, 8), 4)
    with pytest.raises(ValueError, match="integer dtype"):
        pack_codes(torch.zeros(2, 8, dtype=torch.bool), 4)


def test_unpack_shape_mismatch_rejected():
    packed = pack_codes(_codes(2, 16, 3, 0), 3)  # 6 bytes per row
    with pytest.raises(ValueError, match=r"6 bytes per row.*ceil\(17/8\)\*3 = 9"):
        unpack_codes(packed, 3, 17)
    with pytest.raises(ValueError, match="bytes per row"):
        unpack_codes(packed, 4, 16)
    with pytest.raises(ValueError, match="uint8"):
        unpack_codes(packed.to(torch.int32), 3, 16)
    with pytest.raises(ValueError, match="2-D"):
        unpack_codes(packed.reshape(-1), 3, 16)


@pytest.mark.parametrize("bits", WIDTHS)
def test_empty_rows_and_columns(bits):
    packed = pack_codes(torch.zeros(0, 12, dtype=torch.int32), bits)
    assert packed.shape == (0, 2 * bits)
    assert unpack_codes(packed, bits, 12).shape == (0, 12)
    packed = pack_codes(torch.zeros(3, 0, dtype=torch.int32), bits)
    assert packed.shape == (3, 0)
    assert unpack_codes(packed, bits, 0).shape == (3, 0)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(rows=st.integers(0, 9), cols=st.integers(0, 70), bits=st.sampled_from([2, 4, 8]),
       seed=st.integers(0, 999))  # fmt: skip
def test_byte_aligned_widths_take_the_word_path_bytes(rows, cols, bits, seed):
    """2/4/8 bits pack and unpack in uint8 (whole codes per byte); the bytes are the int64 word path's."""
    from bitmosaic.formats import packing

    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, cols), generator=g, dtype=torch.int32)
    n_chunks = -(-cols // 8)
    fast, words = packing._pack_bytes(codes, bits, n_chunks), packing._pack_words(codes, bits, n_chunks)
    assert torch.equal(fast, words)
    assert torch.equal(packing._unpack_bytes(words, bits, cols), packing._unpack_words(words, bits, cols))
