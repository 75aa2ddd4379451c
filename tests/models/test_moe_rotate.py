"""``--rotate`` on mixtures of experts (models/moe.py rotation maps, pipeline/rotate.py): on tiny random
models from transformers' own config classes, the float logits are unchanged by the rotation (routers,
every expert, shared experts and dense layers folded); a rotated GPTQ W4 and W4A4 run saves, loads back
to the same logits with every expert's online Hadamard re-attached, and generates; SpinQuant learns on
an MoE; what cannot be rotated is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

import bitmosaic
from bitmosaic.errors import OptionError
from bitmosaic.io.saved.load import load_quantized
from bitmosaic.io.saved.save import save_quantized
from bitmosaic.models.arch import get_arch
from bitmosaic.modules.rotation import input_rotation_spec
from bitmosaic.pipeline.rotate import rotate_model
from bitmosaic.testing import VOCAB, tiny_moe

# each with a dense layer where the architecture has one (the maps' optional names)
MOE = {
    "qwen3_moe": dict(mlp_only_layers=[0]),
    "mixtral": {},
    "olmoe": {},
    "qwen2_moe": dict(mlp_only_layers=[1]),
    "deepseek_v3": {},  # layer 0 dense (first_k_dense_replace=1), q_a/q_b
    "deepseek_v3-no-q-lora": dict(q_lora_rank=None),  # q_proj reads the input norm
    "gpt_oss": {},
}


def tiny(name: str, seed: int = 0, **overrides):
    """``tiny_moe`` with norm scales far from 1 and every bias (and gpt-oss's sinks) far from 0: the
    folding must matter."""
    model = tiny_moe(name.split("-")[0], seed=seed, **{**MOE[name], **overrides}).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)
            elif p.ndim == 1:
                p.normal_(0, 0.1)
    return model


def _ids(n=2, seqlen=24, seed=1):
    return torch.randint(4, VOCAB, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _moe(model) -> int:
    """The index of the first layer with routed experts."""
    return next(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))


def _writers(model) -> set[str]:
    """Every linear that writes the residual stream, found from the model's own modules (not the map)."""
    return {n for n, _ in model.named_modules() if n.endswith((".o_proj", ".down_proj"))}


@pytest.mark.parametrize("kind", ["hadamard", "random"])
@pytest.mark.parametrize("name", MOE)
def test_float_model_unchanged(name, kind):
    model = tiny(name)
    ids = _ids()
    ref = _logits(model, ids)
    router = "mlp.router" if name == "gpt_oss" else "mlp.gate"
    moe_layer = model.model.layers[_moe(model)]
    before = {k: v.clone() for k, v in model.named_parameters() if "sinks" in k or "a_layernorm" in k}
    before |= {k: v.clone() for k, v in model.named_buffers() if "e_score_correction_bias" in k}
    router_w = moe_layer.get_submodule(router).weight.clone()
    with torch.no_grad():
        info = rotate_model(model, get_arch(model), kind, seed=5)
    out = _logits(model, ids)
    err = (out - ref).abs().max().item()
    assert err <= 2e-5 * ref.abs().max().item(), err
    # every residual writer has an online rotation, each expert's of its own width
    assert set(info["online"]) == _writers(model)
    width = moe_layer.mlp.experts[0].down_proj.in_features
    assert input_rotation_spec(moe_layer.mlp.experts[3].down_proj) == {"type": "hadamard", "n": width}
    # the router reads the rotated stream (rotated, still float); scale-free norms
    assert not torch.allclose(moe_layer.get_submodule(router).weight, router_w)
    assert type(moe_layer.get_submodule(router)).__name__.endswith("Router")
    assert torch.all(moe_layer.post_attention_layernorm.weight == 1)
    # untouched: gpt-oss's sinks, DeepSeek's latent norms and score-correction bias (not residual readers)
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    assert all(torch.equal(state[k], v) for k, v in before.items())
    if name.startswith("deepseek"):
        assert any("a_layernorm" in k for k in before)
    if name == "gpt_oss":
        assert any("sinks" in k for k in before) and moe_layer.mlp.router.bias is not None


def test_no_hadamard_for_the_expert_width_refused_random_falls_back():
    model = tiny("qwen3_moe", moe_intermediate_size=52)
    ids = _ids()
    ref = _logits(model, ids)
    before = {k: v.clone() for k, v in model.named_parameters() if "norm" in k or "mlp.gate" in k}
    with pytest.raises(OptionError, match=r"order 52 \(mlp\.experts\.0\.down_proj input of qwen3_moe\)") as e:
        rotate_model(model, get_arch(model), "hadamard")
    assert "\n" not in str(e.value) and "use --rotate random" in str(e.value)
    # nothing rotated (the experts were unfused, as every run does first: the same function)
    assert not any(input_rotation_spec(m) for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.named_parameters() if k in before)
    assert (_logits(model, ids) - ref).abs().max() <= 1e-5 * ref.abs().max()
    with torch.no_grad():
        info = rotate_model(model, get_arch(model), "random", seed=1)
    assert info["online"]["model.layers.1.mlp.experts.2.down_proj"] == {"type": "random", "n": 52, "seed": 3}
    out = _logits(model, ids)
    assert (out - ref).abs().max() <= 2e-5 * ref.abs().max()


def test_olmoe_clip_qkv_refused_in_one_line():
    model = tiny("olmoe", clip_qkv=0.5)
    ref = _logits(model, _ids())
    with pytest.raises(OptionError, match=r"cannot rotate olmoe exactly: .*clip_qkv.*use --rotate none") as e:
        rotate_model(model, get_arch(model), "hadamard")
    assert "\n" not in str(e.value)
    assert torch.equal(_logits(model, _ids()), ref)


def _calib():
    return torch.randint(4, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("scheme", ["W4", "W4A4"])
@pytest.mark.parametrize("name", MOE)
def test_rotated_gptq_saved_loaded_generates(name, scheme, tmp_path):
    model = tiny(name)
    ids = _ids()
    ref = _logits(model, ids)
    opts = {"bits": 4} if scheme == "W4" else {"scheme": "W4A4"}
    report = bitmosaic.quantize_(
        model, "gptq", _calib(), progress=False, rotate="hadamard", group_size=16, **opts
    )
    assert report.calibration["rotation"]["online"] == len(_writers(model))
    q = _logits(model, ids)
    assert 0 < (q - ref).abs().max() < ref.abs().max()  # quantized, and still the model
    save_quantized(model, tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    online = cfg["quantization_config"]["rotation"]["online"]
    li = _moe(model)
    assert f"model.layers.{li}.mlp.experts.3.down_proj" in online and len(online) == len(_writers(model))
    for loaded in (load_quantized(tmp_path / "q")[0],):  # bitmosaic.load does not build MoE folders yet
        down = loaded.model.layers[li].mlp.experts[3].down_proj
        assert input_rotation_spec(down) == online[f"model.layers.{li}.mlp.experts.3.down_proj"]
        if scheme == "W4A4":
            assert down.input_quant is not None  # the A4 quantizer runs after the rotation
        assert torch.equal(_logits(loaded, ids), q)
    prompt = ids[:1, :5]
    a = model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    b = loaded.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert a.shape == (1, 9) and torch.equal(a, b)
    # the experts' online rotations matter: without them the same weights compute something else
    for e in loaded.model.layers[li].mlp.experts:
        e.down_proj._forward_pre_hooks.pop(e.down_proj._input_rotation_handle.id)
    assert (_logits(loaded, ids) - q).abs().max() > 1e-2


def test_rotation_keeps_near_lossless_quantization():
    """A near-lossless quantizer (GPTQ W8) after the rotation keeps the float logits: a wrong fold into
    any expert, router or shared expert would give an O(1) error."""
    for name in ("qwen2_moe", "gpt_oss", "deepseek_v3"):
        model = tiny(name)
        ref = _logits(model, _ids())
        bitmosaic.quantize_(model, "gptq", _calib(), progress=False, rotate="hadamard", bits=8, group_size=16)
        out = _logits(model, _ids())
        rel = ((out - ref).norm() / ref.norm()).item()
        assert rel < 0.05, (name, rel)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])  # with R2, and without (MLA)
def test_spinquant_learns_on_experts_and_keeps_float(name):
    from bitmosaic.formats.act import ActQuantSpec

    model, start = tiny(name), tiny(name)
    ids = _ids()
    ref = _logits(model, ids)
    with torch.no_grad():
        rotate_model(start, get_arch(start), "hadamard")
    info = rotate_model(
        model, get_arch(model), "spinquant:steps=2,lr=1.5", calib=_calib(), act=ActQuantSpec("int", 4)
    )
    assert info["learned"]["steps"] == 2 and len(info["learned"]["losses"]) == 2
    assert all(torch.isfinite(torch.tensor(info["learned"]["losses"])))
    out = _logits(model, ids)
    assert (out - ref).abs().max() <= 2e-5 * ref.abs().max()  # the learned rotation is exact too
    moved = (
        model.model.layers[1].mlp.experts[0].up_proj.weight
        - start.model.layers[1].mlp.experts[0].up_proj.weight
    )
    assert moved.abs().max() > 1e-4  # R1 moved from its Hadamard start, and the experts with it


def test_spinquant_run_on_an_moe():
    model = tiny("qwen3_moe")
    report = bitmosaic.quantize_(model, "gptq", _calib(), progress=False, scheme="W4A4", group_size=16,
                                 rotate="spinquant:steps=2,lr=1.5")  # fmt: skip
    rot = report.calibration["rotation"]
    assert rot["kind"] == "spinquant:steps=2,lr=1.5" and rot["learned"]["steps"] == 2
    assert rot["online"] == len(_writers(model))
