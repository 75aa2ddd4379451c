"""The block-major bit-plane format (formats/bitplane.py, SFMP §4.5, App. B, G): exact round trips
for every width and mix, partial blocks and tiles, row slices; the byte layout on a hand-made case;
the ±1 re-parameterisation; exact bits accounting; bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.formats import bitplane as bp


def random_case(N, K, gs, rb, bits, seed):
    """codes [N, K] whose block (r, g) lies in its width's range, and the bit map used."""
    g = torch.Generator().manual_seed(seed)
    gsz, rbs, bmap = bp.normalize_geometry(N, K, gs, rb, 1)
    if bits == "mix":
        bmap = torch.randint(1, 9, bmap.shape, generator=g, dtype=torch.uint8)
    else:
        bmap = torch.full(bmap.shape, bits, dtype=torch.uint8)
    codes = torch.empty(N, K, dtype=torch.int32)
    for r in range(bmap.shape[0]):
        for j in range(bmap.shape[1]):
            blk = codes[r * rbs : (r + 1) * rbs, j * gsz : (j + 1) * gsz]
            blk.copy_(torch.randint(0, 1 << int(bmap[r, j]), blk.shape, generator=g))
    return codes, bmap


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    N=st.integers(1, 40),
    K=st.integers(1, 150),
    gs=st.sampled_from([-1, 1, 7, 32, 33, 64, 128]),
    rb=st.sampled_from([None, 1, 5, 16, 17, 32]),
    bits=st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, "mix"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip(N, K, gs, rb, bits, seed):
    codes, bmap = random_case(N, K, gs, rb, bits, seed)
    p = bp.pack(codes, bmap, gs, rb)
    assert torch.equal(bp.unpack(p), codes)
    lo = seed % N
    hi = lo + (seed // 7) % (N - lo + 1)
    assert torch.equal(bp.unpack(p, slice(lo, hi)), codes[lo:hi])
    acc = bp.bits_accounting(p)
    assert acc["plane_bits"] == 8 * p.data.numel()
    assert acc["code_bits"] == sum(
        int(bmap[r, j])
        * codes[r * p.row_block : (r + 1) * p.row_block, j * p.group_size :][:, : p.group_size].numel()
        for r in range(bmap.shape[0])
        for j in range(bmap.shape[1])
    )
    assert acc["padding_bits"] >= 0


@pytest.mark.parametrize("q", range(1, 9))
def test_extreme_codes(q):
    codes = torch.tensor([[0, (1 << q) - 1] * 20] * 19, dtype=torch.int32)  # 19 rows: a short tile
    codes[3] = (1 << q) - 1
    p = bp.pack(codes, q, 16, None)
    assert torch.equal(bp.unpack(p), codes)


def test_byte_layout_by_hand():
    # 17 rows (a full tile of 16 + a tile of 1), 40 columns (2 chunks: 32 + 8, 24 padding bits), q = 2
    N, K, q = 17, 40, 2
    codes = torch.zeros(N, K, dtype=torch.int32)
    codes[0, 0] = 1  # plane 0, chunk 0, row 0, bit 0
    codes[1, 33] = 2  # plane 1, chunk 1, row 1, bit 1
    codes[16, 39] = 3  # short tile: row 0 of it, chunk 1, planes 0 and 1, bit 7
    p = bp.pack(codes, q, -1, None)
    assert p.data.numel() == 17 * 2 * 2 * 4 and int(p.offsets[0, 0]) == 0
    words = p.data.to(torch.int64).reshape(-1, 4)
    words = (words << torch.tensor([0, 8, 16, 24])).sum(1)
    full = words[: 16 * 2 * 2].reshape(2, 2, 16)  # [chunk][plane][row]
    assert int(full[0, 0, 0]) == 1 and int(full[1, 1, 1]) == 2
    assert int(full.count_nonzero()) == 2
    short = words[16 * 2 * 2 :].reshape(2, 2, 1)
    assert int(short[1, 0, 0]) == 1 << 7 and int(short[1, 1, 0]) == 1 << 7 and int(short.count_nonzero()) == 2


def test_block_offsets_are_contiguous_block_major():
    codes, bmap = random_case(40, 100, 32, 16, "mix", 3)
    p = bp.pack(codes, bmap, 32, 16)
    flat = p.offsets.reshape(-1)
    sizes = []
    for r in range(bmap.shape[0]):
        r0, r1 = p.block_rows(r)
        for j in range(bmap.shape[1]):
            c0, c1 = p.block_cols(j)
            sizes.append((r1 - r0) * (-(-(c1 - c0) // 32)) * int(bmap[r, j]) * 4)
    assert flat.tolist() == [sum(sizes[:i]) for i in range(len(sizes))]
    assert p.data.numel() == sum(sizes)


@pytest.mark.parametrize("q", range(1, 9))
def test_pm_affine_identity(q):
    # W = Σ_i 2^i ŝ (2 W_i - 1) + ẑ equals (c - z) s (App. B Eq. 17 in the (c - z) s convention)
    g = torch.Generator().manual_seed(q)
    codes = torch.randint(0, 1 << q, (8, 64), generator=g, dtype=torch.int32)
    s = torch.rand(8, 2, generator=g, dtype=torch.float64) + 0.1
    z = torch.randint(0, 1 << q, (8, 2), generator=g).double()
    s_hat, z_hat = bp.pm_affine(s, z, torch.full((8, 2), q))
    gi = torch.arange(64) // 32
    planes = torch.stack([(codes >> i) & 1 for i in range(q)]).double()  # [q, 8, 64]
    pm = sum((2.0**i) * (2 * planes[i] - 1) for i in range(q))
    w_pm = s_hat.double()[:, gi] * pm + z_hat.double()[:, gi]
    w_ref = (codes.double() - z[:, gi]) * s[:, gi]
    torch.testing.assert_close(w_pm, w_ref, rtol=1e-6, atol=1e-6)


def test_accounting_numbers():
    codes, bmap = random_case(33, 70, 32, 16, "mix", 5)
    p = bp.pack(codes, bmap, 32, 16)
    a = bp.bits_accounting(p, scale_bits=16, zero_bits=None)
    assert a["offset_bits"] == 64 * bmap.numel() and a["bitmap_bits"] == 8 * bmap.numel()
    assert a["scale_bits"] == 16 * 33 * 3 and a["zero_bits"] == 32
    assert a["total_bits"] == a["plane_bits"] + a["offset_bits"] + a["bitmap_bits"] + 16 * 99 + 32
    assert a["bits_per_weight"] == pytest.approx(a["total_bits"] / (33 * 70))


def test_bad_input():
    with pytest.raises(ValueError, match="outside its 2-bit range"):
        bp.pack(torch.full((2, 8), 4, dtype=torch.int32), 2, 8)
    with pytest.raises(ValueError, match="bits must be in 1..8"):
        bp.pack(torch.zeros(2, 8, dtype=torch.int32), 9, 8)
    with pytest.raises(ValueError, match=r"\[row blocks=1, groups=2\]"):
        bp.pack(torch.zeros(2, 8, dtype=torch.int32), torch.ones(2, 2, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="row_block must be >= 1"):
        bp.pack(torch.zeros(2, 8, dtype=torch.int32), 2, 4, 0)
    with pytest.raises(ValueError, match="2-D integer"):
        bp.pack(torch.zeros(2, 8), 2, 4)


def test_empty():
    p = bp.pack(torch.zeros(0, 5, dtype=torch.int32), 3, 2)
    assert bp.unpack(p).shape == (0, 5)
    p = bp.pack(torch.zeros(4, 0, dtype=torch.int32), 3, 2)
    assert bp.unpack(p).shape == (4, 0)
