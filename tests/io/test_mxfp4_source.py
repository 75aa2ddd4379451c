"""gpt-oss's native MXFP4 checkpoint (``*_blocks``: two FP4 E2M1 codes a byte, low nibble first;
``*_scales``: one E8M0 exponent per 32 values) loads through bitmosaic's float loading as the exactly
decoded float weights: the codes are decoded here by hand (sign, magnitude table, ``2**(scale - 127)``),
independently of transformers' lookup table and ``ldexp``.  Streaming reads it one expert at a time
(tests/pipeline/test_stream_gpt_oss.py); fused blocks without their scales are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from bitmosaic.errors import ModelSpecError
from bitmosaic.io.sources.checkpoint import Checkpoint
from bitmosaic.io.sources.loading import load_model
from bitmosaic.testing import save_hf_dir
from tests.models.test_moe_archs import tiny

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # OCP MX spec, FP4 E2M1 magnitudes


def _decode_row(blocks: torch.Tensor, scales: torch.Tensor) -> list[float]:
    """One output row: ``blocks`` [G, 16] bytes, ``scales`` [G] -> its G*32 values."""
    out = []
    for g in range(blocks.shape[0]):
        scale = 2.0 ** (int(scales[g]) - 127)
        for byte in blocks[g].tolist():
            for code in (byte & 0x0F, byte >> 4):
                out.append((-1.0 if code & 8 else 1.0) * _E2M1[code & 7] * scale)
    return out


def _mxfp4_folder(path, name="gpt_oss", model=None):
    """A tiny gpt-oss folder (``model``, else :func:`tiny` of ``name``) whose experts are stored as MXFP4
    (random codes, scales 2**-7 .. 2**3, and the extremes 2**-127 and 2**0 in the first group), with the
    config's mxfp4 quantization_config."""
    model = tiny(name) if model is None else model
    save_hf_dir(path, model)
    sd = dict(model.state_dict())
    g = torch.Generator().manual_seed(0)
    packed = {}
    for k in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, n_in, n_out = sd.pop(k).shape  # stored [E, in, out]; the blocks are [E, out, in / 32, 16]
        blocks = torch.randint(0, 256, (E, n_out, n_in // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(120, 131, (E, n_out, n_in // 32), dtype=torch.uint8, generator=g)
        scales[0, 0, 0], scales[0, 1, 0] = 0, 127
        sd[f"{k}_blocks"], sd[f"{k}_scales"] = blocks, scales
        packed[k] = (blocks, scales)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    keep = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": keep}
    (path / "config.json").write_text(json.dumps(cfg))
    return packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_experts_load_exactly(tmp_path, dtype):
    packed = _mxfp4_folder(tmp_path / "f")
    model, _ = load_model(str(tmp_path / "f"), dtype=dtype)
    assert type(model).__name__ == "GptOssForCausalLM"
    sd = model.state_dict()
    for k, (blocks, scales) in packed.items():
        w = sd[k]
        assert w.dtype == dtype and w.shape == (blocks.shape[0], blocks.shape[2] * 32, blocks.shape[1])
        for e in range(blocks.shape[0]):
            for o in range(blocks.shape[1]):
                want = torch.tensor(_decode_row(blocks[e, o], scales[e, o]), dtype=torch.float64)
                assert torch.equal(w[e, :, o].double(), want), (k, e, o)
    assert not getattr(model.config, "quantization_config", None)  # a float model now
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(3, 128, (1, 8))).logits).all()


def test_mxfp4_blocks_without_scales_refused_in_one_line(tmp_path):
    from safetensors.torch import load_file

    _mxfp4_folder(tmp_path / "f")
    file = str(tmp_path / "f" / "model.safetensors")
    save_file({k: v for k, v in load_file(file).items() if not k.endswith("_scales")}, file)
    ckpt = Checkpoint(tmp_path / "f")
    model = ckpt.empty_model(torch.float32)
    from bitmosaic.modules.experts import unfuse_experts

    unfuse_experts(model)
    layer = model.model.layers[0]
    with pytest.raises(ModelSpecError, match="stores its experts fused.*_blocks.*without --stream") as e:
        ckpt.fill(layer, "model.layers.0.", torch.float32)
    assert "\n" not in str(e.value)
