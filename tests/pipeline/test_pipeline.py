"""End-to-end on a tiny random Llama: calibration pipeline, QuantLinear, save/load, CLI inspect."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bitmosaic import quantize_
from bitmosaic.io import load_quantized, quantized_modules, save_quantized
from bitmosaic.models import UnknownArchitectureError, get_arch
from bitmosaic.modules import QuantLinear
from bitmosaic.pipeline.pipeline import StopForward, capture_layer_inputs


def tiny_llama(seed=0, layers=2, kv_heads=2):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    m = LlamaForCausalLM(cfg).eval()
    return m


@pytest.fixture
def calib():
    return torch.randint(0, 128, (6, 32), generator=torch.Generator().manual_seed(0))


def test_capture_inputs_stops_at_first_layer(calib):
    m = tiny_llama()
    calls = []
    m.model.layers[1].register_forward_pre_hook(lambda *a: calls.append(1))
    inputs, kw = capture_layer_inputs(m, m.model.layers, calib, batch_size=4)
    assert [t.shape for t in inputs] == [(4, 32, 64), (2, 32, 64)]
    assert len(kw["default"] if "default" in kw else next(iter(kw.values()))) == 2
    assert calls == []  # never ran past layer 0


def test_stop_forward_does_not_swallow_real_errors(calib):
    m = tiny_llama()

    def boom(*a, **k):
        raise RuntimeError("embedding failed")

    m.model.embed_tokens.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="embedding failed"):
        capture_layer_inputs(m, m.model.layers, calib, batch_size=4)
    assert issubclass(StopForward, Exception) and not issubclass(StopForward, ValueError)


@pytest.mark.parametrize(
    "method,opts",
    [
        ("rtn", {}),
        ("gptq", {"order": "act", "static_groups": False}),  # act-order groups: a g_idx
        ("gptq", {"order": "act", "static_groups": True}),  # static groups: no g_idx
        ("gptq", {"order": "gar", "scale_method": "mse"}),
        ("babai", {"order": "min-pivot"}),
    ],
)
def test_pipeline_quantizes_every_linear_and_reports(calib, method, opts):
    m = tiny_llama()
    rep = quantize_(m, method, calib, bits=4, group_size=32, progress=False, measure_errors=True, **opts)
    q = quantized_modules(m)
    assert len(q) == 2 * 7 and len(rep.layers) == 14
    for row in rep.layers:
        assert set(row) >= {
            "name",
            "rel_out_error",
            "hessian_error",
            "babai_bound",
            "bits_per_weight",
            "seconds",
        }
        assert 0 <= row["rel_out_error"] < 0.2
        assert row["bits_per_weight"] > 4
    if method != "rtn":
        assert all(r["babai_bound"] > 0 for r in rep.layers)
    d = rep.to_dict()
    assert d["peak_rss_mb"] > 0 and d["seconds"] > 0
    # 4 + (16+16)/32 for codes + fp16 scale/zero; act-order GPTQ also stores an int32 g_idx
    if method == "gptq" and opts.get("static_groups") is False:
        assert d["bits_per_weight"] > 5.0
    else:
        assert d["bits_per_weight"] == 5.0
    json.dumps(d)  # serialisable


def test_hessian_free_methods_skip_calibration(calib):
    """RTN needs no Hessian: without static activation scales it runs no calibration forward, and
    its codes are the same as with calibration (which then only feeds the error report)."""
    m1, m2 = tiny_llama(), tiny_llama()
    calls = []
    h = m1.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    rep1 = quantize_(m1, "rtn", calib, bits=4, group_size=32, progress=False)
    h.remove()
    rep2 = quantize_(m2, "rtn", calib, bits=4, group_size=32, progress=False, measure_errors=True)
    assert calls == [] and rep1.calibration["calibrated"] is False
    assert rep2.calibration["calibrated"] is True
    assert all(r["rel_out_error"] is None for r in rep1.layers)
    assert all(r["rel_out_error"] > 0 for r in rep2.layers)
    for (n, a), b in zip(quantized_modules(m1).items(), quantized_modules(m2).values(), strict=True):
        assert torch.equal(a.qweight, b.qweight), n


def test_gptq_pipeline_beats_rtn_on_tiny_model(calib):
    errs = {}
    for method in ("rtn", "gptq"):
        m = tiny_llama()
        rep = quantize_(m, method, calib, bits=3, group_size=32, progress=False, measure_errors=True)
        errs[method] = sum(r["rel_out_error"] for r in rep.layers)
    assert errs["gptq"] < errs["rtn"]


def test_quantlinear_forward_matches_simulated_weights(calib):
    m = tiny_llama()
    ref = tiny_llama()
    quantize_(m, "gptq", calib, bits=3, group_size=32, order="act", progress=False)
    for name, q in quantized_modules(m).items():
        x = torch.randn(3, q.in_features)
        W = q.dequantize_reference()
        assert torch.equal(W, q.dequantize_weight())
        assert torch.allclose(q(x), x @ W.T, atol=1e-6)
        assert W.shape == ref.get_submodule(name).weight.shape


def test_save_load_roundtrip_and_generate(tmp_path, calib):
    m = tiny_llama()
    quantize_(m, "gptq", calib, bits=4, group_size=32, order="act", progress=False)
    x = calib[:2]
    with torch.inference_mode():
        logits = m(input_ids=x).logits
    out = save_quantized(m, tmp_path / "q", {"method": "gptq", "bits": 4, "group_size": 32})
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "bitmosaic" and cfg["format_version"] == 1
    assert len(cfg["modules"]) == 14
    m2, _ = load_quantized(out, load_tokenizer=False)
    assert isinstance(m2.model.layers[0].self_attn.q_proj, QuantLinear)
    with torch.inference_mode():
        logits2 = m2(input_ids=x).logits
    assert torch.equal(logits, logits2)
    gen = m2.generate(x[:1, :4], max_new_tokens=5, do_sample=False)
    assert gen.shape == (1, 9)


def test_no_clip_codes_are_stored_exactly(tmp_path, calib):
    m = tiny_llama()
    quantize_(m, "gptq", calib, bits=2, group_size=32, clip=False, progress=False)
    wide = [q for q in quantized_modules(m).values() if q.storage_bits > 2]
    assert wide, "2-bit no-clip GPTQ should overflow the grid somewhere"
    for q in wide:
        codes = q.codes()
        assert codes.min() < 0 or codes.max() > 3
    out = save_quantized(m, tmp_path / "nc", {"method": "gptq", "bits": 2})
    m2, _ = load_quantized(out, load_tokenizer=False)
    for name, q in quantized_modules(m).items():
        assert torch.equal(q.dequantize_weight(), m2.get_submodule(name).dequantize_weight())


def test_interrupted_save_leaves_nothing(tmp_path, calib, monkeypatch):
    m = tiny_llama()
    quantize_(m, "rtn", calib, bits=4, group_size=32, progress=False)
    import bitmosaic.io.saved.shards as shards

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(shards, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        save_quantized(m, tmp_path / "q", {"method": "rtn"})
    assert list(tmp_path.iterdir()) == []


def test_unknown_architecture_message():
    class Dummy(torch.nn.Module):
        config = type("C", (), {"model_type": "mamba"})()

    with pytest.raises(UnknownArchitectureError, match="register_arch"):
        get_arch(Dummy())


def test_save_refuses_unquantized(tmp_path):
    with pytest.raises(ValueError, match="no quantized layers"):
        save_quantized(tiny_llama(), tmp_path / "x", {})


def test_output_cache_is_exact(calib):
    """Caching quantized linears' outputs within a layer changes no code and no report number."""
    reps, models = [], []
    for cache in (False, True):
        m = tiny_llama()
        reps.append(quantize_(m, "gptq", calib, bits=3, group_size=32, progress=False, cache_outputs=cache))
        models.append(m)
    assert reps[1].calibration["output_cache"] and not reps[0].calibration["output_cache"]
    for (n, a), b in zip(
        quantized_modules(models[0]).items(), quantized_modules(models[1]).values(), strict=True
    ):
        assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales), n
    assert [r["hessian_error"] for r in reps[0].layers] == [r["hessian_error"] for r in reps[1].layers]
    assert not any("forward" in vars(mod) for mod in models[1].modules())  # patches removed


