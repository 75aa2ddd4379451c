"""Mixture-of-experts maps (models/moe.py) on tiny random models built from transformers' own config
classes: unfusing the experts leaves the float logits unchanged, a run that leaves every layer float saves
and loads back the same logits, GPTQ quantizes exactly the map's linears (routers and one-row gates stay
float), and the saved model loads back to the in-memory quantized model's logits and generates."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bitmosaic
from bitmosaic.io.saved.load import load_quantized
from bitmosaic.io.saved.save import quantized_modules, save_quantized
from bitmosaic.models.arch import ARCHS, get_arch
from bitmosaic.modules.experts import RoutedExperts, unfuse_experts

VOCAB = 128
_BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=VOCAB,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
# each with a dense layer where the architecture has one (the map's optional names)
CONFIGS = {
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=32, mlp_only_layers=[1]),  # fmt: skip
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8,
                      mlp_only_layers=[0]),  # fmt: skip
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1,
                        num_key_value_heads=4),  # fmt: skip
    "deepseek_v3-no-q-lora": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                  first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1,
                                  topk_group=1, num_key_value_heads=4),  # fmt: skip
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=8),
}


def tiny(name: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(name.split("-")[0], **{**_BASE, **CONFIGS[name]})
    model = AutoModelForCausalLM.from_config(cfg).eval().float()
    with torch.no_grad():  # larger than the init's 0.02: routing and rounding both matter
        for n, p in model.named_parameters():
            if p.ndim >= 2 or n.endswith("bias") or "sinks" in n:
                p.normal_(0, 0.1)
    return model


def _ids(n=4, seqlen=24, seed=1):
    return torch.randint(3, VOCAB, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("name", CONFIGS)
def test_unfused_float_unchanged(name):
    model = tiny(name)
    ids = _ids()
    ref = _logits(model, ids)
    dense = name.startswith(("qwen", "deepseek"))  # one dense layer (mlp_only_layers, first_k_dense_replace)
    assert unfuse_experts(model) == (1 if dense else 2)
    assert any(isinstance(m, RoutedExperts) for m in model.modules())
    out = _logits(model, ids)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


def _expected(model) -> set[str]:
    """Every linear the map names in every layer (after unfusing), qualified."""
    arch = get_arch(model)
    return {f"{arch.layers_path}.{i}.{n}" for i, layer in enumerate(arch.layers(model))
            for n in arch.layer_linear_names(layer)}  # fmt: skip


def test_map_groups_per_layer():
    """Dense and MoE layers of one model: the optional names and the expert wildcards expand per layer."""
    model = tiny("deepseek_v3")
    unfuse_experts(model)
    arch, layers = get_arch(model), get_arch(model).layers(model)
    dense, moe = arch.layer_linear_names(layers[0]), arch.layer_linear_names(layers[1])
    attn = ["self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.q_b_proj", "self_attn.kv_b_proj",
            "self_attn.o_proj"]  # fmt: skip
    assert dense == attn + ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    shared = [f"mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    routed = [f"mlp.experts.{e}.{p}" for p in ("gate_proj", "up_proj") for e in range(4)]
    assert moe == attn + shared + routed + [f"mlp.experts.{e}.down_proj" for e in range(4)]
    for gi, group in enumerate(arch.groups(layers[1])):  # a group is all experts or none
        assert all("experts." in n and "shared" not in n for n in group) == arch.expert_group(gi) or not group
    model = tiny("qwen2_moe")
    unfuse_experts(model)
    arch, layers = get_arch(model), get_arch(model).layers(model)
    assert "mlp.shared_expert.gate_proj" in arch.layer_linear_names(layers[0])
    assert arch.layer_linear_names(layers[1])[4:] == ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_float_experts_saved_and_loaded(name, tmp_path):
    """A recipe that leaves every MLP linear float (routed, shared and dense): the experts are saved one
    float linear per expert projection and load back bit for bit, the logits with them."""
    model = tiny(name)
    ids = _ids()
    unfuse_experts(model)
    before = {k: v.clone() for k, v in model.state_dict().items() if ".mlp." in k}
    recipe = {"method": "gptq", "settings": {"bits": 4, "group_size": 16}, "skip": [r"\.mlp\."]}
    bitmosaic.quantize_(model, recipe, ids, progress=False)
    assert quantized_modules(model) and not any(".mlp." in n for n in quantized_modules(model))
    q = _logits(model, ids)
    save_quantized(model, tmp_path / "q")
    loaded, _ = load_quantized(tmp_path / "q")
    sd = loaded.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in before.items())
    assert torch.equal(_logits(loaded, ids), q)


@pytest.mark.parametrize("name", CONFIGS)
def test_gptq_saved_loaded_generates(name, tmp_path):
    model = tiny(name)
    ids = _ids()
    ref = _logits(model, ids)
    floats = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    bitmosaic.quantize_(model, "gptq", ids, bits=4, group_size=16, progress=False)
    got = set(quantized_modules(model))
    assert got == _expected(model)  # every map linear of every layer, dense and MoE alike
    for n in ("mlp.gate", "mlp.router", "mlp.shared_expert_gate"):  # routers and one-row gates: float
        for layer in get_arch(model).layers(model):
            if n in dict(layer.named_modules()):
                assert not any(k.endswith(n) for k in got)
    assert floats - got - {"lm_head"} <= {n for n in floats if n.endswith(("mlp.gate", "shared_expert_gate"))}
    q = _logits(model, ids)
    assert 0 < (q - ref).abs().max() < ref.abs().max()  # quantized, and still the model
    save_quantized(model, tmp_path / "q")
    loaded, _ = load_quantized(tmp_path / "q")
    assert type(loaded) is type(model)
    assert torch.equal(_logits(loaded, ids), q)
    prompt = ids[:1, :5]
    a = model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    b = loaded.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert a.shape == (1, 9) and torch.equal(a, b)


def test_every_moe_map_registered():
    for t in CONFIGS:
        t = t.split("-")[0]
        assert t in ARCHS and not ARCHS[t].rotation.refuse  # rotated: tests/models/test_moe_rotate.py
