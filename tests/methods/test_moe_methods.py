"""Every registered method on a tiny Qwen3-MoE (issue 71, item 4): it quantizes every expert projection
(and leaves the router float), the quantized model runs and stays close to the float one, a smoothing
method's expert rows say why they are unsmoothed; ``--moe-fallback rtn`` either quantizes the thin experts
by RTN or is refused in one line naming why."""

from __future__ import annotations

import pytest
import torch

import bitmosaic
from bitmosaic.errors import OptionError
from bitmosaic.methods import get_method, list_methods
from bitmosaic.methods.base import Method
from bitmosaic.testing import tiny_qwen3_moe

# options a method needs on the tiny model (its defaults otherwise; groups of 32 on 64/32-wide inputs)
OPTIONS = {
    "hptq": {},  # no group size: one scale per row, Huffman-coded
    "hrtn": {},
    "mosaic": {"scheme": "W4A8"},  # 4-bit symmetric per channel with int8 activations
    "sfmp": {"avg_bits": 4},  # needs a budget
}
# relative squared error of the logits against the float model's: the 4-5 bit methods land at 0.001-0.05 on
# this model, the ~3.1-bit Huffman-coded ones (hptq, hrtn) at 0.2-0.3; a broken fold or a wrong expert:
# order 1
BOUND = 0.5


@pytest.fixture(scope="module")
def data():
    calib = torch.randint(4, 128, (8, 32), generator=torch.Generator().manual_seed(0))
    ev = torch.randint(4, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = tiny_qwen3_moe()(ev).logits
    return calib, ev, ref


def _options(name):
    return OPTIONS.get(name, {"group_size": 32})


@pytest.mark.parametrize("name", list_methods())
def test_method_runs_on_moe_layers(name, data):
    calib, ev, ref = data
    model = tiny_qwen3_moe()
    report = bitmosaic.quantize_(model, name, calib, progress=False, **_options(name))
    with torch.no_grad():
        y = model(ev).logits
    assert torch.isfinite(y).all()
    rel = float((y - ref).pow(2).sum() / ref.pow(2).sum())
    assert 0 < rel < BOUND, f"{name}: relative logits error {rel:.4f}"
    rows = {r["name"]: r for r in report.layers}
    for li, layer in enumerate(model.model.layers):
        assert type(layer.mlp.gate).__name__ == "Qwen3MoeTopKRouter"  # the router stays float
        for e, expert in enumerate(layer.mlp.experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert type(getattr(expert, proj)).__name__ != "Linear", (
                    f"{name}: expert {e}.{proj} left float"
                )
                assert f"model.layers.{li}.mlp.experts.{e}.{proj}" in rows
    method = get_method(name)
    expert_rows = [r for n, r in rows.items() if ".experts." in n]
    if method.has_transform:  # the experts' groups are not smoothed, and the rows say why
        assert all(r["transform"]["folded"] is False and "unsmoothed" in r["transform"] for r in expert_rows)
    if method.needs_hessian:  # calibrated: every expert row says how many rows it saw
        assert all(r["expert_tokens"] > 0 for r in expert_rows)


@pytest.mark.parametrize("name", [n for n in list_methods() if get_method(n).needs_hessian])
def test_rtn_fallback_runs_or_is_refused_in_one_line(name, data):
    """Every expert of the tiny model is thin under ``moe_min_tokens=10**6``: a method on a plain integer
    grid gets RTN for all of them; a method with its own format is refused before any work."""
    calib, ev, _ = data
    model = tiny_qwen3_moe()
    method = get_method(name)
    # gptq overrides pack only for --gguf-type, which these options do not set
    plain = (type(method).pack is Method.pack or name == "gptq") and not {"bits", "group_size", "sym"} & set(
        getattr(method.config_cls, "unused", {})
    )
    if not plain:
        with pytest.raises(OptionError, match=rf"^method '{name}' stores its own format \(.*\), so a linear"):
            bitmosaic.quantize_(model, name, calib, progress=False, moe_min_tokens=10**6, moe_fallback="rtn",
                                **_options(name))  # fmt: skip
        return
    report = bitmosaic.quantize_(model, name, calib, progress=False, moe_min_tokens=10**6, moe_fallback="rtn",
                                 **_options(name))  # fmt: skip
    experts = [r for r in report.layers if ".experts." in r["name"]]
    assert experts and all(r["method"] == "rtn" and r["expert_fallback"] == "rtn" for r in experts)
    assert all(r["method"] == name for r in report.layers if ".experts." not in r["name"])
    assert len(report.calibration["experts"]["fallback"]) == 8  # 2 layers x 4 experts
    with torch.no_grad():
        assert torch.isfinite(model(ev).logits).all()
