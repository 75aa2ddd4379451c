"""QuaRot's rotations (``--rotate``): the float model is unchanged on every architecture with a rotation
map, refused in one line where none exists, composed with quantization, saved and loaded back."""

from __future__ import annotations

import pytest
import torch

from bitmosaic.errors import OptionError
from bitmosaic.models.arch import ARCHS, get_arch
from bitmosaic.modules.rotation import input_rotation_spec
from bitmosaic.pipeline.rotate import rotate_model

VOCAB = 128

# tiny configs per model_type: hidden 48 = 12·4 (a Paley factor), intermediate 80 = 20·4, head_dim 16
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=3,
    num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True,
    pad_token_id=0, bos_token_id=2, eos_token_id=1,
)  # fmt: skip
_EXTRA = {
    "qwen2": dict(),  # q/k/v biases
    "qwen3": dict(),  # q_norm/k_norm
    "granite": dict(
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0
    ),  # fmt: skip
    "gemma": dict(),
    "llama": dict(attention_bias=True),  # o_proj bias too
    "smollm3": dict(),
    "phi3": dict(),  # fused qkv_proj / gate_up_proj: R2 on qkv_proj's value rows only
}


def tiny(model_type: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **_COMMON, **_EXTRA.get(model_type, {}))
    model = AutoModelForCausalLM.from_config(cfg).eval().float()
    offset = get_arch(model).norm_offset
    with torch.no_grad():  # norm scales far from 1 and biases far from 0: the folding must matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + 1.0 - offset)
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    return model


ROTATABLE = ["llama", "mistral", "qwen2", "qwen3", "gemma", "granite", "smollm3", "phi3"]
REFUSED = ["gemma2", "olmo2"]
# mixtures of experts: rotated, tested in tests/models/test_moe_rotate.py
MOE_ROTATABLE = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "gpt_oss"]
# multimodal language towers: refused too, tested in tests/models/test_multimodal.py
MULTIMODAL_REFUSED = ["gemma3", "llava", "qwen2_5_vl", "qwen3_vl"]


def test_every_supported_architecture_is_listed():
    """Each architecture map either rotates (tested below) or says why not (refused below)."""
    named = set(ROTATABLE) | set(REFUSED) | set(MULTIMODAL_REFUSED) | set(MOE_ROTATABLE)
    text_towers = ("gemma3_text", "qwen2_5_vl_text", "qwen3_vl_text")  # built as their multimodal models
    missing = {t for t, a in ARCHS.items() if t not in named and t not in text_towers}
    assert not missing
    for t in REFUSED + MULTIMODAL_REFUSED + ["gemma3_text"]:
        assert ARCHS[t].rotation.refuse
    for t in ROTATABLE + MOE_ROTATABLE:
        assert not ARCHS[t].rotation.refuse


@pytest.mark.parametrize("kind", ["hadamard", "random"])
@pytest.mark.parametrize("model_type", ROTATABLE)
def test_float_model_unchanged(model_type, kind):
    model = tiny(model_type)
    ids = torch.randint(4, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        info = rotate_model(model, get_arch(model), kind, seed=5)
        out = model(ids).logits
    err = (out - ref).abs().max().item()
    assert err <= 2e-5 * ref.abs().max().item(), err
    assert info["untied"] and model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.config.tie_word_embeddings is False
    # the weights did change: scale-free norms, an online rotation per o_proj and down_proj
    norm = model.model.layers[0].input_layernorm.weight
    assert torch.all(norm + get_arch(model).norm_offset == 1)
    assert len(info["online"]) == 4
    assert input_rotation_spec(model.model.layers[1].mlp.down_proj) == {"type": "hadamard", "n": 80}
    o_proj = model.model.layers[1].self_attn.o_proj
    assert input_rotation_spec(o_proj) == {"type": "hadamard", "n": o_proj.in_features}


@pytest.mark.parametrize("model_type", REFUSED)
def test_refused_in_one_line(model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {**_COMMON, "intermediate_size": 80}
    cfg = AutoConfig.for_model(model_type, **kw)
    model = AutoModelForCausalLM.from_config(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(OptionError, match=r"--rotate hadamard cannot rotate .*use --rotate none") as e:
        rotate_model(model, get_arch(model), "hadamard")
    assert "\n" not in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched


def test_unknown_hadamard_order_refused_random_falls_back():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=52, num_hidden_layers=1,
                      num_attention_heads=3, num_key_value_heads=1, head_dim=16)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with pytest.raises(OptionError, match=r"no Hadamard matrix of order 52 .*use --rotate random"):
        rotate_model(model, get_arch(model), "hadamard")
    ids = torch.randint(4, VOCAB, (1, 16))
    with torch.no_grad():
        ref = model(ids).logits
        info = rotate_model(model, get_arch(model), "random", seed=1)
        out = model(ids).logits
    assert info["online"]["model.layers.0.mlp.down_proj"] == {"type": "random", "n": 52, "seed": 3}
    assert (out - ref).abs().max() <= 2e-5 * ref.abs().max()


def test_rotating_twice_refused():
    model = tiny("llama")
    rotate_model(model, get_arch(model), "hadamard")
    with pytest.raises(OptionError, match="already rotated"):
        rotate_model(model, get_arch(model), "hadamard")


def test_rotation_removes_a_channel_outlier():
    """Why it helps: a residual channel 50x larger than the rest is spread over every channel."""
    model = tiny("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 7] *= 50
    captured = []
    h = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, a: captured.append(a[0]))
    ids = torch.randint(4, VOCAB, (1, 32))
    with torch.no_grad():
        model(ids)
        rotate_model(model, get_arch(model), "hadamard")
        model(ids)
    h.remove()
    ratio = [(x.abs().amax(-1) / x.abs().mean(-1)).mean().item() for x in captured]
    assert ratio[1] < ratio[0] / 3, ratio


@pytest.mark.parametrize(
    "method,opts", [("gptq", {"bits": 8, "order": "act"}), ("smoothquant", {"scheme": "W8A8"})]
)
def test_fused_projections_rotate_and_quantize(method, opts):
    """Phi-3's fused qkv_proj / gate_up_proj: R1 on their inputs, R2 on qkv_proj's value rows only, the
    online Hadamards at o_proj and down_proj; a near-lossless quantizer keeps the float logits."""
    from bitmosaic import quantize_

    ids = torch.randint(4, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    calib = torch.randint(4, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = tiny("phi3")(ids).logits
    m = tiny("phi3")
    report = quantize_(m, method, calib, progress=False, rotate="hadamard", **opts)
    assert report.calibration["rotation"]["online"] == 4
    assert input_rotation_spec(m.model.layers[0].self_attn.o_proj) == {"type": "hadamard", "n": 48}
    with torch.no_grad():
        out = m(ids).logits
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 0.15, rel  # a wrong fold gives ~1
