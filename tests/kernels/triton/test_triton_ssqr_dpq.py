"""SSQR's dense + CSR outlier kernel and DPQ's INT -> FP8 E4M3 dequantization in the Triton INT kernel
(kernels/triton/sparse.py, intmm.py; issue 76) against the modules' reference paths, under the interpreter."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.formats.fp import fp_round
from bitmosaic.kernels.triton.intmm import TritonIntWeight
from bitmosaic.kernels.triton.sparse import TritonSparseAddKernel
from bitmosaic.modules.qmodules import FP8ComputeQuantLinear, SparseOutlierQuantLinear

from .helpers import (
    accumulation_bound,
    assert_close_sum,
    make_inputs,
    need_triton,
    packed_layer,
    pow2_scales,
    stand_in,
)


def _ssqr(g, bits, N, K, gs, act_order, exact, density=0.05):
    dense = packed_layer(g, bits, N, K, gs, False, act_order, exact=exact)
    mask = torch.rand(N, K, generator=g) < density
    if exact:
        vals = torch.randint(-8, 9, (N, K), generator=g).float() * 0.25
    else:
        vals = torch.randn(N, K, generator=g).half().float()
    sparse = torch.where(mask, vals, torch.zeros(()))
    m = SparseOutlierQuantLinear._from_packed(dense, nnz=int((sparse != 0).sum()))
    csr = sparse.to_sparse_csr()
    m.outlier_row_ptr.copy_(csr.crow_indices())
    m.outlier_cols.copy_(csr.col_indices())
    m.outlier_vals.copy_(csr.values())
    return m


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    bits=st.integers(2, 8),
    gs=st.sampled_from([32, 64, 128]),
    n_groups=st.integers(1, 3),
    N=st.integers(1, 40),
    M=st.sampled_from([1, 4, 19]),
    act_order=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_ssqr_exact_on_exactmake_inputs(bits, gs, n_groups, N, M, act_order, seed):
    """Integer x, power-of-two scales, quarter-integer outliers: dense + CSR equals the reference bitwise."""
    with stand_in():
        g = torch.Generator().manual_seed(seed)
        K = gs * n_groups
        m = _ssqr(g, bits, N, K, gs, act_order, exact=True)
        k = m.kernel()
        assert isinstance(k, TritonSparseAddKernel) and isinstance(k.dense.weight, TritonIntWeight)
        x = make_inputs(g, M, K, exact=True)
        assert torch.equal(m(x), F.linear(x, m.dequantize_reference()))


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    K=st.integers(16, 200),
    N=st.integers(1, 50),
    M=st.sampled_from([1, 3, 17]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_ssqr_float_within_accumulation_bound(K, N, M, dtype, seed):
    """Float inputs: the dense part rounded to ``x``'s dtype (as the CPU kernel), then the outliers added in
    float32 and rounded once -- within the accumulation bound of both sums."""
    with stand_in():
        g = torch.Generator().manual_seed(seed)
        m = _ssqr(g, 4, N, K, 32, False, exact=False, density=0.1)
        x = make_inputs(g, M, K, exact=False, dtype=dtype)
        w = m.dequantize_reference()
        dense_w = w - m.csr().add_to(torch.zeros_like(w))
        y = m(x)
        dense_ref = (x.float() @ dense_w.to(dtype).float().T).to(dtype).float()
        sparse_w = w - dense_w
        ref32 = dense_ref + x.float() @ sparse_w.T
        bound = accumulation_bound(x.float(), dense_w.to(dtype).float()) * (1 + 2.0**-7)
        eps = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
        bound = bound + accumulation_bound(x.float(), sparse_w) + eps * dense_ref.abs()  # a flipped rounding
        assert_close_sum(y, ref32, bound, dtype)


def _dpq(g, bits, N, K, gs, act_order, per_channel, exact):
    dense = packed_layer(g, bits, N, K, gs, False, act_order, exact=exact)
    rows = N if per_channel else 1
    m = FP8ComputeQuantLinear._from_packed(dense, fmt="e4m3", fp8_rows=rows)
    sw = pow2_scales(g, (rows, 1), -2, 3).float() if exact else torch.rand(rows, 1, generator=g) * 0.02 + 1e-3
    m.fp8_scale.copy_(sw)
    return m


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    bits=st.integers(2, 8),
    gs=st.sampled_from([32, 64, 128]),
    N=st.integers(1, 40),
    M=st.sampled_from([1, 2, 18]),
    per_channel=st.booleans(),
    act_order=st.booleans(),
    exact=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_dpq_fp8_dequantization_is_the_reference(bits, gs, N, M, per_channel, act_order, exact, seed):
    """The kernel's weight is ``fp_round((c - z) s, e4m3) * s_w`` bitwise (the in-kernel E4M3 rounding is
    torch's float8_e4m3fn cast, saturation and subnormals included); the product is exact on exact inputs
    (power-of-two ``s_w``), else within the float32 accumulation bound."""
    with stand_in():
        g = torch.Generator().manual_seed(seed)
        K = 2 * gs - 5
        m = _dpq(g, bits, N, K, gs, act_order, per_channel, exact)
        k = m.kernel()
        assert isinstance(k.weight, TritonIntWeight) and k.weight.fp8_scale is not None
        w = m.dequantize_reference()
        assert torch.equal(k.dequantize_rows(slice(None)), w)
        x = make_inputs(g, M, K, exact=exact)
        y = m(x)
        if exact:
            assert torch.equal(y, F.linear(x, w))
        else:
            assert_close_sum(y, x @ w.T, accumulation_bound(x, w), torch.float32)


def test_e4m3_rounding_covers_the_grid():
    """Every E4M3 value, the midpoints between neighbours (ties to even), subnormals and saturation: the
    kernel's rounding (through a 1-code, scale-1 weight) equals torch's float8_e4m3fn cast."""
    need_triton()
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    v = torch.cat([grid, mids, grid * 1.01, torch.tensor([500.0, -1e4, 1e-5, -3e-3, 0.0])])
    n = v.numel()
    w = TritonIntWeight.from_codes(torch.ones(n, 1, dtype=torch.int32), 2, v.reshape(n, 1), 0.0, -1)
    w = w.with_fp8(torch.ones(1, 1))
    assert torch.equal(w.dequantize()[:, 0], fp_round(v, "e4m3"))
