"""SQ-format algorithms and methods: Algorithm 1 (GPTQ through the mixed grid, importance forms,
mask timings), Algorithm 2 (dynamic split as a real dense + sparse matmul, static masks and the
folded column permutation), module kinds saved/reloaded, CLI flags."""

import pytest
import torch

from bitmosaic import quantize_
from bitmosaic.algorithms.sq import (
    dynamic_split,
    high_first_permutation,
    sq_gptq,
    static_channel_mask,
    static_importance,
)
from bitmosaic.cli import build_parser
from bitmosaic.formats.act import ActQuantSpec
from bitmosaic.formats.sq import check_mask, pack_sq, parse_sq, unpack_sq
from bitmosaic.io import load_quantized, save_quantized
from bitmosaic.methods import get_method
from bitmosaic.modules.intact import ACT_COMPUTE_ENV
from bitmosaic.modules.qlinear import QuantLinear
from bitmosaic.modules.sq import SQActLinear, SQWeightLinear
from tests.helpers import env_var
from tests.methods.test_waq_pipeline import tiny


def _err(W, Wq, H):
    E = (W - Wq).double()
    return float(torch.einsum("ij,jk,ik->", E, H.double(), E))


@pytest.mark.parametrize("sq", ["16-(8/4)-0.75", "32-(fp8/fp4)-0.875", "4-(8/0)-0.5"])
@pytest.mark.parametrize("importance", ["obs", "paper"])
@pytest.mark.parametrize("timing", ["lazy", "upfront"])
def test_sq_gptq_masks_and_compensation(layer64, sq, importance, timing):
    W, _, H = layer64
    W, H = W.float(), H.float()
    fmt = parse_sq(sq)
    res = sq_gptq(W, H, fmt, importance=importance, mask_timing=timing)
    check_mask(res.sq.mask, fmt)  # every bank of every output channel: exactly (1-s) b high
    Wq = res.dequantize()
    # the stored format reproduces exactly the weight GPTQ compensated against
    buf = pack_sq(res.sq)
    assert torch.equal(unpack_sq(buf, fmt, *W.shape).dequantize(), Wq)
    # GPTQ's own loss accounting (its step errors) is the mixed-grid weight's: the errors it
    # compensated were those of the SQ grid, and compensation beats plain rounding
    assert float(res.step_errors.sum()) == pytest.approx(_err(W, Wq, res.damped_hessian(H)), rel=1e-3)
    plain = sq_gptq(W, H, fmt, importance=importance, compensate=False)
    assert _err(W, Wq, H) < _err(W, plain.dequantize(), H)
    if timing == "upfront":
        from bitmosaic.algorithms.hessian import gptq_factor
        from bitmosaic.algorithms.sq import weight_importance_denominator
        from bitmosaic.formats.sq import bank_topk_mask

        diag, U, _, _ = gptq_factor(H, 0.01, torch.arange(64))
        Hd = H.clone()
        torch.diagonal(Hd).copy_(diag)
        d = weight_importance_denominator(Hd, U, importance)
        assert torch.equal(res.sq.mask, bank_topk_mask(W.square() / d.square()[None, :], fmt))


def test_importance_forms_differ_as_documented(layer64):
    from bitmosaic.algorithms.hessian import gptq_factor
    from bitmosaic.algorithms.sq import weight_importance_denominator

    _, _, H = layer64
    diag, U, _, _ = gptq_factor(H, 0.01, torch.arange(64))
    Hd = H.clone()
    torch.diagonal(Hd).copy_(diag)
    paper = weight_importance_denominator(Hd, U, "paper")
    obs = weight_importance_denominator(Hd, U, "obs")
    assert torch.allclose(paper, torch.diagonal(torch.linalg.inv(Hd)), rtol=1e-6)
    # U_jj^2 = [(H_{j:,j:})^-1]_jj: the full inverse's at the first column, 1 / H_nn at the last
    assert torch.allclose(obs[0] ** 2, paper[0], rtol=1e-6)
    assert torch.allclose(obs[-1] ** 2, 1 / Hd[-1, -1], rtol=1e-6)
    assert not torch.allclose(obs**2, paper, rtol=1e-2)


