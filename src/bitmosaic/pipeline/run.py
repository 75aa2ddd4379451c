"""The one entry of a quantization run: :func:`run` (``bitmosaic.quantize_``, ``bitmosaic quantize``
and streamed runs all come here).

``run(model, recipe, calibration, settings, store)`` quantizes ``model`` in place as ``recipe`` says
(:func:`~bitmosaic.pipeline.pipeline.quantize_model`), then records what produced it: the report's
calibration entries (source, seed, BOS) and the provenance (library versions, the calibration
tokens' fingerprint, the settings that change the numbers: :mod:`bitmosaic.io.provenance`), attached
as ``model.bitmosaic_run = {"report", "recipe", "provenance"}`` for
:func:`~bitmosaic.io.save_quantized` (and ``bitmosaic reproduce``) to write.  A streamed run passes
its :class:`~bitmosaic.pipeline.stream.LayerStore` as ``store``; everything else is the same.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..io.saved.provenance import run_provenance
from . import pipeline as driver
from .recipe import Recipe
from .report import RunReport
from .settings import Calibration, RunSettings

__all__ = ["run", "source_name"]


def run(
    model: nn.Module, recipe: Recipe, calibration, settings: RunSettings | None = None, store=None,
    inputs: dict | None = None, source_model: str | None = None,
) -> RunReport:  # fmt: skip
    """Quantize ``model`` in place with ``recipe`` on ``calibration`` (token ids or a
    :class:`~bitmosaic.pipeline.settings.Calibration`) and attach the run (module doc); returns the
    report.  ``inputs``: the methods' prepare-step inputs (e.g. a precomputed salience);
    ``source_model``: the model's name for the provenance (default: its ``config._name_or_path``)."""
    settings, calibration = settings or RunSettings(), Calibration.of(calibration)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    report = driver.quantize_model(model, calibration, recipe, None, settings, store=store, inputs=inputs)
    source = calibration.source
    report.calibration.update({"source": source or "tensor", "seed": settings.seed, "bos": calibration.bos})
    spec = source_model or getattr(getattr(model, "config", None), "_name_or_path", None) or None
    prov = run_provenance(calibration.tokens, source=source, bos=calibration.bos, model=spec,
                          device=report.device, dtype=dtype, settings=settings)  # fmt: skip
    model.bitmosaic_run = {"report": report, "recipe": recipe, "provenance": prov}
    return report


def source_name(spec: str) -> str:
    """How the provenance names a model argument: a local path resolved, anything else (a hub id, an
    alias) as given."""
    return str(Path(spec).resolve()) if Path(spec).exists() else spec
