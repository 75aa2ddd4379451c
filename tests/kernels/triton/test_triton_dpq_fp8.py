"""DPQ's FP8 tensor-core product in the Triton INT kernel (kernels/triton/intmm.py, issue 76; DPQ §3,
Fig. 3): INT4 codes dequantized to E4M3, activations quantized to E4M3, both fed to an fp8 ``tl.dot``
with float32 accumulation, against the project's FP8 GEMM reference (kernels/fp8.py) under Triton's
interpreter, which runs an fp8 ``tl.dot`` (exact products, float32 sums).  The capability check that
picks that path on a GPU is tested with a mocked capability.

Only a GPU checks: that Triton compiles the fp8 ``tl.dot`` on sm_89/sm_90 and that the tensor cores'
float32 accumulation stays within the bound (``benchmarks/gpu_kernels.py`` reports its error there).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.formats.act import ActQuantSpec, fake_quant
from bitmosaic.formats.fp import fp_round
from bitmosaic.kernels import triton as tk
from bitmosaic.kernels.fp8 import fp8_gemm_reference
from bitmosaic.kernels.triton.intmm import TritonIntWeight
from bitmosaic.modules.actquant import attach_input_quant
from bitmosaic.modules.kernel import ScaledInputKernel
from bitmosaic.modules.qmodules import FP8ComputeQuantLinear

from .helpers import (
    U32,
    accumulation_bound,
    assert_close_sum,
    device,
    need_triton,
    packed_layer,
    pow2_scales,
    stand_in,
)

SPEC = ActQuantSpec("e4m3", 8, granularity="tensor", static=True)


class _Spy:
    """Records the ``DOT_FP8`` flag of every ``gemm_kernel`` launch (and launches it)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.dot_fp8 = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.dot_fp8.append(kw["DOT_FP8"])
            return self.kernel[grid](*args, **kw)

        return launch


@contextlib.contextmanager
def spying():
    """Launches of the GEMM kernel recorded while inside."""
    need_triton()
    jit = tk.jit_module("intmm_jit")
    s = _Spy(jit.gemm_kernel)
    jit.gemm_kernel = s
    try:
        yield s
    finally:
        jit.gemm_kernel = s.kernel


@pytest.fixture
def spy():
    with spying() as s:
        yield s


def _weights(g, N, K, gs, per_channel, exact):
    """A DPQ Triton weight and its parts: ``(w, w8, s_w)`` with ``w8 = nearest_E4M3((c - z) s)``."""
    G = -(-K // gs)
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32)
    if exact:
        s, z = pow2_scales(g, (N, G), 0, 2).float(), torch.randint(0, 16, (N, G), generator=g).float()
        sw = pow2_scales(g, (N if per_channel else 1, 1), -2, 3).float()
    else:
        s, z = torch.rand(N, G, generator=g) * 20 + 0.5, torch.rand(N, G, generator=g) * 16
        sw = torch.rand(N if per_channel else 1, 1, generator=g) * 0.02 + 1e-3
    base = TritonIntWeight.from_codes(codes, 4, s, z, gs)
    w8 = fp_round(base.dequantize(), "e4m3")  # (c - z) s exactly, then E4M3 (saturating at 448)
    dev = device()
    on = TritonIntWeight(base.qweight.to(dev), base.scales.to(dev), base.zeros.to(dev), K, base.group_size, 4)
    return on.with_fp8(sw.to(dev)), w8, sw


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    N=st.integers(1, 40),
    gs=st.sampled_from([32, 64]),
    n_groups=st.integers(1, 3),
    M=st.sampled_from([1, 3, 20]),
    per_channel=st.booleans(),
    exact=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_fp8_operands_are_the_fp8_gemm(N, gs, n_groups, M, per_channel, exact, dtype, seed):
    """``(x8 @ w8ᵀ) s_x s_w`` of kernels/fp8.py with ``x8`` the activation quantizer's E4M3 values: equal on
    exact inputs (small integers, power-of-two scales), else within the float32 accumulation bound plus the
    two roundings of the scaling; every row count (decode too) takes the FP8 ``tl.dot``."""
    g = torch.Generator().manual_seed(seed)
    K = gs * n_groups - (3 if n_groups > 1 else 0)
    w, w8, sw = _weights(g, N, K, gs, per_channel, exact)
    if exact:
        x, sx = torch.randint(-8, 9, (M, K), generator=g).float(), torch.tensor([0.5])
    else:
        x, sx = torch.randn(M, K, generator=g) * 3, torch.rand(1, generator=g) * 0.05 + 0.01
    xq = fake_quant(x.to(dtype), SPEC, sx)  # what the layer's input quantizer hands the kernel
    x8 = fp_round(xq.float() / sx, "e4m3")  # what the kernel multiplies: the quantizer's own E4M3 values
    assert torch.equal(x8, fp_round(x.to(dtype).float() / sx, "e4m3"))
    dev = device()
    with spying() as spy:
        y = w.matmul(xq.to(dev), x_scale=sx.to(dev)).cpu()
    assert spy.dot_fp8 == [True]
    ref = fp8_gemm_reference(x8, w8, sx, sw)
    if exact and dtype == torch.float32:
        assert torch.equal(y, ref)
    else:
        scale = sx.abs() * sw.reshape(1, -1).abs()
        bound = accumulation_bound(x8, w8) * scale * (1 + 4 * U32) + 4 * U32 * ref.abs()
        assert_close_sum(y, ref, bound, dtype)


