"""A converted copy of each GGUF model, so that loading it again takes a second, not twenty.

transformers reads a GGUF file three times (config, tokenizer, weights), rebuilds its tensor-name maps
and dequantizes every tensor: on SmolLM2-135M that is 14-21 s per load on 2 cores, paid by every
``bitmosaic`` command and every process of ``compare``.  The first load of a GGUF file stores what
transformers made of it as a Hugging Face folder -- ``config.json``, the tokenizer files and the
dequantized weights in float32 safetensors, the exact values the GGUF path produces -- under
``<cache root>/gguf/<key>/`` (``$BITMOSAIC_CACHE``, else ``~/.cache/bitmosaic``); later loads read
that folder and cast to the requested dtype exactly as the GGUF path does.

The key is the file's resolved path, size and modification time and the transformers version (whose
converter decides the values).  Files over ``$BITMOSAIC_GGUF_CACHE_MAX_GB`` (default 1 GB: a float32
copy of about 2B parameters) are not copied; ``BITMOSAIC_GGUF_CACHE=0`` turns the copy off.  A copy
that fails to load is deleted with one warning and made again.

Streaming quantization (:func:`bitmosaic.io.sources.opener.open_checkpoint`) reads a copy that exists
already, and otherwise reads the GGUF file tensor by tensor (:mod:`bitmosaic.io.sources.gguf_checkpoint`)
without making one, so it has no size limit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from ...paths import default_cache_root

__all__ = ["gguf_copy", "existing_copy", "drop_copy"]

_FORMAT = 1  # bump when what a copy holds changes
_DONE = "bitmosaic-gguf-copy.json"


def _max_bytes() -> float:
    raw = os.environ.get("BITMOSAIC_GGUF_CACHE_MAX_GB", "1")
    try:
        return float(raw) * 2**30
    except ValueError:
        raise ValueError(f"BITMOSAIC_GGUF_CACHE_MAX_GB={raw!r} is not a number of GB; set e.g. 4") from None


def _key(path: Path) -> tuple[str, dict]:
    import transformers

    st = path.stat()
    info = {
        "source": str(path.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "transformers": transformers.__version__,
        "format": _FORMAT,
    }
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:24], info


def _enabled(path: Path) -> bool:
    if os.environ.get("BITMOSAIC_GGUF_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return path.stat().st_size <= _max_bytes()


def existing_copy(path: Path) -> Path | None:
    """The folder of the converted copy of GGUF ``path`` if one is made already and copies are on."""
    path = Path(path)
    if not _enabled(path):
        return None
    folder = default_cache_root() / "gguf" / _key(path)[0]
    return folder if (folder / _DONE).is_file() else None


def gguf_copy(path: Path, load_fn) -> Path | None:
    """The folder of the converted copy of GGUF ``path`` (made now when missing), or ``None`` when
    copies are off or the file is too large.  ``load_fn(src, kwargs)`` loads ``(model, tokenizer)``
    in float32 from transformers arguments; it is called only to make the copy."""
    path = Path(path)
    if not _enabled(path):
        return None
    key, info = _key(path)
    folder = default_cache_root() / "gguf" / key
    if (folder / _DONE).is_file():
        return folder
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=folder.parent))
    except OSError:  # read-only or full cache: load from the GGUF file itself
        return None
    try:
        model, tok = load_fn(str(path.parent), {"gguf_file": path.name})
        # transformers marks a GGUF-loaded model as "quantized with gguf" and refuses to save it; its
        # weights are already dequantized floats, so drop the marker (this model is thrown away)
        model.hf_quantizer = None
        if "quantization_config" in model.config.__dict__:
            delattr(model.config, "quantization_config")
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / _DONE).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        if folder.exists():  # a damaged or concurrent copy: replace it
            shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        msg = f"could not store a converted copy of {path} ({e}); loading from the GGUF file"
        warnings.warn(msg, stacklevel=2)
        return None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def drop_copy(folder: Path, path: Path, why: str) -> None:
    """Delete a copy that failed to load, with one warning."""
    msg = f"the converted copy of {path} in {folder} is damaged ({why}); converting again"
    warnings.warn(msg, stacklevel=2)
    shutil.rmtree(folder, ignore_errors=True)
