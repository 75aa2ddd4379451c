"""Provenance of a quantized model: what produced it, recorded in its ``quantization_config``.

``provenance = {"versions": {...}, "model": SPEC, "calibration": {...}, "pipeline": {...}}``:

- ``versions``: bitmosaic, Python, torch, transformers and the other libraries the numbers depend on;
- ``calibration``: the data's fingerprint -- ``source``, ``seed``, ``nsamples``, ``seqlen``, ``bos``,
  a SHA-256 per sample of its token ids (int64, little-endian) and one over all of them;
- ``pipeline``: the options that change the numbers (device, dtype, threads, batch size,
  Hessian dtype).

With the ``recipe`` saved beside it, ``bitmosaic reproduce DIR`` reruns the quantization and
compares every tensor (``cli/reproduce.py``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform

import torch

__all__ = ["library_versions", "calibration_fingerprint", "compare_fingerprints"]

_LIBRARIES = ("torch", "transformers", "safetensors", "accelerate", "numpy", "tokenizers", "gguf")


def library_versions() -> dict[str, str | None]:
    """bitmosaic's, Python's and the key dependencies' versions (``None``: not installed)."""
    from .. import __version__

    out: dict[str, str | None] = {"bitmosaic": __version__, "python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    out["torch"] = torch.__version__  # the build string (+cpu / +cu12x) matters for bit-exactness
    return out


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.to(torch.int64).contiguous().numpy().astype("<i8").tobytes()).hexdigest()


def calibration_fingerprint(calib: torch.Tensor, *, source: str, seed: int, bos: bool) -> dict:
    """The fingerprint of the calibration samples ``calib`` (``[nsamples, seqlen]`` token ids)."""
    calib = calib.detach().cpu()
    return {
        "source": source,
        "seed": int(seed),
        "nsamples": int(calib.shape[0]),
        "seqlen": int(calib.shape[1]),
        "bos": bool(bos),
        "sha256": _sha256(calib),
        "sample_sha256": [_sha256(row) for row in calib],
    }


def compare_fingerprints(recorded: dict, now: dict) -> list[str]:
    """Human-readable differences between two calibration fingerprints (empty: the same data)."""
    diffs = [
        f"{k}: recorded {recorded.get(k)!r}, now {now.get(k)!r}"
        for k in ("source", "seed", "nsamples", "seqlen", "bos")
        if recorded.get(k) != now.get(k)
    ]
    a, b = recorded.get("sample_sha256") or [], now.get("sample_sha256") or []
    bad = [i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y]
    if bad:
        diffs.append(f"token hashes differ for {len(bad)} of {len(a)} samples (first: sample {bad[0]})")
    return diffs
