"""DPQ (Dual Precision Quantization, W4A8 with FP8 compute): §2.2, §3.1 Eqs. 6-12, §3.2, §3.3."""

import pytest
import torch

from bitmosaic.algorithms import (
    HessianAccumulator,
    gptq_quantize,
    groups_contiguous,
    hessian_error,
    make_order,
)
from bitmosaic.algorithms.dpq import (
    INT4,
    DPQResult,
    DualPrecisionQuantizer,
    dpq_quantize,
    fp8_weight_scale,
)
from bitmosaic.algorithms.gptq import IntColumnQuantizer
from bitmosaic.algorithms.scales import find_scale_zero
from bitmosaic.formats.fp import fp_round
from bitmosaic.formats.grid import IntGrid
from bitmosaic.formats.layout import is_trivial_g_idx

ZMAX = {"e4m3": 448.0, "e4m3-240": 240.0}


def _e4m3_values(zmax: float) -> torch.Tensor:
    """Every finite E4M3 value, decoded from its bit pattern (bias 7, subnormals, S.1111.111 = NaN);
    the ±240 variant (Gaudi 2, §4.1) is the same patterns restricted to |v| <= 240."""
    vals = set()
    for bits in range(256):
        sign, exp, man = bits >> 7, (bits >> 3) & 0xF, bits & 0x7
        if exp == 0xF and man == 0x7:
            continue  # NaN in the fn encoding
        mag = man / 8 * 2.0 ** (1 - 7) if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
        if mag <= zmax:
            vals.add(-mag if sign else mag)
    return torch.tensor(sorted(vals), dtype=torch.float64)


def _on_grid(x: torch.Tensor, zmax: float) -> bool:
    return bool(torch.isin(x.double().flatten(), _e4m3_values(zmax)).all())


def test_independent_e4m3_enumeration_is_what_we_think():
    v = _e4m3_values(448.0)
    assert v.numel() == 253 and v.max() == 448 and v[v > 0].min() == 2.0**-9  # +0 and -0 collapse
    assert _e4m3_values(240.0).max() == 240 and not _on_grid(torch.tensor([464.0]), 448.0)


def _llm_like_layer(seed: int, out: int = 32, n: int = 128, tokens: int = 512, noise: float = 1.0):
    """Strongly correlated inputs as in LLM activations: a shared rank-8 component plus noise, varied
    channel scales and three outlier channels.  (The Schur pivots of H are ~0.3 of diag(H) here; on
    the weakly mixed ``correlated_inputs`` they are ~0.85, see test_dpq_beats_naive.)"""
    g = torch.Generator().manual_seed(seed)
    Z = torch.randn(tokens, 8, generator=g, dtype=torch.float64)
    X = Z @ torch.randn(8, n, generator=g, dtype=torch.float64)
    X = X + noise * torch.randn(tokens, n, generator=g, dtype=torch.float64)
    X = X * torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 0.7)
    X[:, :3] *= 8.0
    W = torch.randn(out, n, generator=torch.Generator().manual_seed(seed + 1000), dtype=torch.float64) * 0.05
    acc = HessianAccumulator(n, dtype=torch.float64)
    acc.add(X)
    return W, acc.H


def _err(W, res, H) -> float:
    return float(hessian_error(W, res.dequantize(torch.float64), H).sum())


# --- Eq. 6 -------------------------------------------------------------------------------------


