"""One entry point: ``quantize_(model, method, calib, **options)`` (torchao-style)."""

from __future__ import annotations

import torch
from torch import nn

from .errors import OptionError
from .pipeline.pipeline import RunReport, quantize_model
from .pipeline.recipe import method_config

__all__ = ["quantize_"]


def quantize_(
    model: nn.Module,
    method: str,
    calib: torch.Tensor,
    *,
    batch_size: int = 4,
    hessian_dtype: torch.dtype = torch.float32,
    progress: bool = True,
    cache_outputs: bool | None = None,
    analyze_orders: tuple[str, ...] | None = None,
    scheme: str | None = None,
    seed: int = 0,
    device: str | torch.device | None = None,
    offload_inputs: bool | None = None,
    measure_errors: bool = False,
    salience: dict[str, torch.Tensor] | None = None,
    salience_tokens: torch.Tensor | None = None,
    calib_cache=None,
    **options,
) -> RunReport:
    """Quantize ``model`` in place with the registered ``method`` and return the run report.

    ``calib`` is a ``[n, seqlen]`` LongTensor of token ids (see :func:`bitmosaic.data.calibration_samples`);
    ``options`` are the method's config fields, e.g. ``bits=4, group_size=128, order="act"``;
    ``scheme="W4A8"`` (or ``W8A8``, ``W4A4``, ``W4A8-FP8``, ...) sets ``bits`` and ``act`` at once
    (see :func:`bitmosaic.formats.act.parse_scheme`).  ``device`` is where calibration and the
    solvers run (``"auto"``: CUDA when available; the model stays in host memory and each decoder
    layer visits the device in turn); ``offload_inputs`` keeps the calibration activations in host
    memory; ``measure_errors`` calibrates even Hessian-free methods (RTN, FP8) for the report's
    error metrics.  ``salience`` / ``salience_tokens`` (methods with a global allocation: ``sfmp``): a
    precomputed Fisher diagonal per decoder linear (qualified name -> ``[out, in]``), or the tokens
    to estimate it from instead of ``calib`` (e.g. more samples).  ``calib_cache`` (a
    :class:`~bitmosaic.pipeline.calib_cache.CalibCache`) shares the float-model statistics between
    runs.  See :func:`bitmosaic.pipeline.pipeline.quantize_model`.
    """
    spec, config = method_config(method, options, scheme)
    if spec.allocate is None and (salience is not None or salience_tokens is not None):
        raise OptionError(
            f"salience/salience_tokens feed a global bit allocation, which method {spec.name!r} does not "
            "make; drop them (they apply to sfmp)"
        )
    return quantize_model(
        model,
        calib,
        spec,
        config,
        batch_size=batch_size,
        hessian_dtype=hessian_dtype,
        progress=progress,
        cache_outputs=cache_outputs,
        analyze_orders=analyze_orders,
        seed=seed,
        device=device,
        offload_inputs=offload_inputs,
        measure_errors=measure_errors,
        salience=salience,
        salience_tokens=salience_tokens,
        calib_cache=calib_cache,
    )
