"""Experts calibrated as experts (issue 71): routed Hessians weighted by the routing weight, checked
against a hand computation from the routed rows; ``--moe-calib all``; the pooled and RTN fallbacks; the
report's experts summary (API, ``bitmosaic quantize`` print and ``--json``); the router stays float."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import bitmosaic
from bitmosaic.errors import OptionError
from bitmosaic.modules.experts import RoutedExperts, unfuse_experts
from bitmosaic.pipeline.calibration import capture_layer_inputs
from bitmosaic.pipeline.experts import expert_statistics
from bitmosaic.pipeline.settings import RunSettings
from bitmosaic.testing import tiny_qwen3_moe

GATE_UP = ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj")


@pytest.fixture(scope="module")
def calib():
    return torch.randint(4, 128, (8, 32), generator=torch.Generator().manual_seed(0))


def _layer0(model, calib):
    """Layer 0 of the unfused ``model`` and its calibration inputs/kwargs (batches of 4)."""
    unfuse_experts(model)
    layers = model.model.layers
    inputs, kw = capture_layer_inputs(model, layers, calib, batch_size=4)
    return layers[0], inputs, next(iter(kw.values()))


def _group(layer):
    n = len(layer.mlp.experts)
    return tuple(f"mlp.experts.{e}.{p}" for e in range(n) for p in ("gate_proj", "up_proj"))


def _moe_inputs(layer, inputs, kwargs):
    """The rows the MoE block reads (the post-attention norm's output), every batch concatenated."""
    seen = []
    h = layer.mlp.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        for x, kw in zip(inputs, kwargs, strict=True):
            layer(x, **kw)
    h.remove()
    return torch.cat(seen)


def _by_hand_routing(x, gate: nn.Module, k: int, norm: bool, bias=None):
    """Top-``k`` experts and routing weights, computed here from the router's weight (and ``bias``)."""
    logits = x.double() @ gate.weight.detach().double().T
    probs = torch.softmax(logits if bias is None else logits + bias.double(), dim=-1)
    w, idx = probs.topk(k, dim=-1)
    return idx, (w / w.sum(-1, keepdim=True) if norm else w)


def test_routed_hessian_is_the_routing_weighted_sum(calib):
    """``moe_calib='routed'``: expert e's gate/up Hessian is ``2/n_e sum_t w_t^2 x_t x_t^T`` over the rows
    routed to it, the routing done by hand from the router's weight (not by the code under test)."""
    model = tiny_qwen3_moe()
    layer, inputs, kwargs = _layer0(model, calib)
    x = _moe_inputs(layer, inputs, kwargs)
    idx, w = _by_hand_routing(
        x, layer.mlp.gate, model.config.num_experts_per_tok, model.config.norm_topk_prob
    )
    accs, owner, _, stats = expert_statistics(
        layer, _group(layer), inputs, kwargs, settings=RunSettings(moe_min_tokens=0)
    )
    assert not stats.fallback
    weighted = unweighted = 0
    for e in range(len(layer.mlp.experts)):
        rows, slot = (idx == e).nonzero(as_tuple=True)
        xe, we = x[rows].double(), w[rows, slot]
        own = f"mlp.experts.{e}.gate_proj"
        assert owner[f"mlp.experts.{e}.up_proj"] == own  # gate and up read one tensor: one Hessian
        assert stats.tokens[own] == len(rows) > 0
        H = 2.0 / len(rows) * (xe * we[:, None]).T @ (xe * we[:, None])
        torch.testing.assert_close(accs[own].H.double(), H, rtol=1e-4, atol=1e-6)
        got = accs[own].H.detach().double().clone()
        weighted += float((got - H).norm() / H.norm())
        unweighted += float((got - 2.0 / len(rows) * xe.T @ xe).norm() / H.norm())
    assert weighted < 1e-4 < unweighted  # the weights are really applied


def test_all_sends_every_token_through_every_expert(calib):
    """``moe_calib='all'``: every expert's Hessian is the unweighted ``2/N sum x x^T`` of all N rows, no
    expert falls back, and the routed outputs do not change."""
    model = tiny_qwen3_moe()
    layer, inputs, kwargs = _layer0(model, calib)
    x = _moe_inputs(layer, inputs, kwargs).double()
    settings = RunSettings(moe_calib="all", moe_min_tokens=10**6)  # every expert sees N < 10**6 rows...
    accs, _, _, stats = expert_statistics(layer, _group(layer), inputs, kwargs, settings=settings)
    H = 2.0 / x.shape[0] * x.T @ x
    for e in range(len(layer.mlp.experts)):
        own = f"mlp.experts.{e}.gate_proj"
        assert stats.tokens[own] == x.shape[0]
        torch.testing.assert_close(accs[own].H.double(), H, rtol=1e-4, atol=1e-6)
    assert set(stats.fallback) == set(stats.tokens)  # ...so with that threshold all fall back (to pooled)
    assert not expert_statistics(layer, _group(layer), inputs, kwargs,
                                 settings=RunSettings(moe_calib="all"))[3].fallback  # fmt: skip
    experts: RoutedExperts = layer.mlp.experts
    hs = torch.randn(5, x.shape[1])
    top = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2]])
    wts = torch.rand(5, 2)
    routed = experts(hs, top, wts)
    experts.observe_all = True
    try:
        assert torch.equal(experts(hs, top, wts), routed)
    finally:
        experts.observe_all = False