def test_the_capability_decides_the_path(monkeypatch):
    """CUDA: FP8 operands from capability 8.9 (Ada, Hopper), the float path below (mocked capability); the
    interpreter on the CPU runs them; ``$BITMOSAIC_TRITON_FP8_DOT=0`` turns them off everywhere."""
    need_triton()
    for cap, want in (((7, 5), False), ((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        assert tk.fp8_dot("cuda") is want and tk.fp8_dot("cuda:0") is want
    monkeypatch.setenv(tk.FP8_DOT_ENV, "0")
    assert not tk.fp8_dot("cuda") and not tk.fp8_dot("cpu")
    monkeypatch.delenv(tk.FP8_DOT_ENV)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tk.fp8_dot("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not tk.fp8_dot("cpu")  # compiled Triton runs no CPU kernel


def test_fp8_operands_need_a_dpq_weight_and_an_activation_scale():
    need_triton()
    g = torch.Generator().manual_seed(0)
    w, _, _ = _weights(g, 8, 64, 32, False, True)
    x, sx = torch.zeros(2, 64, device=device()), torch.ones(1, device=device())
    assert w.fp8_operands(x, sx) and not w.fp8_operands(x, None)
    plain = TritonIntWeight(w.qweight, w.scales, w.zeros, w.K, w.group_size, w.bits)
    assert not plain.fp8_operands(x, sx)
    with pytest.raises(ValueError, match="one per-tensor activation scale"):
        w.matmul(x, x_scale=torch.ones(3))


def _dpq_layer(g, N, K, act: ActQuantSpec | None, sx: float):
    dense = packed_layer(g, 4, N, K, 32, False, act_order=True, exact=False)
    m = FP8ComputeQuantLinear._from_packed(dense, fmt="e4m3", fp8_rows=N)
    m.fp8_scale.copy_(torch.rand(N, 1, generator=g) * 0.02 + 1e-3)
    if act is not None:
        attach_input_quant(m, act, K, scale=torch.tensor([sx]) if act.static else None)
    return m


@pytest.mark.parametrize("M", [1, 19])
def test_dpq_layer_with_fp8_activations_runs_fp8_operands(spy, monkeypatch, M):
    """A DPQ layer with its static per-tensor E4M3 input quantizer (DPQ §4.1) runs the FP8 ``tl.dot``
    (act-order gather included), equal to the FP8 GEMM of its quantized input and weight operand within
    the bound; with ``$BITMOSAIC_TRITON_FP8_DOT=0`` (as below capability 8.9) the float path, within the
    bound of ``F.linear`` on the same quantized input."""
    with stand_in():
        g = torch.Generator().manual_seed(M)
        N, K, sx = 24, 96, 0.03
        m = _dpq_layer(g, N, K, SPEC, sx)
        x = torch.randn(M, K, generator=g) * 2
        k = m.kernel()
        assert isinstance(k, ScaledInputKernel) and k.act_scale() is m.input_quant.scale
        x8 = fp_round(x / sx, "e4m3")
        ref = fp8_gemm_reference(x8, m.fp8_weight(), torch.tensor(sx), m.fp8_scale)
        scale = sx * m.fp8_scale.reshape(1, -1)
        bound = accumulation_bound(x8, m.fp8_weight()) * scale + 4 * U32 * ref.abs()
        with torch.no_grad():
            assert_close_sum(m(x), ref, bound, torch.float32)
        assert spy.dot_fp8 == [True]
        monkeypatch.setenv(tk.FP8_DOT_ENV, "0")
        xq = fake_quant(x, SPEC, torch.tensor([sx]))
        w = m.dequantize_reference()
        with torch.no_grad():
            assert_close_sum(m(x), F.linear(xq, w), accumulation_bound(xq, w), torch.float32)
        assert spy.dot_fp8 == [True] + ([False] if M > 8 else [])  # decode: the float GEMV


@pytest.mark.parametrize(
    "act", [None, ActQuantSpec("e4m3", 8, granularity="token"), ActQuantSpec("int", 8, granularity="token")]
)
def test_other_activation_quantizers_take_the_float_path(spy, act):
    """No input quantizer, a dynamic one or an INT one: no per-tensor E4M3 scale, so the float path."""
    with stand_in():
        g = torch.Generator().manual_seed(1)
        m = _dpq_layer(g, 16, 64, act, 0.1)
        assert m.fp8_act_scale() is None
        x = torch.randn(12, 64, generator=g)
        with torch.no_grad():
            y = m(x)
        xq = x if act is None else fake_quant(x, act)
        w = m.dequantize_reference()
        assert_close_sum(y, F.linear(xq, w), accumulation_bound(xq, w), torch.float32)
        assert spy.dot_fp8 == [False]
