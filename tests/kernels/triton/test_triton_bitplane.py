"""SFMP's bit-plane GEMV in Triton (kernels/triton/bitplane.py, issue 76) against the format's reference
dequantization, under the interpreter: mixed widths per block, partial blocks and tiles."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.formats import bitplane
from bitmosaic.kernels.triton.bitplane import bitplane_gemv

from .helpers import accumulation_bound, assert_close_sum, device, need_triton, pow2_scales


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    N=st.integers(1, 40),
    gs=st.sampled_from([32, 64, 128]),
    n_groups=st.integers(1, 3),
    row_block=st.sampled_from([16, 20, 32, 64]),
    M=st.integers(1, 3),
    exact=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bitplane_gemv_matches_the_format(N, gs, n_groups, row_block, M, exact, seed):
    need_triton()
    g = torch.Generator().manual_seed(seed)
    K = gs * n_groups - (5 if n_groups > 1 else 0)
    G = n_groups
    n_rb = -(-N // row_block)
    bmap = torch.randint(1, 9, (n_rb, G), generator=g).to(torch.uint8)
    rows_bits = bmap.repeat_interleave(row_block, 0)[:N].long()  # [N, G]
    cols_bits = rows_bits.repeat_interleave(gs, 1)[:, :K]
    codes = (torch.rand(N, K, generator=g) * (2.0**cols_bits)).floor().to(torch.int32)
    if exact:
        s, z = pow2_scales(g, (N, G)).float(), (2.0 ** (rows_bits - 1)).floor()
        x = torch.randint(-4, 5, (M, K), generator=g).float()
    else:
        s, z = torch.rand(N, G, generator=g).half().float() * 0.1, torch.rand(N, G, generator=g) * 4
        x = torch.randn(M, K, generator=g)
    p = bitplane.pack(codes, bmap, gs, row_block)
    assert torch.equal(bitplane.unpack(p), codes)
    w = bitplane.dequantize(codes, s, z, gs)
    dev = device()
    p_dev = bitplane.BitPlanes(p.data.to(dev), p.offsets.to(dev), p.bits.to(dev), p.N, p.K, gs, p.row_block)
    y = bitplane_gemv(p_dev, s.to(dev), z.to(dev), x.to(dev)).cpu()
    if exact:
        assert torch.equal(y, F.linear(x, w))
    else:
        assert_close_sum(y, x @ w.T, accumulation_bound(x, w), torch.float32)
