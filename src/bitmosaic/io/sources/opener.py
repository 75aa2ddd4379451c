"""Where a streamed run's tensors come from: :func:`open_checkpoint` turns a model argument (a folder, a
hub id, a GGUF file or an alias) into a :class:`~bitmosaic.io.sources.checkpoint.Checkpoint` and its tokenizer
(a GGUF file: :class:`~bitmosaic.io.sources.gguf_checkpoint.GGUFCheckpoint`, or its converted copy when one
exists).  Kept apart from both checkpoint kinds so that neither imports the other's module."""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import BitmosaicError
from .checkpoint import Checkpoint
from .loading import ModelSpecError, resolve_model_spec

__all__ = ["open_checkpoint"]


def open_checkpoint(spec: str) -> tuple[Checkpoint, object]:
    """``(Checkpoint, tokenizer)`` of a model argument (folder, hub id, GGUF file or alias)."""
    from transformers import AutoTokenizer

    kind, info = resolve_model_spec(spec)
    if kind == "bitmosaic":
        raise ModelSpecError(f"{spec} is already quantized by bitmosaic; give the float model it came from")
    if kind == "gguf":
        return _open_gguf(info["path"], spec)
    if kind == "hf-dir":
        folder = info["path"]
    else:
        from huggingface_hub import snapshot_download

        try:
            patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
            folder = Path(snapshot_download(info["repo_id"], allow_patterns=patterns))
        except Exception as e:  # offline, unknown id, gated: one line
            raise ModelSpecError(f"could not download {spec!r}: {' '.join(str(e).split())[:200]}") from None
    from .float_check import check_float_folder

    check_float_folder(folder)  # as load_model checks it: one line, before any layer is read
    return Checkpoint(folder, spec), _tokenizer(spec, AutoTokenizer.from_pretrained, folder)


def _tokenizer(spec: str, load, *args, **kwargs):
    try:
        return load(*args, **kwargs)
    except KeyError as e:  # a GGUF without tokenizer metadata (transformers: KeyError 'tokens')
        if "gguf_file" in kwargs and e.args == ("tokens",):
            return None
        raise
    except OSError as e:
        why = " ".join(str(e).split())
        raise ModelSpecError(f"could not load the tokenizer of {spec!r}: {why}") from None


def _open_gguf(path: Path, spec: str) -> tuple[Checkpoint, object]:
    """A GGUF file: its converted copy when one exists already (no dequantizing), else the file itself
    tensor by tensor; an architecture that cannot be read so gets a new copy when copies are allowed."""
    from transformers import AutoTokenizer

    from .gguf_cache import existing_copy, gguf_copy
    from .gguf_checkpoint import GGUFCheckpoint, UnsupportedGGUFError, gguf_fingerprint
    from .loading import load_pretrained

    folder = existing_copy(path)
    if folder is None:
        try:
            ckpt = GGUFCheckpoint(path, spec)
        except UnsupportedGGUFError as e:
            try:
                folder = gguf_copy(path, lambda src, kw: load_pretrained(src, kw, spec, torch.float32))
            except BitmosaicError:
                raise
            except Exception:  # transformers cannot convert it either: the one-line refusal
                folder = None
            if folder is None:
                raise e
        else:
            return ckpt, _tokenizer(spec, AutoTokenizer.from_pretrained, path.parent, gguf_file=path.name)
    ckpt = Checkpoint(folder, spec, fingerprint=gguf_fingerprint(path))
    return ckpt, _tokenizer(spec, AutoTokenizer.from_pretrained, folder)