def test_fp8_weight_scale_per_tensor_channel_margin_pow2():
    W = torch.tensor([[0.5, -2.0, 1.0], [0.25, 0.1, -0.3]], dtype=torch.float64)
    s = fp8_weight_scale(W)
    assert s.shape == (1, 1) and s.dtype == torch.float32
    assert float(s) >= 2.0 / 448 and float(s) == pytest.approx(2.0 / 448, rel=1e-7)
    assert float(fp8_weight_scale(W, "e4m3-240")) == pytest.approx(2.0 / 240, rel=1e-7)
    assert float(fp8_weight_scale(W, margin=2.0)) == pytest.approx(4.0 / 448, rel=1e-7)
    pc = fp8_weight_scale(W, per_channel=True)
    assert pc.shape == (2, 1)
    assert torch.allclose(pc.double(), torch.tensor([[2.0], [0.3]], dtype=torch.float64) / 448, rtol=1e-7)
    assert (W.abs() / pc.double()).max() <= 448  # rounded up: nothing saturates before GPTQ starts
    p2 = fp8_weight_scale(W, per_channel=True, pow2=True)
    assert torch.equal(p2, torch.exp2(torch.round(torch.log2(p2))))  # exact powers of two (§2.2)
    assert torch.all(p2 >= pc) and torch.all(p2 < 2 * pc)
    assert float(fp8_weight_scale(torch.zeros(2, 3))) > 0  # all-zero weight: any positive scale


@pytest.mark.parametrize(
    "kwargs",
    [{"margin": 0.5}, {"margin": float("nan")}, {"margin": float("inf")}, {"fmt": "e9m9"}],
)
def test_fp8_weight_scale_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        fp8_weight_scale(torch.ones(2, 2), **kwargs)


def test_fp8_weight_scale_rejects_bad_weights():
    with pytest.raises(ValueError, match="2-D"):
        fp8_weight_scale(torch.ones(4))
    with pytest.raises(ValueError, match="non-finite"):
        fp8_weight_scale(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="positive"):
        DualPrecisionQuantizer(torch.tensor([1.0, 0.0]))


# --- Eqs. 7-11: the inference weight is on the FP8 grid ------------------------------------------


@pytest.mark.parametrize("fmt", ["e4m3", "e4m3-240"])
@pytest.mark.parametrize("naive", [False, True])
@pytest.mark.parametrize("order", ["natural", "gar", "act"])
def test_fp8_weight_on_e4m3_grid_and_dequantize_is_inference_weight(layer64, fmt, naive, order):
    W, _, H = layer64
    res = dpq_quantize(W, H, fmt=fmt, group_size=16, perm=make_order(H, order, 16), naive=naive)
    assert isinstance(res, DPQResult) and res.fmt == fmt and res.info["naive"] is naive
    w8 = res.fp8_weight()
    assert w8.dtype == torch.float32 and _on_grid(w8, ZMAX[fmt])
    assert res.codes.min() >= 0 and res.codes.max() <= 15
    assert torch.equal(res.scales.half().to(res.scales.dtype), res.scales)  # fp16-exact scales
    assert torch.equal(res.dequantize(torch.float64), w8.double() * res.fp8_scale.double())  # Eq. 11
    assert torch.equal(res.dequantize(torch.float32), res.dequantize(torch.float64).float())
    assert res.info["fp8_scale_max"] == float(res.fp8_scale.max())


def test_fp8_weight_per_channel_pow2_float32(layer64):
    W, _, H = layer64
    res = dpq_quantize(W.float(), H.float(), group_size=16, per_channel=True, pow2=True, margin=1.5)
    assert res.fp8_scale.shape == (48, 1) and res.fp8_scale.dtype == torch.float32
    assert _on_grid(res.fp8_weight(), 448.0)
    assert res.fp8_weight().abs().max() <= 448 / 1.5 * 2  # headroom used by compensation only


# --- Eq. 12 with both levels: the blocked GPTQ loop equals a column-by-column reference ------------


