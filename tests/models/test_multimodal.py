"""Multimodal models (gemma3, llava, qwen2_5_vl, qwen3_vl): only the language tower is quantized, the
vision tower and projector stay float bit for bit, and the saved model loads back (``load_quantized``,
``bitmosaic.load``, ``load_model``) as the same multimodal class with the in-memory model's logits, on
text and (llava) on an image; a float folder loads as its multimodal class too."""

from __future__ import annotations

import pytest
import torch

import bitmosaic
from bitmosaic.errors import OptionError
from bitmosaic.io.saved.load import load_quantized
from bitmosaic.io.saved.save import quantized_modules, save_quantized
from bitmosaic.io.sources.loading import load_model
from bitmosaic.models.arch import ARCHS, UnknownArchitectureError, get_arch
from bitmosaic.pipeline.rotate import rotate_model

VOCAB = 128
_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=VOCAB,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)  # fmt: skip
_VIT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
_QWEN_VIT = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32, patch_size=8,
                 spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
_MROPE = {"mrope_section": [1, 1, 2]}
_MROPE3 = {"rope_type": "default", "mrope_interleaved": True, **_MROPE}
CONFIGS = {
    "llava": dict(text_config=dict(model_type="llama", **_TEXT), image_token_index=127,
                  vision_config=dict(model_type="clip_vision_model", image_size=32, patch_size=8,
                                     projection_dim=32, **_VIT)),  # fmt: skip
    "gemma3": dict(text_config=dict(head_dim=8, **_TEXT),
                   vision_config=dict(image_size=32, patch_size=8, **_VIT),
                   mm_tokens_per_image=4, image_token_index=127, boi_token_index=125,
                   eoi_token_index=126),  # fmt: skip
    "qwen2_5_vl": dict(text_config=dict(rope_scaling={"type": "mrope", **_MROPE}, **_TEXT),
                       vision_config=dict(fullatt_block_indexes=[0], window_size=16,
                                          **_QWEN_VIT)),  # fmt: skip
    "qwen3_vl": dict(text_config=dict(head_dim=8, rope_scaling=_MROPE3, **_TEXT),
                     vision_config=dict(deepstack_visual_indexes=[0], num_position_embeddings=16,
                                        **_QWEN_VIT)),  # fmt: skip
}
CLASSES = {
    "llava": "LlavaForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
}


def tiny(model_type: str, seed: int = 0, **over):
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **{**CONFIGS[model_type], **over})
    model = AutoModelForImageTextToText.from_config(cfg).eval().float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim >= 2 and "language_model" in n:
                p.normal_(0, 0.1)
    return model


def _ids(n=4, seqlen=24, seed=1):
    return torch.randint(3, 120, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(input_ids=ids, **kw).logits


def _tower(model) -> dict[str, torch.Tensor]:
    """The float parameters outside the language tower (vision tower, projector)."""
    sd = model.state_dict()
    return {k: v.clone() for k, v in sd.items() if "language_model" not in k and "lm_head" not in k}


@pytest.mark.parametrize("model_type", CONFIGS)
def test_language_tower_quantized_saved_loaded(model_type, tmp_path):
    model = tiny(model_type)
    assert get_arch(model).layers_path == "model.language_model.layers"
    ids = _ids()
    ref = _logits(model, ids)
    vision = _tower(model)
    assert vision  # there is a vision tower to keep
    bitmosaic.quantize_(model, "gptq", ids, bits=4, group_size=16, progress=False)
    got = set(quantized_modules(model))
    proj = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert got == {f"model.language_model.layers.{i}.{p}.{n}" for i in range(2) for p, n in
                   [("self_attn", x) for x in proj[:4]] + [("mlp", x) for x in proj[4:]]}  # fmt: skip
    q = _logits(model, ids)
    assert 0 < (q - ref).abs().max() < ref.abs().max()
    save_quantized(model, tmp_path / "q")
    folder = tmp_path / "q"
    for loaded in (load_quantized(folder)[0], bitmosaic.load(folder), load_model(str(folder))[0]):
        assert type(loaded).__name__ == CLASSES[model_type]
        assert torch.equal(_logits(loaded, ids), q)
        sd = loaded.state_dict()
        assert all(torch.equal(sd[k], v) for k, v in vision.items())  # vision tower and projector: float
    out = loaded.generate(ids[:1, :5], max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape == (1, 8)


def test_llava_image_saved_loaded(tmp_path):
    """An image through the float vision tower into the quantized language tower: the loaded model
    gives the in-memory model's logits."""
    model = tiny("llava")
    ids = _ids(n=2)
    bitmosaic.quantize_(model, "gptq", ids, bits=4, group_size=16, progress=False)
    image = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    prompt = torch.cat([torch.full((1, 16), 127), _ids(n=1, seqlen=8)], 1)  # 16 patches of 8x8
    q = _logits(model, prompt, pixel_values=image)
    assert not torch.equal(q, _logits(model, prompt, pixel_values=image + 1))  # the image is read
    save_quantized(model, tmp_path / "q")
    loaded, _ = load_quantized(tmp_path / "q")
    assert torch.equal(_logits(loaded, prompt, pixel_values=image), q)


def test_float_folder_loads_as_its_class(tmp_path):
    model = tiny("qwen2_5_vl")
    model.save_pretrained(tmp_path / "f")
    loaded, _ = load_model(str(tmp_path / "f"))
    assert type(loaded).__name__ == CLASSES["qwen2_5_vl"]
    ids = _ids(n=1)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


def test_text_config_decides_the_map():
    """A LLaVA over a Gemma text model gets Gemma's map (norm offset 1) at the language tower; an
    unmapped text model is refused in one line naming it."""
    text = dict(model_type="gemma", head_dim=8, **_TEXT)
    model = tiny("llava", text_config=text)
    arch = get_arch(model)
    assert arch.norm_offset == 1.0 and arch.layers_path == "model.language_model.layers"
    assert ARCHS["llava"].norm_offset == 0.0
    model.config.text_config.model_type = "mpt"
    with pytest.raises(UnknownArchitectureError, match="language tower is 'mpt'.*register_arch") as e:
        get_arch(model)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("model_type", CONFIGS)
def test_rotation_refused_in_one_line(model_type):
    model = tiny(model_type)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(OptionError, match=r"--rotate hadamard cannot rotate .*use --rotate none") as e:
        rotate_model(model, get_arch(model), "hadamard")
    assert "\n" not in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