def _packed_w4(seed=0, out=24, n=64):
    from bitmosaic.algorithms.rtn import rtn_quantize
    from bitmosaic.formats.grid import IntGrid

    W = torch.randn(out, n, generator=torch.Generator().manual_seed(seed))
    res = rtn_quantize(W, IntGrid(4, False), 32, "minmax")
    return QuantLinear.from_result(res, bits=4, group_size=32, symmetric=False)


def test_static_reordering_leaves_the_float_output_unchanged():
    dense = _packed_w4()
    x = torch.randn(5, 64)
    W = dense.dequantize_weight()
    fmt = parse_sq("16-(8/4)-0.75")
    mask = static_channel_mask(static_importance(W, x.mean(0), x.abs().mean(0)), fmt)
    m = SQActLinear.from_packed(dense, fmt.notation, "static", channel_mask=mask)
    perm = m.sq_perm.long()
    assert torch.equal(perm, high_first_permutation(mask))
    assert bool(mask[perm[: fmt.high_count(64)]].all()) and not bool(mask[perm[fmt.high_count(64) :]].any())
    # stored columns are the permuted weight; the served weight is the original one, exactly
    assert torch.equal(m.stored_weight(), W[:, perm])
    assert torch.equal(m.dequantize_weight(), W)
    assert torch.allclose(x[:, perm] @ m.stored_weight().T, x @ W.T, atol=1e-5)


def test_static_split_is_two_dense_matmuls_on_the_reordered_slices():
    from bitmosaic.formats.sq import quantize_part

    dense = _packed_w4(1)
    x = torch.randn(7, 64) * torch.linspace(0.1, 3, 64)
    fmt = parse_sq("16-(8/4)-0.5")
    W = dense.dequantize_weight()
    mask = static_channel_mask(static_importance(W, x.mean(0)), fmt)
    m = SQActLinear.from_packed(dense, fmt.notation, "static", channel_mask=mask)
    kh = fmt.high_count(64)
    xp = x[:, high_first_permutation(mask)]
    want = quantize_part(xp[:, kh:], fmt, False) @ m.stored_weight()[:, kh:].T
    want = want + quantize_part(xp[:, :kh], fmt, True) @ m.stored_weight()[:, :kh].T
    with env_var(ACT_COMPUTE_ENV, "sim"):  # the float32 split (the integer one: tests/kernels/test_sq_int.py)
        assert torch.equal(m(x), want)


@pytest.mark.parametrize("scale", ["token", "bank"])
def test_dynamic_split_equals_the_dense_fake_quant_product(scale):
    dense = _packed_w4(2)
    x = torch.randn(9, 64) * torch.linspace(0.1, 3, 64)
    fmt = parse_sq("16-(8/4)-0.75")
    m = SQActLinear.from_packed(dense, fmt.notation, "dynamic", scale)
    t = dynamic_split(x, fmt, scale)
    check_mask(t.mask, fmt)
    assert torch.equal(t.mask, t.mask & (x.abs() >= 0))
    # per token and bank the high ones are the largest |x|
    a = x.abs().reshape(9, 4, 16)
    mm = t.mask.reshape(9, 4, 16)
    assert bool((a.masked_fill(~mm, float("inf")).amin(-1) >= a.masked_fill(mm, -1).amax(-1)).all())
    ref = t.dequantize() @ m.dequantize_weight().T
    assert torch.allclose(m(x), ref, atol=1e-5)  # dense low + CSR high == the one dense product
    if scale == "token":
        lo, _ = t.parts()
        assert t.low_scale.shape == (9, 1)
        assert float((lo.abs().amax(1) / t.low_scale[:, 0]).max()) <= 7.0


