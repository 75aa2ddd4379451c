"""Save and load quantized models: safetensors shards + ``config.json`` with a versioned
``quantization_config``.

``quantization_config`` = ``{"quant_method": "bitmosaic", "format_version": 1, "method": ...,
"bits": ..., "group_size": ..., "symmetric": ..., "order": ..., "config": {method options},
"modules": {qualified name: per-layer settings (bits, group, storage width, g_idx, ...)}}``.
``modules`` is the per-layer override table: every quantized linear is listed with its own
settings, so mixed-precision models load the same way.

Writing goes to a temporary sibling directory that is renamed into place only when complete, so
an interrupted save never leaves a partial model under the requested name.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .qmodules import full_layer_config, module_from_layer_config

__all__ = ["FORMAT_VERSION", "save_quantized", "load_quantized", "quantized_modules", "atomic_write_text"]

FORMAT_VERSION = 1
SHARD_BYTES = 2 * 1024**3


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if hasattr(m, "layer_config") and hasattr(m, "kind")}


def _state_dict_for_save(model: nn.Module) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    tied = getattr(model.config, "tie_word_embeddings", False)
    out = {}
    seen_ptrs = {}
    for k, v in sd.items():
        if tied and k == "lm_head.weight":
            continue
        ptr = (v.data_ptr(), v.numel(), v.dtype) if v.numel() else None
        if ptr is not None and ptr in seen_ptrs:  # shared tensor: keep one copy
            v = v.clone()
        seen_ptrs.setdefault(ptr, k)
        out[k] = v.detach().contiguous().cpu()
    return out


def save_quantized(model: nn.Module, out_dir: str | os.PathLike, quant_info: dict, tokenizer=None) -> Path:
    """Save ``model`` (with QuantLinear modules) to ``out_dir`` atomically; returns the path."""
    out_dir = Path(out_dir).expanduser().resolve()
    qmods = quantized_modules(model)
    if not qmods:
        raise ValueError("model has no quantized layers; run quantization before saving")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        if not (out_dir / "config.json").is_file():
            raise FileExistsError(f"{out_dir} exists and is not a model folder; choose another --out")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        qc = {"quant_method": "bitmosaic", "format_version": FORMAT_VERSION, **quant_info}
        qc["modules"] = {n: full_layer_config(m) for n, m in qmods.items()}
        cfg["quantization_config"] = qc
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        sd = _state_dict_for_save(model)
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for k, v in sd.items():
            nbytes = v.numel() * v.element_size()
            if size and size + nbytes > SHARD_BYTES:
                shards.append({})
                size = 0
            shards[-1][k] = v
            size += nbytes
        meta = {"format": "pt", "bitmosaic_format_version": str(FORMAT_VERSION)}
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata=meta)
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata=meta)
                weight_map.update({k: name for k in shard})
            index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())}}
            index["weight_map"] = weight_map
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    single = path / "model.safetensors"
    if single.is_file():
        return load_file(str(single))
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    sd = {}
    for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        sd.update(load_file(str(path / name)))
    return sd


def load_quantized(path: str | os.PathLike, load_tokenizer: bool = True):
    """Load a bitmosaic model folder -> ``(transformers model, tokenizer or None)``."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    qc = raw.get("quantization_config") or {}
    if qc.get("quant_method") != "bitmosaic":
        raise ValueError(f"{path} is not a bitmosaic model (quantization_config.quant_method missing)")
    if int(qc.get("format_version", 0)) > FORMAT_VERSION:
        raise ValueError(
            f"{path} uses bitmosaic format v{qc['format_version']}, newer than this version "
            f"(v{FORMAT_VERSION}); upgrade bitmosaic"
        )
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    for name, lc in qc["modules"].items():
        model.set_submodule(name, module_from_layer_config(lc))
    sd = _read_state_dict(path)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{path}: state dict mismatch; missing={missing[:5]} unexpected={unexpected[:5]}")
    if tied:
        model.tie_weights()
    model.quantization_info = qc
    model.eval()
    tok = AutoTokenizer.from_pretrained(path) if load_tokenizer else None
    return model, tok
