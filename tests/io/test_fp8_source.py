"""FP8 block-scaled checkpoints (DeepSeek-V3, Qwen3-*-FP8: ``float8_e4m3fn`` weights with a
``weight_scale_inv`` per block) read as the float weights they stand for: the same values as
transformers' own ``FineGrainedFP8Config(dequantize=True)`` (an independent reader), and a streamed
run of such a checkpoint gives the bytes of the in-memory run; malformed ones are refused in one line."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bitmosaic.api import as_recipe, quantize_
from bitmosaic.errors import CorruptModelError, ModelSpecError
from bitmosaic.io import load_model, save_quantized
from bitmosaic.io.sources import fp8_block
from bitmosaic.io.sources.checkpoint import Checkpoint
from bitmosaic.pipeline import RunSettings
from bitmosaic.pipeline.stream import quantize_streaming
from bitmosaic.testing import tiny_moe, word_tokenizer
from tests.pipeline.test_stream import _same_folder

BLOCK = (32, 32)  # several blocks per tiny weight, and partial ones (widths 96 and 16 are not multiples)


def _fp8_checkpoint(tmp, block=BLOCK, drop_scale: str | None = None):
    """A tiny Qwen3-MoE saved as the FP8 hub checkpoints are: every projection (experts included) in
    E4M3 with a float32 scale per block, the rest bf16/float; ``config.json`` says so."""
    folder = tmp / "fp8"
    tiny_moe("qwen3_moe").save_pretrained(folder, safe_serialization=True)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for k, v in sd.items():
        if v.ndim == 2 and k.endswith("proj.weight"):
            out[k], s = fp8_block.quantize(v, block)
            if k != drop_scale:
                out[k + "_scale_inv"] = s
        else:
            out[k] = v
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block),
                                  "activation_scheme": "dynamic"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    word_tokenizer().save_pretrained(folder)
    return folder, out


def _transformers(folder):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    qc = FineGrainedFP8Config(weight_block_size=BLOCK, dequantize=True)
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=qc, dtype=torch.float32)


def test_fp8_block_weights_read_as_transformers_dequantizes_them(tmp_path):
    folder, stored = _fp8_checkpoint(tmp_path)
    ref = dict(_transformers(folder).named_parameters())
    ckpt = Checkpoint(folder)
    assert ckpt.fp8_block == BLOCK
    checked = 0
    for k, v in stored.items():
        if v.dtype != torch.float8_e4m3fn:
            continue
        ours = ckpt.get(k, torch.float32)
        if ".experts." in k:  # transformers fuses the per-expert tensors: [E, 2I, H] (gate rows, then up)
            pre, rest = k.split(".experts.")
            e, proj = int(rest.split(".")[0]), rest.split(".")[1]
            fused = ref[f"{pre}.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][e]
            i = fused.shape[0] // 2
            theirs = fused if proj == "down_proj" else fused[:i] if proj == "gate_proj" else fused[i:]
        else:
            theirs = ref[k]
        assert torch.equal(ours, theirs.detach()), k
        checked += 1
    assert checked == 2 * (4 + 4 * 3)  # 2 layers: q/k/v/o and 4 experts x 3


def test_dequantize_is_value_times_block_scale():
    q = torch.tensor([[1.0, -2.0, 0.5], [448.0, 0.0, -0.25]]).to(torch.float8_e4m3fn)
    s = torch.tensor([[2.0, 3.0]])  # blocks of (2, 2): columns 0-1 scale 2, column 2 scale 3
    got = fp8_block.dequantize(q, s, (2, 2), torch.float32, "w")
    assert torch.equal(got, torch.tensor([[2.0, -4.0, 1.5], [896.0, 0.0, -0.75]]))
    with pytest.raises(CorruptModelError, match="weight_block_size"):
        fp8_block.dequantize(q, torch.ones(1, 1), (2, 2), torch.float32, "w")


def test_streamed_fp8_checkpoint_gives_the_in_memory_bytes(tmp_path):
    folder, _ = _fp8_checkpoint(tmp_path)
    calib = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))
    recipe = ("gptq", {"bits": 4, "group_size": 32})
    m, _ = load_model(str(folder), dtype=torch.float32)
    assert not any(p.dtype == torch.float8_e4m3fn for p in m.parameters())
    quantize_(m, recipe[0], calib, progress=False, moe_min_tokens=1, **recipe[1])
    mem = save_quantized(m, tmp_path / "mem")
    quantize_streaming(Checkpoint(folder), word_tokenizer(), tmp_path / "str", as_recipe(*recipe), calib,
                       RunSettings(progress=False, moe_min_tokens=1))  # fmt: skip
    _same_folder(mem, tmp_path / "str")
    saved = json.loads((tmp_path / "str" / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "bitmosaic"


def test_fp8_weight_without_its_scales_is_refused_in_one_line(tmp_path):
    name = "model.layers.0.self_attn.q_proj.weight"
    folder, _ = _fp8_checkpoint(tmp_path, drop_scale=name)
    with pytest.raises(ModelSpecError) as e:
        Checkpoint(folder).get(name, torch.float32)
    assert "without block scales" in str(e.value) and "\n" not in str(e.value)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["quantization_config"]["weight_block_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelSpecError, match="weight_block_size"):
        Checkpoint(folder)