@pytest.mark.parametrize(
    "method,opts",
    [
        ("ssqr", {"bits": 3, "group_size": 32, "outlier_rate": 0.03}),
        ("hptq", {"target_bits": 3.125}),
        ("hrtn", {"target_bits": 3.125, "scale_per": "row"}),
    ],
)
def test_lattice_methods_end_to_end_with_save_load(tmp_path, calib, method, opts):
    m = tiny_llama()
    rep = quantize_(m, method, calib, progress=False, **opts)
    x = calib[:2]
    with torch.inference_mode():
        logits = m(input_ids=x).logits
    if method == "ssqr":
        assert all(0 < r["outlier_rate"] <= 0.03 for r in rep.layers)
    else:
        assert all(r["encoded_bits_per_weight"] <= 3.125 for r in rep.layers)
        # the reported bits are those of the packed module's real buffers
        assert all(abs(r["bits_per_weight"] - r["encoded_bits_per_weight"]) < 1e-9 for r in rep.layers)
    out = save_quantized(m, tmp_path / method, {"method": method})
    m2, _ = load_quantized(out, load_tokenizer=False)
    with torch.inference_mode():
        assert torch.equal(m2(input_ids=x).logits, logits)


def test_order_bound_analysis_in_report(calib):
    m = tiny_llama(layers=1)
    rep = quantize_(
        m,
        "gptq",
        calib,
        bits=3,
        group_size=32,
        progress=False,
        analyze_orders=("natural", "act", "min-pivot"),
    )
    for row in rep.layers:
        tb = row["order_bounds"]
        assert set(tb) == {"natural", "act", "min-pivot"}
        for v in tb.values():
            assert v["noclip_error"] <= v["bound"] * (1 + 1e-9)


@pytest.mark.parametrize("order,direction", [("natural", "front"), ("act", "back")])
def test_babai_method_equals_gptq_static_groups_in_pipeline(calib, order, direction):
    """`--method babai` == `--method gptq --static-groups` with the same order/direction (Thm. 4)."""
    opts = {
        "bits": 3,
        "group_size": 32,
        "order": order,
        "direction": direction,
        "clip": False,
        "scale_method": "minmax",
    }
    a, b = tiny_llama(), tiny_llama()
    quantize_(a, "babai", calib, progress=False, **opts)
    quantize_(b, "gptq", calib, progress=False, static_groups=True, dtype="float64", **opts)
    for (name, qa), qb in zip(quantized_modules(a).items(), quantized_modules(b).values(), strict=True):
        assert torch.equal(qa.codes(), qb.codes()), name
