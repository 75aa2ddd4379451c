"""SQ-format's static split GEMM in one Triton kernel (kernels/triton/sqsplit.py; issue 76, SQ-format
§3.2.2, Fig. 2(b)) against the module's reference forward (:meth:`SQActLinear._linear`: the split, then the
high and the low part's float32 matmuls on the high-first stored weight), under the interpreter with the
device stand-in and ``$BITMOSAIC_ACT_COMPUTE=sim`` (on CUDA the integer CPU path does not exist either).

Bitwise where every sum is exact (calibrated power-of-two activation scales, activations on those grids,
power-of-two weight scales and integer zero-points): the kernel's activation values and weights are the
reference's float32 values, so only the order of exact sums differs.  Otherwise within the float32
accumulation bound of the ``K`` terms (the kernel sums both parts in one accumulator, the reference sums
each part and then adds) plus the rounding of the bias add."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.algorithms.sq import static_channel_mask, static_split
from bitmosaic.formats.sq import parse_sq
from bitmosaic.formats.sq_act import act_scale_group
from bitmosaic.kernels.triton.sqsplit import TritonSQSplitWeight
from bitmosaic.modules.sq import SQActLinear
from tests.helpers import env_var

from .helpers import U32, accumulation_bound, device, packed_layer, pow2_scales, stand_in

FORMATS = [
    "16-(8/4)-0.5",
    "16-(8/4)-0.75",
    "32-(8/4)-0.75",
    "16-(8/0)-0.5",
    "16-(8/2)-0.5",
    "16-(fp8/fp4)-0.5",
]


def _layer(g, sq, scale, group, calibrated, bits, N, K, gs, sym, exact):
    dense = packed_layer(g, bits, N, K, gs, sym, False, exact=exact).cpu()
    dense.bias = torch.nn.Parameter(torch.randn(N, generator=g), requires_grad=False)
    fmt = parse_sq(sq)
    mask = static_channel_mask(torch.rand(K, generator=g), fmt)
    scales = None
    if calibrated:
        n = -(-K // act_scale_group(fmt, K, scale, group))
        scales = (pow2_scales(g, (n,), 0, 2), pow2_scales(g, (n,), 0, 2))
    m = SQActLinear.from_packed(dense, sq, "static", scale, mask, group, scales)
    return m.to(device())


def _on_grid(g, m, M):
    """Activations whose split is exact: each channel an integer in [-4, 4] times its part's calibrated
    power-of-two scale."""
    K = m.in_features
    gcol = torch.arange(K) // act_scale_group(m.fmt, K, m.act_scale, m.act_group)
    s = torch.where(m.channel_mask().cpu(), m.act_high_scale.float()[gcol], m.act_low_scale.float()[gcol])
    return (torch.randint(-4, 5, (M, K), generator=g).float() * s).to(device())


def _reference(m, x):
    with torch.no_grad():
        return m._linear(x, m.dequantize_reference(), m.bias)


def _run(m, x):
    with env_var("BITMOSAIC_ACT_COMPUTE", "sim"), torch.no_grad():
        assert not m.runs_int_act(x)
        y = m(x)
    assert isinstance(m._kernel, TritonSQSplitWeight)
    return y


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    sq=st.sampled_from(FORMATS),
    scale=st.sampled_from([("bank", None), ("group", 32), ("group", 48)]),
    bits=st.sampled_from([3, 4, 8]),
    gs=st.sampled_from([32, 64]),
    K=st.sampled_from([64, 96, 160]),
    N=st.integers(1, 40),
    M=st.sampled_from([1, 4, 19]),
    sym=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_split_kernel_is_the_reference_bitwise_on_exact_inputs(sq, scale, bits, gs, K, N, M, sym, seed):
    with stand_in():
        g = torch.Generator().manual_seed(seed)
        m = _layer(g, sq, *scale, True, bits, N, K, gs, sym, exact=True)
        x = _on_grid(g, m, M)
        y = _run(m, x)
        assert torch.equal(y, _reference(m, x))
        assert not torch.equal(y, torch.zeros_like(y))


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    sq=st.sampled_from(FORMATS),
    scale=st.sampled_from([("token", None), ("bank", None), ("group", 64)]),
    calibrated=st.booleans(),
    K=st.sampled_from([64, 128, 144]),
    N=st.integers(1, 40),
    M=st.sampled_from([1, 5, 18]),
    sym=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_split_kernel_within_the_accumulation_bound(sq, scale, calibrated, K, N, M, sym, dtype, seed):
    with stand_in():
        g = torch.Generator().manual_seed(seed)
        m = _layer(g, sq, *scale, calibrated and scale[0] != "token", 4, N, K, 32, sym, exact=False)
        x = (torch.randn(M, K, generator=g) * torch.linspace(0.2, 3, K)).to(dtype).to(device())
        y = _run(m, x)
        sp = m._kernel.split
        a = static_split(
            x.float(), sp["mask"], sp["fmt"], sp["scale"], sp["group"], sp["scales"]
        ).dequantize()
        w = m.dequantize_reference()
        exact = a.double() @ w.double().T + m.bias.double()
        bound = accumulation_bound(a, w) + 2 * U32 * (exact.abs() + m.bias.abs().double()).float()
        if dtype != torch.float32:  # the kernel's result, the bias and their sum rounded to x's dtype
            bound = bound + 2.0**-7 * (exact.abs() + 2 * m.bias.abs().double()).float()
        assert float(((y.double() - exact).abs() - bound).max()) <= 0
        ref = _reference(m, x)
        assert float(((ref.double() - exact).abs() - bound).max()) <= 0  # the bound holds the reference


def test_resident_buffers_are_released_and_rebuilt():
    """The kernel holds the packed weight: the module's saved buffers are released, rebuilt on demand
    bitwise (saved bytes unchanged), and a state dict of the module is the one before."""
    with stand_in():
        g = torch.Generator().manual_seed(1)
        m = _layer(g, "16-(8/4)-0.5", "bank", None, False, 4, 24, 96, 32, False, exact=False)
        before = {k: v.clone() for k, v in m.state_dict().items()}
        _run(m, torch.randn(3, 96, generator=g).to(device()))
        assert {"qweight", "scales", "zeros"} <= m._released
        after = m.state_dict()
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_load_on_the_device_runs_the_split_kernel(tmp_path):
    """``bitmosaic.load`` under the stand-in: every static SQ layer holds the Triton split kernel and the
    logits match the CPU's simulated split (the same float function)."""
    import bitmosaic
    from bitmosaic.io import save_quantized
    from tests.methods.saved_bytes import calib, tiny_llama

    model = tiny_llama()
    bitmosaic.quantize_(model, "sq-acts", calib(), progress=False, strategy="static", act_scale="bank")
    path = save_quantized(model, tmp_path / "m", {"method": "sq-acts"})
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    with env_var("BITMOSAIC_ACT_COMPUTE", "sim"):
        cpu = bitmosaic.load(path, device="cpu")
        with torch.no_grad():
            want = cpu(ids).logits
        with stand_in():
            gpu = bitmosaic.load(path, device="cpu")
            layers = [m for m in gpu.modules() if isinstance(m, SQActLinear)]
            assert layers and all(isinstance(m._kernel, TritonSQSplitWeight) for m in layers)
            with torch.no_grad():
                got = gpu(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