class _BiasedRouter(nn.Module):
    """Qwen3-MoE's top-k router with a bias on its logits (the same computation otherwise)."""

    def __init__(self, gate: nn.Module, bias: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.bias, self.top_k, self.norm = gate.weight, bias, gate.top_k, gate.norm_topk_prob

    def forward(self, hidden_states):
        logits = nn.functional.linear(hidden_states.reshape(-1, self.weight.shape[1]), self.weight, self.bias)
        value, index = torch.topk(torch.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
        if self.norm:
            value = value / value.sum(dim=-1, keepdim=True)
        return logits, value.to(logits.dtype), index


def test_pooled_fallback_for_an_expert_biased_to_zero_tokens(calib):
    """An expert the router never picks (a large negative bias on its logit) gets the layer's pooled
    Hessian: every routed row of the other experts, weighted by its routing weight, over all their rows."""
    model = tiny_qwen3_moe()
    bias = torch.tensor([0.0, 0.0, 0.0, -1e4])
    model.model.layers[0].mlp.gate = _BiasedRouter(model.model.layers[0].mlp.gate, bias)
    layer, inputs, kwargs = _layer0(model, calib)
    x = _moe_inputs(layer, inputs, kwargs)
    idx, w = _by_hand_routing(x, layer.mlp.gate, 2, model.config.norm_topk_prob, bias)
    assert not bool((idx == 3).any())
    accs, _, _, stats = expert_statistics(layer, _group(layer), inputs, kwargs, settings=RunSettings())
    assert stats.fallback == {"mlp.experts.3.gate_proj": "pooled"}
    assert stats.tokens["mlp.experts.3.gate_proj"] == 0
    xd, pooled, n_all = x.double(), 0, 0
    for e in range(3):
        rows, slot = (idx == e).nonzero(as_tuple=True)
        xe = xd[rows] * w[rows, slot][:, None]
        pooled, n_all = pooled + 2.0 * xe.T @ xe, n_all + len(rows)
    torch.testing.assert_close(
        accs["mlp.experts.3.gate_proj"].H.double(), pooled / n_all, rtol=1e-4, atol=1e-6
    )


def test_rtn_fallback_quantizes_thin_experts_by_rtn_on_the_runs_grid(calib):
    """``moe_fallback='rtn'``: an expert below the threshold is the registry's round-to-nearest with MSE
    scales on the run's grid (bits, group size, symmetry), the others GPTQ; the report says which."""
    from bitmosaic.methods import get_method

    model = tiny_qwen3_moe()
    float_model = copy.deepcopy(model)
    report = bitmosaic.quantize_(
        model, "gptq", calib, bits=3, group_size=32, progress=False, moe_min_tokens=120, moe_fallback="rtn"
    )
    fell = report.calibration["experts"]["fallback"]
    assert fell and all(f["rule"] == "rtn" and f["tokens"] < 120 for f in fell)
    rows = {r["name"]: r for r in report.layers}
    cfg = get_method("rtn").make_config(bits=3, group_size=32, scale="mse")
    unfuse_experts(float_model)
    for f in fell:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"{f['expert']}.{proj}"
            assert rows[name]["method"] == "rtn" and rows[name]["expert_fallback"] == "rtn"
            W = float_model.get_submodule(name).weight.data
            want = get_method("rtn").quantize(W.float(), None, cfg).dequantize(torch.float32)
            if proj != "down_proj":  # down_proj's input comes after quantized gate/up: same weights, though
                assert torch.equal(model.get_submodule(name).dequantize_weight(torch.float32), want)
    kept = [r for r in report.layers if "expert_tokens" in r and "expert_fallback" not in r]
    assert kept and all(r["expert_tokens"] >= 120 and r["method"] == "gptq" for r in kept)


@pytest.mark.parametrize("method, options", [("mosaic", {"scheme": "W4A8"}), ("hptq", {})])
def test_rtn_fallback_refused_for_a_method_with_its_own_format(calib, method, options):
    with pytest.raises(OptionError, match=f"method '{method}' stores its own format.*--moe-fallback pooled"):
        bitmosaic.quantize_(tiny_qwen3_moe(), method, calib, progress=False, moe_fallback="rtn", **options)


def test_report_lists_fallbacks_and_tokens_per_expert(calib):
    model = tiny_qwen3_moe()
    report = bitmosaic.quantize_(model, "gptq", calib, group_size=32, progress=False, moe_min_tokens=120)
    moe = report.calibration["experts"]
    assert (moe["calib"], moe["min_tokens"], moe["fallback_rule"]) == ("routed", 120, "pooled")
    assert set(moe["layers"]) == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    for name, s in moe["layers"].items():
        counts = sorted(r["expert_tokens"] for r in report.layers if r["name"].startswith(name)
                        and r["name"].endswith("gate_proj"))  # fmt: skip
        assert s["experts"] == 4 and (s["min"], s["max"]) == (counts[0], counts[-1])
        assert s["median"] == (counts[1] + counts[2]) / 2
        assert sum(counts) == calib.numel() * 2  # top-2: every token routed twice
    low = {r["name"].rsplit(".", 1)[0] for r in report.layers if r.get("expert_tokens", 10**9) < 120}
    assert low and {f["expert"] for f in moe["fallback"]} == low
    assert all(f["linears"] == ["gate_proj", "up_proj", "down_proj"] and f["rule"] == "pooled"
               for f in moe["fallback"])  # fmt: skip


def test_dense_report_has_no_experts_entry(calib):
    from bitmosaic.testing import tiny_llama

    report = bitmosaic.quantize_(tiny_llama(), "gptq", calib, group_size=32, progress=False)
    assert "experts" not in report.calibration


def test_quantize_prints_and_writes_the_experts_summary(tmp_path, calib, capsys):
    """``bitmosaic quantize`` prints the per-layer rows per expert and each fallback, and its ``--json``
    holds the summary."""
    from bitmosaic.cli import main
    from bitmosaic.testing import save_hf_dir

    src = save_hf_dir(tmp_path / "moe", tiny_qwen3_moe())
    out, text_file = tmp_path / "run.json", tmp_path / "calib.txt"
    text_file.write_text(" ".join(f"w{(i * 37) % 100}" for i in range(3000)))
    rc = main(
        [
            "quantize",
            "--model",
            str(src),
            "--calib",
            str(text_file),
            "--nsamples",
            "8",
            "--seqlen",
            "32",
            "--method",
            "gptq",
            "--group-size",
            "32",
            "--moe-min-tokens",
            "120",
            "--moe-fallback",
            "rtn",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    moe = json.loads(out.read_text())["calibration"]["experts"]
    assert moe["fallback_rule"] == "rtn" and moe["min_tokens"] == 120 and moe["fallback"]
    assert "calibration rows per expert, min/median/max" in text
    for name, s in moe["layers"].items():
        assert f"{name}: {s['experts']} experts, {s['min']}/{s['median']:g}/{s['max']}" in text
    for f in moe["fallback"]:
        assert f"{f['expert']} ({f['tokens']} rows): rtn" in text


def test_router_stays_float(calib):
    model = tiny_qwen3_moe()
    gates = [copy.deepcopy(layer.mlp.gate.weight.data) for layer in model.model.layers]
    bitmosaic.quantize_(model, "gptq", calib, group_size=32, progress=False)
    for layer, g in zip(model.model.layers, gates, strict=True):
        assert type(layer.mlp.gate).__name__ == "Qwen3MoeTopKRouter"
        assert torch.equal(layer.mlp.gate.weight.data, g)
        assert not isinstance(layer.mlp.gate, nn.Linear)  # not swapped for a quantized kind either
        assert all(type(e.gate_proj).__name__ != "Linear" for e in layer.mlp.experts)


def test_min_tokens_setting():
    assert RunSettings().moe_min_tokens == "auto"
    assert RunSettings(moe_min_tokens="64").moe_min_tokens == 64  # as the CLI writes it
    with pytest.raises(OptionError, match="moe_min_tokens must be 'auto' or an integer >= 0"):
        RunSettings(moe_min_tokens=-1)
    assert "moe_min_tokens" not in RunSettings().record()
    assert RunSettings(moe_min_tokens=8, moe_fallback="rtn").record()["moe_fallback"] == "rtn"


def test_all_calibration_is_the_same_with_and_without_the_output_cache():
    """Under --moe-calib all an expert's gate/up run twice a batch (all tokens, then its routed rows): a
    cached output of the first call must not answer the second."""
    import bitmosaic
    from bitmosaic.testing import tiny_qwen3_moe

    ids = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))
    outs = []
    for cache in (True, False):
        m = tiny_qwen3_moe()
        bitmosaic.quantize_(m, "gptq", ids, bits=4, group_size=16, progress=False, moe_calib="all",
                            cache_outputs=cache)  # fmt: skip
        with torch.no_grad():
            outs.append(m(ids).logits)
    assert torch.equal(*outs)
