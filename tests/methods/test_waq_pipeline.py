"""Weight-activation quantization through the pipeline on tiny random Llamas: smoothing folds are
exact in float, every method x scheme runs, saves and reloads to identical logits, CLI flags."""

import copy

import pytest
import torch

from bitmosaic import quantize_
from bitmosaic.cli import build_parser
from bitmosaic.io import load_quantized, save_quantized
from bitmosaic.methods import get_method
from tests.helpers import assert_reload_same_logits, transform_every_layer
from tests.pipeline.test_pipeline import tiny_llama


def tiny(kv_heads=4, seed=0):
    m = tiny_llama(seed, kv_heads=kv_heads)
    with torch.no_grad():  # non-trivial norms and a few outlier channels, as in real models
        g = torch.Generator().manual_seed(seed)
        for layer in m.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
                norm.weight[:2] *= 20
    return m


@pytest.fixture
def calib():
    return torch.randint(0, 128, (6, 32), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def ids():
    return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("method,opts", [("smoothquant", {"alpha": None}), ("smoothquant", {}), ("awq", {})])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_folded_factors_leave_the_float_model_unchanged(calib, ids, method, opts, kv_heads):
    m = tiny(kv_heads)
    with torch.inference_mode():
        ref = m(ids).logits
    spec = get_method(method)
    cfg = spec.make_config(
        bits=4, group_size=32, act=None if method == "awq" else {"fmt": "int", "bits": 8}, **opts
    )
    before = copy.deepcopy(m.state_dict())
    infos = transform_every_layer(m, spec, cfg, calib)
    with torch.inference_mode():
        out = m(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    changed = [k for k, v in m.state_dict().items() if not torch.equal(v, before[k])]
    assert any("input_layernorm" in k for k in changed)  # something was really folded
    o_info = infos[0][1]
    assert o_info["folded"] is (
        kv_heads == 4 and "reason" not in o_info and o_info.get("ratio", 0) is not None
    )
    if kv_heads == 2:
        assert o_info["reason"] == "no foldable preceding op"  # GQA: v_proj cannot absorb o_proj's factors


CASES = [
    ("rtn", "W4A8", {"group_size": 32}),
    ("rtn", "W4A4", {"group_size": 32}),
    ("gptq", "W4A8-FP8", {"group_size": 32, "order": "act"}),
    ("gptq", "W8A8", {"group_size": None}),
    ("smoothquant", "W8A8", {"group_size": None, "alpha": None}),
    ("smoothquant", "W4A4", {"group_size": 32, "weights": "gptq"}),
    ("awq", "W4A16", {"group_size": 32}),
    ("awq", "W4A8", {"group_size": 32}),
    ("fp8", "W8A8-FP8", {}),
    ("fp8", "W8A8-FP8", {"fmt": "e4m3-240", "per_channel": False, "pow2": True}),
]


@pytest.mark.parametrize("method,scheme,opts", CASES)
def test_methods_with_activation_quant_save_and_reload(tmp_path, calib, ids, method, scheme, opts):
    m = tiny(2)
    with torch.inference_mode():
        ref = m(ids).logits
    rep = quantize_(m, method, calib, scheme=scheme, progress=False, **opts)
    with torch.inference_mode():
        out = m(ids).logits
    rel = float((out - ref).norm() / ref.norm())
    assert 0 < rel < 1.0  # plain W4A4 degrades badly on outlier channels (that is the point)
    assert rep.config["act"] == (None if scheme == "W4A16" else rep.config["act"])
    assert all(r.get("act") for r in rep.layers) == (scheme != "W4A16")
    path = save_quantized(m, tmp_path / "q", {"method": method, "scheme": scheme})
    m2, _ = load_quantized(path, load_tokenizer=False)
    with torch.inference_mode():
        assert torch.equal(m2(ids).logits, out)
    if scheme == "W4A8-FP8":
        scales = [b for k, b in m2.state_dict().items() if k.endswith("input_quant.scale")]
        assert len(scales) == 14 and all(s.numel() == 1 and s.item() > 0 for s in scales)


def test_activation_quant_costs_accuracy_in_order(calib, ids):
    """Same weights (RTN w8 per-channel): A16 < A8 < A4 in output error, FP8 close to INT8."""
    errs = {}
    for scheme in ("W8A16", "W8A8", "W8A8-FP8", "W8A4"):
        m = tiny(4)
        with torch.inference_mode():
            ref = m(ids).logits
        quantize_(m, "rtn", calib, scheme=scheme, group_size=None, progress=False)
        with torch.inference_mode():
            errs[scheme] = float((m(ids).logits - ref).norm() / ref.norm())
    assert errs["W8A16"] < errs["W8A8"] < errs["W8A4"], errs
    assert errs["W8A8-FP8"] < errs["W8A4"], errs


def test_smoothquant_beats_rtn_at_w8a8_with_outlier_channels(calib, ids):
    errs = {}
    for method, opts in (("rtn", {}), ("smoothquant", {"alpha": None})):
        m = tiny(4)
        with torch.inference_mode():
            ref = m(ids).logits
        quantize_(m, method, calib, scheme="W8A4", group_size=None, progress=False, **opts)
        with torch.inference_mode():
            errs[method] = float((m(ids).logits - ref).norm() / ref.norm())
    assert errs["smoothquant"] < errs["rtn"], errs


def _opts(argv):
    from bitmosaic.cli import method_options

    args = build_parser().parse_args(["quantize", *argv])
    return method_options(args, get_method(args.method))


def test_cli_activation_flags():
    o = _opts(["--method", "gptq", "--wbits", "4", "--abits", "8", "--afmt", "fp8"])
    assert o["bits"] == 4 and (o["act"].fmt, o["act"].granularity, o["act"].static) == (
        "e4m3",
        "tensor",
        True,
    )
    o = _opts(["--method", "smoothquant", "--wbits", "8", "--abits", "8", "--alpha", "search"])
    assert o["alpha"] is None and (o["act"].fmt, o["act"].granularity) == ("int", "token")
    o = _opts(["--scheme", "W4A4", "--a-granularity", "group", "--a-group-size", "64"])
    assert o["bits"] == 4 and (o["act"].bits, o["act"].granularity, o["act"].group_size) == (4, "group", 64)
    o = _opts(["--scheme", "W4A8-FP8", "--afmt", "fp8-e4m3-240", "--a-pow2"])
    assert (o["act"].fmt, o["act"].pow2) == ("e4m3-240", True)
    assert "act" not in _opts(["--method", "rtn"])  # the method default (16-bit activations)
    o = _opts(["--abits", "8", "--a-calib", "percentile", "--a-granularity", "tensor", "--a-static"])
    assert (o["act"].calib, o["act"].static) == ("percentile", True)
    assert _opts(["--scheme", "W4A4", "--a-clip", "0.9"])["act"].clip_ratio == 0.9
    with pytest.raises(ValueError, match=r"clip ratio must be in \(0, 1\], got 1.5"):
        _opts(["--scheme", "W4A4", "--a-clip", "1.5"])
    with pytest.raises(ValueError, match="--alpha does not apply"):
        _opts(["--method", "gptq", "--alpha", "0.5"])
    with pytest.raises(ValueError, match="8-bit format"):
        _opts(["--abits", "4", "--afmt", "fp8"])
    with pytest.raises(ValueError, match="need --abits"):
        _opts(["--a-pow2"])
    with pytest.raises(ValueError, match="says 4-bit weights"):
        _opts(["--scheme", "W4A8", "--wbits", "8"])


@pytest.mark.parametrize(
    "opts",
    [{}, {"order": "act"}, {"naive": True}, {"solver": "rtn"}, {"fp8_range": 240, "pow2": True},
     {"nearest_code": True}],
)  # fmt: skip
def test_dpq_end_to_end_fp8_operands_and_reload(tmp_path, calib, ids, opts):
    from bitmosaic.formats.fp import fp_round
    from bitmosaic.modules.qmodules import FP8ComputeQuantLinear

    m = tiny(2)
    rep = quantize_(m, "dpq", calib, group_size=32, progress=False, **opts)
    fmt = "e4m3-240" if opts.get("fp8_range") == 240 else "e4m3"
    assert rep.config["act"]["fmt"] == fmt and rep.config["act"]["static"]
    assert all(r["babai_bound"] is None and r["hessian_error"] > 0 for r in rep.layers)
    mods = [x for x in m.modules() if isinstance(x, FP8ComputeQuantLinear)]
    assert len(mods) == 14
    for q in mods:
        w8 = q.fp8_weight()
        assert torch.equal(fp_round(w8, fmt), w8)
        assert (q.g_idx is not None) == (opts.get("order") == "act")  # GAR needs no gather
        assert q.input_quant.scale.numel() == 1
        if opts.get("pow2"):
            s = q.input_quant.scale
            assert torch.equal(s, torch.exp2(torch.round(torch.log2(s))))
    assert_reload_same_logits(m, ids, tmp_path / "dpq", {"method": "dpq"})


def test_dpq_beats_naive_and_rtn_on_tiny_model(calib):
    errs = {}
    for name, opts in (("dpq", {}), ("naive", {"naive": True}), ("rtn", {"solver": "rtn"})):
        rep = quantize_(tiny(4), "dpq", calib, group_size=32, progress=False, **opts)
        errs[name] = sum(r["hessian_error"] for r in rep.layers)
    assert errs["dpq"] < errs["rtn"] and errs["naive"] < errs["rtn"], errs


def test_cli_dpq_flags():
    o = _opts(["--method", "dpq", "--fp8-range", "240", "--pow2-scales", "--order", "act", "--naive"])
    cfg = get_method("dpq").make_config(**o)
    assert (cfg.fmt, cfg.pow2, cfg.order, cfg.naive, cfg.scheme) == (
        "e4m3-240",
        True,
        "act",
        True,
        "W4A8-FP8-240",
    )
    assert get_method("dpq").make_config(**_opts(["--method", "dpq", "--scheme", "W4A16"])).act is None
    with pytest.raises(ValueError, match="does not apply"):
        _opts(["--method", "gptq", "--fp8-range", "240"])
    with pytest.raises(ValueError, match="asymmetric"):
        get_method("dpq").make_config(**_opts(["--method", "dpq", "--sym"]))
