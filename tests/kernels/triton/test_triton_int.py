"""The packed INT kinds' Triton kernels (kernels/triton/intmm.py, issue 76) against the reference path
(``F.linear(x, QuantLinear.dequantize_reference())``), under Triton's interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.formats.layout import dequantize
from bitmosaic.kernels.triton.intmm import GEMV_MAX_ROWS, TritonIntWeight
from bitmosaic.modules.kernel import LowBitKernel

from .helpers import (
    accumulation_bound,
    assert_close_sum,
    device,
    make_inputs,
    need_triton,
    packed_layer,
    stand_in,
)


def _kernel(m) -> TritonIntWeight:
    k = m.kernel()
    assert isinstance(k, LowBitKernel) and isinstance(k.weight, TritonIntWeight)
    return k


def test_triton_is_installed():
    """CI installs Triton: its absence is a failure, not a skip (unless switched off explicitly)."""
    need_triton()


@settings(max_examples=14, deadline=None, derandomize=True)
@given(
    bits=st.integers(2, 8),  # the packed kind stores 2-8 bits (1-bit: the weight class, below)
    gs=st.sampled_from([32, 64, 128, 48]),
    n_groups=st.integers(1, 3),
    N=st.integers(1, 40),
    M=st.sampled_from([1, 3, GEMV_MAX_ROWS + 1, 20]),
    symmetric=st.booleans(),
    act_order=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_exact_on_exactmake_inputs(bits, gs, n_groups, N, M, symmetric, act_order, seed):
    """Integer x, power-of-two scales, integer zero-points: every partial sum is exact in float32, so the
    GEMV (<= 8 rows) and the tl.dot GEMM equal the reference bitwise, whatever their summation order; the
    kernel's dequantization equals the reference one bitwise (saved column order)."""
    with stand_in():
        g = torch.Generator().manual_seed(seed)
        K = gs * n_groups - (3 if n_groups > 1 else 0)  # a partial last group
        m = packed_layer(g, bits, N, K, gs, symmetric, act_order, exact=True)
        k = _kernel(m)
        ref_w = m.dequantize_reference()
        assert torch.equal(k.dequantize_rows(slice(None)), ref_w)
        x = make_inputs(g, M, K, exact=True)
        assert torch.equal(m(x), F.linear(x, ref_w))


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    bits=st.integers(2, 8),
    gs=st.sampled_from([32, 64, 128]),
    K=st.integers(8, 300),
    N=st.integers(1, 70),
    M=st.sampled_from([1, 2, 17, 33]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    act_order=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_float_inputs_within_accumulation_bound(bits, gs, K, N, M, dtype, act_order, seed):
    """Random float inputs and fp16 scales/fractional zeros: the dequantization is still bitwise the
    reference; the product differs from the reference only by float32 accumulation order (bounded by
    ``2 gamma_K |x||W|``) plus the final rounding to ``x``'s dtype.  A half ``x`` multiplies the weight
    rounded to its dtype, as ``F.linear`` with the half weight the CUDA fallback path uses."""
    with stand_in():
        g = torch.Generator().manual_seed(seed)
        m = packed_layer(g, bits, N, K, gs, False, act_order, exact=False)
        k = _kernel(m)
        w = m.dequantize_reference()
        assert torch.equal(k.dequantize_rows(slice(None)), w)
        x = make_inputs(g, M, K, exact=False, dtype=dtype)
        wd = w.to(dtype).float()
        ref32 = x.float() @ wd.T
        y = m(x)
        assert y.dtype == dtype and y.shape == (M, N)
        assert_close_sum(y, ref32, accumulation_bound(x.float(), wd), dtype)


def test_no_clip_offset_and_batch_dims():
    """Codes outside the bit grid (stored at a wider width with ``code_offset``, folded into the
    zero-point as on the CPU) and a 3-D input."""
    with stand_in():
        g = torch.Generator().manual_seed(3)
        m = packed_layer(g, 3, 24, 96, 32, False, False, exact=True, offset=-2)
        assert m.storage_bits == 4 and m.code_offset == -2
        x = make_inputs(g, 6, 96, exact=True).reshape(2, 3, 96)
        ref = F.linear(x, m.dequantize_reference())
        assert torch.equal(m(x), ref)


def test_saved_bytes_survive_the_kernel():
    """The kernel holds the weight (saved buffers released); a save rebuilds them bit for bit."""
    with stand_in():
        g = torch.Generator().manual_seed(5)
        m = packed_layer(g, 4, 16, 128, 32, False, True, exact=False)
        before = {k: v.clone() for k, v in m.state_dict().items()}
        _kernel(m)
        assert m._released  # qweight/scales/zeros/g_idx rebuilt from the Triton weight, checked equal
        after = m.state_dict()
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_dequantize_matches_layout_reference_direct():
    """The weight class alone, every width: its dequantization equals formats.layout.dequantize."""
    need_triton()
    g = torch.Generator().manual_seed(7)
    for bits in range(1, 9):
        N, K, gs = 5, 72, 32
        codes = torch.randint(0, 1 << bits, (N, K), generator=g, dtype=torch.int32)
        s = (torch.rand(N, 3, generator=g) + 0.01).half()
        z = (torch.rand(N, 3, generator=g) * 4).half()
        w = TritonIntWeight.from_codes(codes.to(device()), bits, s.to(device()), z.to(device()), gs)
        ref = dequantize(codes, s, z, torch.arange(K) // gs)
        assert torch.equal(w.dequantize().cpu(), ref), bits
        sym = TritonIntWeight.from_codes(codes.to(device()), bits, s.to(device()), 2.0 ** (bits - 1), gs)
        ref_sym = dequantize(codes, s, 2.0 ** (bits - 1), torch.arange(K) // gs)
        assert torch.equal(sym.dequantize(slice(1, 4)).cpu(), ref_sym[1:4])


def test_bad_input_one_line_errors():
    need_triton()
    codes = torch.zeros(4, 16, dtype=torch.int32)
    with pytest.raises(ValueError, match="one width in 1..8"):
        TritonIntWeight.from_codes(codes, 9, torch.ones(4, 1), 0.0, -1)
    with pytest.raises(ValueError, match="scales must be"):
        TritonIntWeight.from_codes(codes, 4, torch.ones(4, 2), 0.0, -1)
    w = TritonIntWeight.from_codes(codes.to(device()), 4, torch.ones(4, 1, device=device()), 0.0, -1)
    with pytest.raises(ValueError, match="features"):
        w.matmul(torch.zeros(1, 15, device=device()))
