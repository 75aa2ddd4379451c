"""MosaicQuant's fused dense base + residual blocks in one Triton kernel
(kernels/triton/blockres.py; issue 76,
MosaicQuant §4.2) against the module's reference forward ``F.linear(x, dequantize_reference())``, under the
interpreter with the device stand-in (the module picks the kernel as it would on CUDA).

Bitwise on exact inputs (integer ``x``, power-of-two scales: every product and partial sum is exact in
float32, so the kernel's order of the ``K + k`` terms cannot matter); otherwise within the float32
accumulation bound of those terms (the kernel multiplies base and residual separately, the reference adds
them per weight first), plus, for half ``x``, the rounding of each weight tile to ``x``'s dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.formats.act import ActQuantSpec, fake_quant
from bitmosaic.formats.packing import pack_codes
from bitmosaic.kernels.triton.blockres import TritonBlockResidualWeight
from bitmosaic.kernels.triton.intmm import TritonIntWeight
from bitmosaic.modules import attach_input_quant
from bitmosaic.modules.mosaic import MosaicQuantLinear
from tests.helpers import env_var

from .helpers import accumulation_bound, assert_close_sum, device, make_inputs, pow2_scales, stand_in


def _mosaic(g, N, K, block, density, exact, n_columns=0):
    """A mosaic layer with random base codes and a random ``density`` of residual blocks (at least one);
    ``n_columns``: the channel residual on that many gathered columns."""
    bm, bk = block
    m = MosaicQuantLinear(K, N, bits=4, group_size=None, symmetric=True, block_rows=bm, block_cols=bk,
                          n_blocks=0, n_columns=n_columns, bias=True)  # fmt: skip
    KR = n_columns or K
    nrb, ncb = -(-N // bm), -(-KR // bk)
    sel = torch.rand(nrb * ncb, generator=g) < density
    sel[int(torch.randint(nrb * ncb, (1,), generator=g))] = density > 0  # at least one block, or none
    idx = torch.nonzero(sel).reshape(-1).to(torch.int32)
    n = idx.numel()
    m.qweight.copy_(pack_codes(torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32), 4))
    blocks = torch.randint(-8, 8, (n * bm, bk), generator=g, dtype=torch.int32)
    if exact:
        m.scales.copy_(pow2_scales(g, (N, 1)))
        rs = pow2_scales(g, (n, bm), 2, 6)
    else:
        m.scales.copy_((torch.rand(N, 1, generator=g) * 0.1 + 1e-3).half())
        rs = (torch.rand(n, bm, generator=g) * 0.02 + 1e-4).half()
    m.res_index = idx
    m.res_qweight = pack_codes(blocks + 8, 4)
    m.res_scales = rs
    if n_columns:
        m.res_columns.copy_(torch.randperm(K, generator=g)[:n_columns].sort().values.to(torch.int32))
    m.bias.copy_(torch.randn(N, generator=g))
    return m.to(device())


def _parts(m):
    """(base, residual) float32 weights of ``m``: the reference's two terms."""
    res = m.residual_dense()
    return m.dequantize_reference() - res, res


def _bound(x, m, dtype=torch.float32):
    base, res = _parts(m)
    xf = x.float()
    b = accumulation_bound(torch.cat([xf, xf], 1), torch.cat([base, res], 1))
    if (
        dtype != torch.float32
    ):  # each tile rounded to x's dtype in the kernel (unit roundoff, twice for safety)
        eps = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
        b = b + eps * (xf.abs() @ (base.abs() + res.abs()).T)
    return b


