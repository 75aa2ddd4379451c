"""Provenance of a quantized model: what produced it, recorded in its ``quantization_config``.

``provenance = {"versions": {...}, "model": SPEC, "calibration": {...}, "pipeline": {...}}``:

- ``versions``: bitmosaic, Python, torch, transformers and the other libraries the numbers depend on;
- ``calibration``: the data's fingerprint -- ``source``, ``seed``, ``nsamples``, ``seqlen``, ``bos``,
  a SHA-256 per sample of its token ids (int64, little-endian) and one over all of them;
- ``pipeline``: the options that change the numbers (device, dtype, threads, batch size,
  Hessian dtype).

:func:`bitmosaic.quantize_` attaches ``{"report", "recipe", "provenance"}`` to the model
(``model.bitmosaic_run``); :func:`saved_run_info` is what :func:`~bitmosaic.io.save_quantized` writes
of it.  With the ``recipe`` saved beside it, ``bitmosaic reproduce DIR`` reruns the quantization and
compares every tensor (``cli/reproduce.py``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform

import torch

__all__ = [
    "library_versions", "calibration_fingerprint", "compare_fingerprints", "run_provenance", "saved_run_info",
]  # fmt: skip

_LIBRARIES = ("torch", "transformers", "safetensors", "accelerate", "numpy", "tokenizers", "gguf")


def library_versions() -> dict[str, str | None]:
    """bitmosaic's, Python's and the key dependencies' versions (``None``: not installed)."""
    from ..._version import __version__

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


def run_provenance(calib: torch.Tensor, *, source: str | None, bos: bool, model: str | None, device, dtype,
                   settings) -> dict:  # fmt: skip
    """The provenance of one quantization run (module doc); ``source`` ``None``: token ids given
    directly (recorded as ``"tensor"``: the fingerprint, but nothing to draw them from again).
    ``settings``: the run's :class:`~bitmosaic.pipeline.settings.RunSettings`, whose fields marked for
    the record (:meth:`~bitmosaic.pipeline.settings.RunSettings.record`) join the ``pipeline`` block."""
    return {
        "versions": library_versions(),
        "model": model,
        "calibration": calibration_fingerprint(calib, source=source or "tensor", seed=settings.seed, bos=bos),
        "pipeline": {
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            **settings.record(),
        },
    }


def saved_run_info(run: dict) -> dict:
    """The ``quantization_config`` entries of a run attached by :func:`bitmosaic.quantize_`: the
    default entry's method and settings, the recipe, the provenance and what the method adds
    (``Method.saved_info``)."""
    recipe, report, prov = run["recipe"], run["report"], run["provenance"]
    spec, config = recipe.default()
    info = {
        "method": spec.name,
        "bits": config.bits,
        "group_size": config.group_size,
        "symmetric": config.sym,
        "order": getattr(config, "order", None),
        "scheme": config.scheme,
        "config": config.to_dict(),
        "source_model": prov.get("model"),
        "recipe": recipe.to_dict(),
        "provenance": prov,
    }
    info.update(spec.saved_info(report))  # what the method planned (save adds what the modules hold)
    return info