def _reference_dpq(W, H, perm, group, fmt, s_w, percdamp=0.01):
    """Algorithm 1 one column at a time in float64, no blocks, no Cholesky trick: the OBS update
    (Eq. 12) uses a fresh inverse of the Hessian restricted to the not-yet-quantized columns."""
    Hd = H + percdamp * torch.diagonal(H).mean() * torch.eye(H.shape[0], dtype=H.dtype)
    W = W.clone()
    sw = s_w.double().reshape(-1)
    codes, scales, zeros = torch.zeros_like(W), {}, {}
    order = perm.tolist()
    for t, j in enumerate(order):
        k = j // group
        if k not in scales:  # group scale from the group's current weights in FP8 (Eqs. 7-8, §3.3)
            w8_group = fp_round(W[:, k * group : (k + 1) * group] / sw[:, None], fmt)
            scales[k], zeros[k] = find_scale_zero(w8_group, INT4, "mse")
        w8 = fp_round(W[:, j] / sw, fmt)  # Eq. 7
        q = (torch.round(w8 / scales[k]) + zeros[k]).clamp(0, 15)  # Eq. 9
        w16 = fp_round((q - zeros[k]) * scales[k], fmt) * sw  # Eqs. 10-11
        codes[:, j] = q
        rest = order[t:]
        Hinv = torch.linalg.inv(Hd[rest][:, rest])
        W[:, rest] -= (W[:, j] - w16)[:, None] * (Hinv[0] / Hinv[0, 0])[None, :]  # Eq. 12
    G = -(-W.shape[1] // group)
    return codes, torch.stack([scales[k] for k in range(G)], 1), Hd


@pytest.mark.parametrize(
    "fmt, order, per_channel, pow2",
    [("e4m3", "natural", False, False), ("e4m3-240", "gar", True, False), ("e4m3", "gar", False, True)],
)
def test_dpq_equals_columnwise_reference(fmt, order, per_channel, pow2):
    W, H = _llm_like_layer(3, out=6, n=24, tokens=64)
    perm = make_order(H, order, 8)
    res = dpq_quantize(
        W, H, fmt=fmt, group_size=8, perm=perm, per_channel=per_channel, pow2=pow2, block_size=5
    )
    s_w = fp8_weight_scale(W, fmt, per_channel=per_channel, pow2=pow2)
    assert torch.equal(res.fp8_scale, s_w)
    codes, scales, Hd = _reference_dpq(W, H, perm, 8, fmt, s_w)
    assert torch.equal(res.codes, codes.to(torch.int32))
    assert torch.equal(res.scales, scales)
    assert torch.allclose(res.damped_hessian(H), Hd)
    # GPTQ's summed step errors are the damped-Hessian error of the two-level weight (Eq. 12 exact)
    assert torch.allclose(
        res.step_errors, hessian_error(W, res.dequantize(torch.float64), res.damped_hessian(H))
    )


def test_naive_is_int4_gptq_then_fp8(layer64):
    W, _, H = layer64
    perm = make_order(H, "gar", 16)
    res = dpq_quantize(W, H, group_size=16, perm=perm, naive=True)
    int4 = gptq_quantize(W, H, INT4, 16, perm=perm, scale_method="mse")
    assert torch.equal(res.codes, int4.codes) and torch.equal(res.zeros, int4.zeros)
    assert torch.equal(res.fp8_scale, fp8_weight_scale(int4.dequantize(torch.float64)))
    s8 = (int4.scales / res.fp8_scale.double()).half().double()  # scales re-expressed in FP8 units
    assert torch.equal(res.scales, s8)
    assert torch.allclose(
        res.step_errors, hessian_error(W, res.dequantize(torch.float64), res.damped_hessian(H))
    )
    # the FP8 grid costs accuracy on top of INT4 GPTQ (what DPQ compensates)
    assert _err(W, res, H) > _err(W, int4, H)


# --- §3.2: GAR keeps groups contiguous, act-order does not -----------------------------------------


def test_gar_keeps_groups_contiguous_act_does_not(layer64):
    W, _, H = layer64
    gar = dpq_quantize(W, H, group_size=16, perm=make_order(H, "gar", 16))
    assert torch.equal(gar.perm.sort().values, torch.arange(64))
    assert groups_contiguous(gar.perm, 16) and is_trivial_g_idx(gar.g_idx, 16)
    assert not torch.equal(gar.perm, torch.arange(64))
    act = dpq_quantize(W, H, group_size=16, perm=make_order(H, "act", 16))
    assert not is_trivial_g_idx(act.g_idx, 16)
    assert torch.equal(act.g_idx.bincount(), torch.full((4,), 16))


# --- DPQ vs the paper's naive W4A8 GPTQ baseline (Table 2) ------------------------------------------


@pytest.mark.parametrize("fmt, order", [("e4m3", "gar"), ("e4m3-240", "gar"), ("e4m3", "natural")])
def test_dpq_beats_naive(fmt, order):
    """Compensating both levels (Eq. 12) beats compensating INT4 only, on every seed.

    This needs correlated inputs: Eq. 7 rounds each weight to FP8 *before* the INT4 decision
    (Eq. 9), which adds a second FP8 error to every step, while compensation only lowers an
    error's cost from ``H_ii`` to its Schur pivot ``D_i``.  DPQ wins when ``D_i / H_ii`` is
    small (strongly correlated inputs, as in LLMs); on nearly independent inputs
    (``D/H ~ 0.85``, e.g. ``correlated_inputs``) it does not.  The layer must also not be tiny:
    the outlier channels carry most of the error, so one unlucky rounding there can decide it.
    """
    for seed in range(4):
        W, H = _llm_like_layer(seed)
        perm = make_order(H, order, 32)
        dpq = dpq_quantize(W, H, fmt=fmt, group_size=32, perm=perm)
        naive = dpq_quantize(W, H, fmt=fmt, group_size=32, perm=perm, naive=True)
        assert _err(W, dpq, H) <= _err(W, naive, H), seed


# --- saturation and headroom (``margin``) --------------------------------------------------------


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_margin_leaves_headroom(fmt):
    zmax = 448.0 if fmt == "e4m3" else 57344.0
    saturated = 0
    for seed in (4, 5):
        W, H = _llm_like_layer(seed, out=16, n=64, tokens=256)
        plain = dpq_quantize(W, H, fmt=fmt, group_size=16)
        saturated += plain.info["fp8_saturated"]
        for margin in (2.0, 1e3):
            res = dpq_quantize(W, H, fmt=fmt, group_size=16, margin=margin)
            assert res.info["fp8_saturated"] == 0
            assert res.fp8_weight().abs().max() < zmax
            assert res.info["fp8_scale_max"] == pytest.approx(margin * plain.info["fp8_scale_max"], rel=1e-6)
    # with margin 1, weights grown by error compensation do hit +-Z_max (in E5M2 as well: the
    # relative headroom is the same); the counter makes that visible
    assert saturated > 0


# --- the refactored GPTQ loop -------------------------------------------------------------------


def test_gptq_default_quantizer_is_bit_identical(layer64):
    W, _, H = layer64
    configs = [
        ("natural", False, True, "minmax"),
        ("act", False, False, "mse"),
        ("gar", False, True, "mse"),
        ("act", True, True, "minmax"),
        ("min-pivot", True, False, "mse"),
    ]
    for order, static, clip, method in configs:
        grid = IntGrid(3)
        kw = dict(perm=make_order(H, order, 16), static_groups=static, clip=clip, scale_method=method)
        a = gptq_quantize(W, H, grid, 16, block_size=7, **kw)
        b = gptq_quantize(
            W, H, grid, 16, block_size=7, quantizer=IntColumnQuantizer(grid, method, clip), **kw
        )
        for x, y in zip(
            (a.codes, a.scales, a.zeros, a.g_idx, a.step_errors),
            (b.codes, b.scales, b.zeros, b.g_idx, b.step_errors),
            strict=True,
        ):
            assert torch.equal(x, y), (order, static, clip, method)


def test_static_groups_are_fitted_by_the_quantizer(layer64):
    W, _, H = layer64

    class Recording(IntColumnQuantizer):
        def fit(self, cols):
            calls.append(cols.clone())
            return super().fit(cols)

    calls: list[torch.Tensor] = []
    res = gptq_quantize(
        W,
        H,
        IntGrid(4),
        16,
        perm=make_order(H, "act", 16),
        static_groups=True,
        quantizer=Recording(IntGrid(4)),
    )
    assert len(calls) == 4  # once per contiguous group, from the original weights
    assert all(torch.equal(c, W[:, 16 * k : 16 * (k + 1)]) for k, c in enumerate(calls))
    assert is_trivial_g_idx(res.g_idx, 16)


def _fp8_layer(tokens: int, n_in: int, n_out: int):
    """``(X, DPQ W4A8-FP8 layer with a static per-tensor E4M3 input quantizer, s_x)``, seed 7."""
    from bitmosaic.formats.act import ActQuantSpec
    from bitmosaic.modules.actquant import attach_input_quant
    from bitmosaic.modules.qmodules import FP8ComputeQuantLinear

    g = torch.Generator().manual_seed(7)
    X = torch.randn(tokens, n_in, generator=g)
    W = torch.randn(n_out, n_in, generator=g) * 0.05
    res = dpq_quantize(W, 2 * X.T @ X / tokens, group_size=32, perm=make_order(X.T @ X, "gar", 32))
    m = FP8ComputeQuantLinear.from_result(res, bits=4, group_size=32, symmetric=False)
    s_x = X.abs().amax().reshape(1) / 448
    attach_input_quant(m, ActQuantSpec("e4m3", 8, granularity="tensor", static=True), n_in, s_x)
    return X, m, s_x


def test_dpq_module_forward_equals_an_fp8_gemm():
    """The simulated W4A8-FP8 forward = FP8 x FP8 GEMM with float32 accumulation, then both scales."""
    from bitmosaic.kernels.fp8 import fp8_gemm_reference

    X, m, s_x = _fp8_layer(256, 64, 32)
    y = m(X)
    ref = fp8_gemm_reference(fp_round(X / s_x, "e4m3"), m.fp8_weight(), s_x, m.fp8_scale)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    # and the FP8 products really are exact in float32
    w8 = m.fp8_weight()
    assert torch.equal(w8.double(), fp_round(w8.double(), "e4m3"))


@pytest.mark.skipif(
    not __import__("bitmosaic.kernels.fp8", fromlist=["x"]).scaled_mm_available(),
    reason="needs a CUDA GPU with FP8 tensor cores (capability >= 8.9)",
)
def test_dpq_weights_through_the_fp8_tensor_core_gemm_equal_the_simulated_forward():
    """On an FP8 GPU, the DPQ layer's stored FP8 weights and its quantized activations through
    ``torch._scaled_mm`` (cuBLASLt, float32 accumulation, bf16 out) give the simulated forward up to
    bf16 output rounding: the simulation is the kernel's arithmetic, not an approximation of it."""
    from bitmosaic.kernels.fp8 import fp8_gemm_scaled_mm

    X, m, s_x = _fp8_layer(64, 256, 128)
    y_sim = m(X)
    dev = torch.device("cuda")
    x8 = fp_round(X / s_x, "e4m3").to(dev, torch.float8_e4m3fn)
    w8 = m.fp8_weight().to(dev, torch.float8_e4m3fn)
    # scaled_mm takes per-tensor scales: a per-channel s_w is applied to the output columns
    y = fp8_gemm_scaled_mm(x8, w8, s_x.to(dev), torch.ones((), device=dev)).float().cpu()
    y = y * m.fp8_scale.float().reshape(1, -1)
    torch.testing.assert_close(y, y_sim, rtol=2**-7, atol=1e-3 * float(y_sim.abs().max()))


# --- the vectorised per-group step -----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fmt", ["e4m3", "e4m3-240", "e5m2"])
@pytest.mark.parametrize("clip", [True, False])
def test_column_step_tables_equal_quantize(dtype, fmt, clip):
    """Eqs. 7-11 by per-group tables give exactly ``quantize``'s codes and weights, saturation and
    signed zeros included."""
    g = torch.Generator().manual_seed(5)
    out = 64
    W = (torch.randn(out, 40, generator=g, dtype=torch.float64) * 0.05).to(dtype)
    W[:3, :4] *= 400.0  # saturates Eq. 7
    W[3, :] = -1e-30  # rounds to -0 in FP8
    s_w = fp8_weight_scale(W[:, 4:], fmt, per_channel=True)
    a = DualPrecisionQuantizer(s_w, fmt, clip=clip)
    b = DualPrecisionQuantizer(s_w, fmt, clip=clip)
    scale, zero = a.fit(W[:, :16])
    scale = scale * 0.7  # a shrunken scale: clipping matters
    step = a.column_step(scale, zero)
    for j in range(W.shape[1]):
        qa, wa = step(W[:, j])
        qb, wb = b.quantize(W[:, j], scale, zero)
        assert torch.equal(qa, qb) and torch.equal(wa, wb), j
        assert qa.dtype == qb.dtype == dtype
    assert int(a.saturated) == int(b.saturated) > 0


def test_dpq_float32_run_equals_the_plain_quantize_path(layer64):
    """The whole float32 GPTQ run with the table step equals the run with ``quantize`` per column."""
    W, _, H = layer64
    W, H = W.float(), H.float()

    class Plain(DualPrecisionQuantizer):
        column_step = None  # GPTQ falls back to quantize(w, s, z)

    s_w = fp8_weight_scale(W)
    for order in ("gar", "act"):
        perm = make_order(H, order, 16)
        runs = [
            gptq_quantize(W, H, INT4, 16, perm=perm, quantizer=cls(s_w), block_size=24)
            for cls in (DualPrecisionQuantizer, Plain)
        ]
        for x, y in zip(
            (runs[0].codes, runs[0].scales, runs[0].zeros, runs[0].step_errors),
            (runs[1].codes, runs[1].scales, runs[1].zeros, runs[1].step_errors),
            strict=True,
        ):
            assert torch.equal(x, y), order


# --- the nearest-code ablation (not the paper) ----------------------------------------------------


@pytest.mark.parametrize("fmt", ["e4m3", "e4m3-240"])
def test_nearest_code_is_never_farther_than_the_paper_rounding(fmt):
    """Per weight, the ablation's code lands on the representable value ``nearest_Z((q - z) s) s_w``
    nearest to it (checked against every code), never farther than Eqs. 7-9's two roundings, and
    strictly nearer on some weights; ``quantize`` and the table step agree."""
    g = torch.Generator().manual_seed(7)
    W = torch.randn(48, 32, generator=g, dtype=torch.float64) * 0.05
    s_w = fp8_weight_scale(W, fmt, per_channel=True)
    paper, near = DualPrecisionQuantizer(s_w, fmt), DualPrecisionQuantizer(s_w, fmt, nearest=True)
    scale, zero = paper.fit(W[:, :16])
    codes = torch.arange(16, dtype=W.dtype)
    table = fp_round((codes[None, :] - zero[:, None]) * scale[:, None], fmt) * s_w.reshape(-1, 1)
    strictly = 0
    for j in range(16):
        w = W[:, j]
        qp, wp = paper.quantize(w, scale, zero)
        qn, wn = near.quantize(w, scale, zero)
        assert torch.equal(qn, near.column_step(scale, zero)(w)[0])
        best = (w[:, None] - table).abs().amin(dim=1)
        assert torch.allclose((w - wn).abs(), best, rtol=0, atol=1e-15)
        assert ((w - wn).abs() <= (w - wp).abs() + 1e-15).all()
        strictly += int(((w - wn).abs() < (w - wp).abs() - 1e-15).sum())
    assert strictly > 0


def test_nearest_code_refusals():
    W, H = _llm_like_layer(0)
    with pytest.raises(ValueError, match="naive GPTQ has one rounding"):
        dpq_quantize(W, H, group_size=32, naive=True, nearest=True)
    with pytest.raises(ValueError, match="needs clip=True"):
        DualPrecisionQuantizer(torch.ones(4), nearest=True, clip=False)
    res = dpq_quantize(W, H, group_size=32, nearest=True)
    assert res.info["nearest_code"] is True and torch.isfinite(res.dequantize()).all()
