"""The fast CPU kernels agree bit for bit with the reference unpack + layout.dequantize."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.formats import layout
from bitmosaic.formats.grid import fp16_exact
from bitmosaic.formats.packing import pack_codes, unpack_codes
from bitmosaic.kernels import dequantize_packed, unpack_codes_fast

WIDTHS = tuple(range(2, 9))  # every packing width, independent of what the kernel module declares


def _layer(out_f, in_f, bits, group_size, symmetric, seed=0):
    """Random packed layer: (packed, codes, scales fp16 [out,G], zeros fp16 [out,G] or scalar)."""
    g = torch.Generator().manual_seed(seed)
    n_groups = layout.num_groups(in_f, group_size)
    codes = torch.randint(0, 1 << bits, (out_f, in_f), generator=g, dtype=torch.int32)
    scales = (torch.rand(out_f, n_groups, generator=g) * 0.02 + 1e-3).to(torch.float16)
    if symmetric:
        zeros = 1 << (bits - 1)
    else:
        zeros = torch.randint(0, 1 << bits, (out_f, n_groups), generator=g).to(torch.float16)
    return pack_codes(codes, bits), codes, scales, zeros


def _reference(packed, bits, cols, scales, zeros, g_idx, dtype=torch.float32, code_offset=0):
    codes = unpack_codes(packed, bits, cols) + code_offset
    return layout.dequantize(codes, scales, zeros, g_idx, dtype)


def _bitwise_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))


@settings(max_examples=120, deadline=None)
@given(
    rows=st.integers(1, 17),
    cols=st.integers(1, 70),
    bits=st.sampled_from(WIDTHS),
    seed=st.integers(0, 2**31 - 1),
)
def test_fast_unpack_matches_reference(rows, cols, bits, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, cols), generator=g, dtype=torch.int32)
    packed = pack_codes(codes, bits)
    fast = unpack_codes_fast(packed, bits, cols)
    assert fast.dtype == torch.int32 and fast.is_contiguous()
    assert torch.equal(fast, unpack_codes(packed, bits, cols))
    assert torch.equal(fast, codes)


@pytest.mark.parametrize("bits", WIDTHS)
def test_fast_unpack_all_byte_values(bits):
    # Every possible byte in every position of a chunk (exercises the whole table).
    packed = torch.arange(256, dtype=torch.uint8).repeat_interleave(bits).reshape(256, bits)
    for shift in range(bits):
        p = packed.roll(shift, dims=1).contiguous()
        assert torch.equal(unpack_codes_fast(p, bits, 8), unpack_codes(p, bits, 8))


@pytest.mark.parametrize("bits", WIDTHS)
def test_fast_unpack_extremes_in_partial_chunks(bits):
    maxq = (1 << bits) - 1
    for cols in (1, 7, 9, 17, 63):
        codes = torch.tensor(
            [[maxq * ((i + r) % 2) for i in range(cols)] for r in range(3)], dtype=torch.int32
        )
        codes[2] = maxq
        assert torch.equal(unpack_codes_fast(pack_codes(codes, bits), bits, cols), codes)


@pytest.mark.parametrize("bits", WIDTHS)
def test_empty_rows_and_columns(bits):
    for rows, cols in ((0, 12), (3, 0), (0, 0)):
        packed = pack_codes(torch.zeros(rows, cols, dtype=torch.int32), bits)
        assert torch.equal(unpack_codes_fast(packed, bits, cols), unpack_codes(packed, bits, cols))
    packed = pack_codes(torch.zeros(0, 12, dtype=torch.int32), bits)  # a layer with no output rows
    for zeros in (1.0, torch.zeros(0, 2, dtype=torch.float16)):
        w = dequantize_packed(
            packed, bits, 12, torch.ones(0, 2, dtype=torch.float16), zeros, None, group_size=8
        )
        assert w.shape == (0, 12) and w.dtype == torch.float32


CASES = [
    # (out, in, group_size) -- 576/128 has a partial last group of 64
    (24, 576, 128),
    (16, 256, 64),
    (8, 100, 32),  # partial group and a partial 8-chunk
    (12, 70, None),  # per-channel
    (5, 1, None),
]


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("out_f,in_f,group_size", CASES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_dequantize_contiguous_bitwise(bits, out_f, in_f, group_size, symmetric):
    packed, _, scales, zeros = _layer(out_f, in_f, bits, group_size, symmetric, seed=bits)
    g_idx = layout.default_g_idx(in_f, group_size)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        ref = _reference(packed, bits, in_f, scales, zeros, g_idx, dtype)
        fast = dequantize_packed(
            packed, bits, in_f, scales, zeros, g_idx, dtype, group_size=group_size, contiguous=True
        )
        assert _bitwise_equal(fast, ref)
        # g_idx=None with a group size means the same contiguous map
        fast2 = dequantize_packed(packed, bits, in_f, scales, zeros, None, dtype, group_size=group_size)
        assert _bitwise_equal(fast2, ref)
        # the gather path (trivial g_idx passed without the contiguous flag) agrees too
        fast3 = dequantize_packed(packed, bits, in_f, scales, zeros, g_idx, dtype)
        assert _bitwise_equal(fast3, ref)


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("symmetric", [True, False])
def test_dequantize_permuted_g_idx_bitwise(bits, symmetric):
    out_f, in_f, group_size = 32, 576, 128
    packed, _, scales, zeros = _layer(out_f, in_f, bits, group_size, symmetric, seed=7)
    # act-order style: columns permuted, each keeps the group it was quantized in
    perm = torch.randperm(in_f, generator=torch.Generator().manual_seed(3))
    g_idx = layout.default_g_idx(in_f, group_size)[perm].to(torch.int32)
    assert not layout.is_trivial_g_idx(g_idx, group_size)
    ref = _reference(packed, bits, in_f, scales, zeros, g_idx)
    fast = dequantize_packed(packed, bits, in_f, scales, zeros, g_idx)
    assert _bitwise_equal(fast, ref)


# code offsets: a no-clip layer stores ``code - offset``; -1000 is far enough below zero that
# ``code + offset`` is not representable in bfloat16 (the int sum must be cast once, as the reference).
OFFSETS = [-1, -5, -1000, -1001]


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("contiguous", [True, False])
def test_dequantize_with_code_offset_bitwise(bits, symmetric, contiguous):
    out_f, in_f, group_size = 12, 100, 32
    packed, _, scales, zeros = _layer(out_f, in_f, bits, group_size, symmetric, seed=bits + 20)
    g_idx = layout.default_g_idx(in_f, group_size)
    if not contiguous:
        g_idx = g_idx[torch.randperm(in_f, generator=torch.Generator().manual_seed(1))]
    for off in OFFSETS:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            ref = _reference(packed, bits, in_f, scales, zeros, g_idx, dtype, code_offset=off)
            fast = dequantize_packed(
                packed,
                bits,
                in_f,
                scales,
                zeros,
                g_idx,
                dtype,
                group_size=group_size,
                contiguous=contiguous,
                code_offset=off,
            )
            assert _bitwise_equal(fast, ref), (off, dtype)


@pytest.mark.parametrize("bits", [5, 6, 7])
def test_chunk_words_byte_order(bits):
    """The 5-7 bit path reads each chunk as one 64-bit word in the host's byte order; the
    big-endian layout is the byte-swapped little-endian one."""
    np = pytest.importorskip("numpy")
    from bitmosaic.kernels.cpu import _chunk_words

    packed = pack_codes(
        torch.randint(0, 1 << bits, (3, 24), generator=torch.Generator().manual_seed(0)), bits
    )
    little = _chunk_words(packed, bits, "little").numpy()
    big = _chunk_words(packed, bits, "big").numpy()
    assert np.array_equal(big.byteswap(), little)
    if sys.byteorder == "little":
        w = little.reshape(3, -1)
        expect = [[int.from_bytes(bytes(c), "little") for c in r.reshape(-1, bits).tolist()] for r in packed]
        assert w.tolist() == expect


def test_dequantize_matches_grid_formula():
    # independent of layout.dequantize: (q - z) * s per column with group j // g
    packed, codes, scales, zeros = _layer(4, 20, 3, 8, symmetric=False, seed=11)
    w = dequantize_packed(packed, 3, 20, scales, zeros, None, group_size=8)
    for j in range(20):
        gi = j // 8
        expect = (codes[:, j].float() - zeros[:, gi].float()) * scales[:, gi].float()
        assert torch.equal(w[:, j], expect)


def test_non_integer_scalar_zero_and_fp32_scales():
    packed, _, _, _ = _layer(6, 48, 4, 16, symmetric=True, seed=5)
    scales = fp16_exact(torch.rand(6, 3) + 0.1).float()
    g_idx = layout.default_g_idx(48, 16)
    for zeros in (7.5, 8, torch.tensor(8.0)):
        ref = layout.dequantize(unpack_codes(packed, 4, 48), scales, float(zeros), g_idx)
        fast = dequantize_packed(packed, 4, 48, scales, zeros, g_idx, group_size=16, contiguous=True)
        assert _bitwise_equal(fast, ref)


def test_validation_errors():
    packed, _, scales, zeros = _layer(4, 576, 4, 128, symmetric=False)
    g_idx = layout.default_g_idx(576, 128)
    with pytest.raises(ValueError, match="bytes per row"):
        dequantize_packed(packed, 3, 576, scales, zeros, g_idx)
    with pytest.raises(ValueError, match="uint8"):
        unpack_codes_fast(packed.int(), 4, 576)
    with pytest.raises(ValueError, match="unsupported bit width"):
        unpack_codes_fast(packed, 9, 576)
    with pytest.raises(ValueError, match="needs group_size"):
        dequantize_packed(packed, 4, 576, scales, zeros, None)
    with pytest.raises(ValueError, match="5 groups"):
        dequantize_packed(packed, 4, 576, scales, zeros, None, group_size=64)
    with pytest.raises(ValueError, match="zeros shape"):
        dequantize_packed(packed, 4, 576, scales, zeros[:, :2], g_idx)
    with pytest.raises(ValueError, match="scales must be"):
        dequantize_packed(packed, 4, 576, scales[:2], zeros, g_idx)
    with pytest.raises(ValueError, match="g_idx has 575"):
        dequantize_packed(packed, 4, 576, scales, zeros, g_idx[:-1])