def _run(m, x):
    k = m.kernel()
    assert isinstance(k, TritonBlockResidualWeight) and isinstance(k.dense, TritonIntWeight)
    with torch.no_grad():
        return m(x)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    N=st.integers(1, 70),
    K=st.integers(8, 150),
    block=st.sampled_from([(16, 32), (24, 40), (32, 16), (64, 64), (8, 8)]),
    density=st.sampled_from([0.0, 0.3, 1.0]),
    M=st.sampled_from([1, 3, 18]),
    columns=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fused_kernel_is_the_reference_bitwise_on_exact_inputs(N, K, block, density, M, columns, seed):
    """Edge blocks on both axes, blocks thinner and wider than a tile, no block, one, or every block
    selected, the channel residual (gathered input columns): ``F.linear(x, base + residual) + b`` bitwise."""
    with stand_in():
        g = torch.Generator().manual_seed(seed)
        k = max(1, K // 3) if columns else 0
        m = _mosaic(g, N, K, block, density, exact=True, n_columns=k)
        x = make_inputs(g, M, K, exact=True)
        y = _run(m, x)
        assert torch.equal(y, F.linear(x, m.dequantize_reference(), m.bias))
        assert (m.residual_dense().abs().sum() > 0) == (density > 0)  # a residual to add, or none at all


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    N=st.integers(1, 70),
    K=st.integers(16, 150),
    block=st.sampled_from([(16, 32), (24, 40), (64, 64)]),
    M=st.sampled_from([1, 5, 20]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_fused_kernel_within_the_accumulation_bound(N, K, block, M, dtype, seed):
    with stand_in():
        g = torch.Generator().manual_seed(seed)
        m = _mosaic(g, N, K, block, 0.4, exact=False)
        x = make_inputs(g, M, K, exact=False, dtype=dtype)
        with torch.no_grad():
            y = _run(m, x) - m.bias.to(dtype)  # the bias is added after the kernel's rounding
        ref32 = x.float() @ m.dequantize_reference().T
        bound = _bound(x, m, dtype)
        if dtype != torch.float32:  # the bias add's own rounding in x's dtype
            eps = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
            bound = bound + eps * 2 * (ref32.abs() + m.bias.abs() + bound)
        assert_close_sum(y, ref32, bound, dtype)


@pytest.mark.parametrize("spec", [ActQuantSpec("int", 8), ActQuantSpec("int", 4)])
def test_quantized_activations_run_the_float_q_of_x(spec):
    """W4A8 / W4A4: off the CPU (here ``$BITMOSAIC_ACT_COMPUTE=sim``) the input pre-hook quantizes ``x`` in
    float and the kernel multiplies that ``Q(X)``: the reference ``F.linear(Q(X), W) + b``."""
    with stand_in(), env_var("BITMOSAIC_ACT_COMPUTE", "sim"):
        g = torch.Generator().manual_seed(7)
        m = _mosaic(g, 40, 96, (16, 32), 0.3, exact=False)
        attach_input_quant(m, spec, 96)
        x = make_inputs(g, 6, 96, exact=False)
        with torch.no_grad():
            assert not m.runs_int_act(x)
            y = _run(m, x)
        xq = fake_quant(x, m.input_quant.spec, m.input_quant.scale)
        assert not torch.equal(xq, x)
        ref32 = xq @ m.dequantize_reference().T
        assert_close_sum(y - m.bias, ref32, _bound(xq, m) * 2, torch.float32)


@pytest.mark.slow
def test_load_on_the_device_runs_the_fused_kernel(tmp_path):
    """``bitmosaic.load`` under the stand-in: every mosaic layer holds the Triton kernel (built at load,
    the dense base's saved buffers released and rebuilt exactly), the logits match the CPU kernels'."""
    import bitmosaic
    from bitmosaic.io import save_quantized
    from tests.methods.saved_bytes import calib, tiny_llama

    model = tiny_llama()
    bitmosaic.quantize_(
        model, "mosaic", calib(), progress=False, budget_frac=0.2, block="16x32", smooth=False
    )
    path = save_quantized(model, tmp_path / "m", {"method": "mosaic"})
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    cpu = bitmosaic.load(path, device="cpu")
    with torch.no_grad():
        want = cpu(ids).logits
    with stand_in():
        gpu = bitmosaic.load(path, device="cpu")
        layers = [m for m in gpu.modules() if isinstance(m, MosaicQuantLinear)]
        assert layers and all(isinstance(m._kernel, TritonBlockResidualWeight) for m in layers)
        assert any(m._kernel.codes.shape[0] for m in layers)
        assert all("qweight" in m._released for m in layers)  # rebuilt from the kernel's base, exactly
        assert torch.equal(layers[0].qweight, cpu.get_submodule(_name(gpu, layers[0])).qweight)
        with torch.no_grad():
            got = gpu(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _name(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module)