@pytest.fixture
def calib():
    return torch.randint(0, 128, (6, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "method,opts,kind",
    [
        ("sq-weights", {"sq": "16-(8/4)-0.75"}, SQWeightLinear),
        ("sq-weights", {"sq": "32-(fp8/fp4)-0.875", "act": ActQuantSpec("int", 8)}, SQWeightLinear),
        ("sq-acts", {"sq": "16-(8/4)-0.5", "strategy": "dynamic", "group_size": 32}, SQActLinear),
        ("sq-acts", {"sq": "16-(8/4)-0.75", "strategy": "static", "group_size": 32}, SQActLinear),
    ],
)
def test_methods_save_and_reload_reproduce_logits_exactly(tmp_path, calib, method, opts, kind):
    m = tiny()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = m(ids).logits
    rep = quantize_(m, method, calib, progress=False, **opts)
    mods = [x for x in m.modules() if isinstance(x, kind)]
    assert len(mods) == 14
    with torch.inference_mode():
        out = m(ids).logits
    assert (out - ref).abs().mean() < 0.2 * ref.abs().mean()
    path = save_quantized(m, tmp_path / "q", {"method": method})
    m2, _ = load_quantized(path, load_tokenizer=False)
    with torch.inference_mode():
        assert torch.equal(m2(ids).logits, out)
    assert rep.bits_per_weight > 0
    if opts.get("strategy") == "static":
        assert all(x.sq_perm is not None for x in m2.modules() if isinstance(x, SQActLinear))


def test_sq_acts_weights_are_the_w4_baseline(calib):
    """W4A(SQ) uses exactly the weights of the smoothquant + GPTQ W4 baseline (A16 calibration)."""
    a, b = tiny(), tiny()
    quantize_(a, "smoothquant", calib, progress=False, weights="gptq", group_size=32)
    quantize_(b, "sq-acts", calib, progress=False, sq="16-(8/4)-0.5", strategy="static", group_size=32)
    for (na, ma), (nb, mb) in zip(
        [(n, x) for n, x in a.named_modules() if isinstance(x, QuantLinear)],
        [(n, x) for n, x in b.named_modules() if isinstance(x, QuantLinear)],
        strict=True,
    ):
        assert na == nb and isinstance(mb, SQActLinear)
        assert torch.equal(ma.dequantize_weight(), mb.dequantize_weight())


def test_cli_flags_build_the_configs():
    from bitmosaic.cli import method_options

    p = build_parser()
    args = p.parse_args(
        ["quantize", "--method", "sq-acts", "--strategy", "static", "--sq", "16-(8/4)-0.5", "--wbits", "4"]
    )
    cfg = get_method("sq-acts").make_config(**method_options(args, get_method("sq-acts")))
    assert (cfg.strategy, cfg.sq, cfg.bits, cfg.scheme) == ("static", "16-(8/4)-0.5", 4, "W4A(SQ6)")
    args = p.parse_args(
        [
            "quantize",
            "--method",
            "sq-weights",
            "--sq",
            "64-(8/4)-0.875",
            "--abits",
            "8",
            "--sq-importance",
            "paper",
            "--mask-timing",
            "upfront",
        ]
    )
    cfg = get_method("sq-weights").make_config(**method_options(args, get_method("sq-weights")))
    assert (cfg.importance, cfg.mask_timing, cfg.act.bits, cfg.scheme) == ("paper", "upfront", 8, "W(SQ5)A8")


@pytest.mark.parametrize(
    "method,opts,msg",
    [
        ("sq-acts", {"act": ActQuantSpec("int", 8)}, "quantizes the activations itself"),
        ("sq-acts", {"act_scale": "group"}, "needs a width"),
        ("sq-weights", {"sq": "16-(8/4)-0.6"}, "sparsity"),
        ("sq-weights", {"order": "act"}, "natural order"),
    ],
)
def test_bad_options_are_refused(method, opts, msg):
    with pytest.raises(ValueError, match=msg):
        get_method(method).make_config(**opts)
