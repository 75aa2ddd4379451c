"""Devices and dtypes: ``resolve_device`` / ``resolve_dtype``, ``load_model(dtype=...)`` and
``perplexity(device=...)`` (issue #9, task 6).  Runs without a GPU: CUDA availability is monkeypatched."""

from __future__ import annotations

import json

import pytest
import torch

from bitmosaic.errors import BitmosaicError, CorruptModelError, DeviceError
from bitmosaic.io import load_model, load_quantized
from bitmosaic.io.loading import checkpoint_dtype, resolve_device, resolve_dtype, resolve_model_spec

from .test_io_helpers import quantized_dir, save_hf_dir, tiny_llama


def _cuda(monkeypatch, available: bool, count: int = 1):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count if available else 0)


def test_resolve_device_auto(monkeypatch):
    _cuda(monkeypatch, False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(None) == torch.device("cpu")
    _cuda(monkeypatch, True)
    assert resolve_device("auto") == torch.device("cuda")


def test_resolve_device_explicit(monkeypatch):
    _cuda(monkeypatch, True, count=2)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(DeviceError, match="cuda:2.*2 CUDA device"):
        resolve_device("cuda:2")


def test_resolve_device_cuda_unavailable_is_clear(monkeypatch):
    _cuda(monkeypatch, False)
    with pytest.raises(DeviceError) as ei:
        resolve_device("cuda")
    msg = str(ei.value)
    assert "CUDA is not available" in msg and "--device cpu" in msg and "\n" not in msg
    assert isinstance(ei.value, BitmosaicError)


def test_resolve_device_bad_name():
    with pytest.raises(DeviceError, match="auto, cpu, cuda"):
        resolve_device("tpu")


def test_resolve_dtype_names():
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) is torch.float32
    assert resolve_dtype("bfloat16", cpu) is torch.bfloat16
    assert resolve_dtype("float16", cpu) is torch.float16
    assert resolve_dtype(torch.float16, cpu) is torch.float16
    with pytest.raises(DeviceError, match="float32, bfloat16, float16"):
        resolve_dtype("int8", cpu)


def test_resolve_dtype_auto(tmp_path):
    m = tiny_llama().to(torch.bfloat16)
    src = save_hf_dir(tmp_path / "bf16", model=m)
    assert checkpoint_dtype(str(src)) is torch.bfloat16
    # auto: float32 on CPU runs; the checkpoint's dtype on CUDA runs
    assert resolve_dtype("auto", torch.device("cpu"), str(src)) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda"), str(src)) is torch.bfloat16
    assert resolve_dtype(None, torch.device("cuda"), None) is torch.float32  # unknown -> float32
    f32 = save_hf_dir(tmp_path / "f32")
    assert resolve_dtype("auto", torch.device("cuda"), str(f32)) is torch.float32


def test_load_model_dtype(tmp_path):
    src = save_hf_dir(tmp_path / "m")
    model, _ = load_model(str(src), dtype="bfloat16")
    assert model.model.embed_tokens.weight.dtype is torch.bfloat16
    model, _ = load_model(str(src), dtype=torch.float16)
    assert model.model.layers[0].mlp.up_proj.weight.dtype is torch.float16


def test_load_quantized_dtype_casts_only_unquantized(tmp_path):
    out = quantized_dir(tmp_path / "q")
    model, _ = load_model(str(out), dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype is torch.bfloat16
    q = model.model.layers[0].self_attn.q_proj
    assert q.scales.dtype is torch.float16  # stored format kept
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        logits = model(ids).logits
    assert logits.dtype is torch.bfloat16 and torch.isfinite(logits).all()
    ref, _ = load_quantized(out, load_tokenizer=False)
    assert ref.model.embed_tokens.weight.dtype is torch.float32


def test_model_spec_with_broken_config(tmp_path):
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text("{nope")
    with pytest.raises(CorruptModelError, match="config.json"):
        resolve_model_spec(str(d))
    (d / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(CorruptModelError, match="config.json"):
        resolve_model_spec(str(d))
