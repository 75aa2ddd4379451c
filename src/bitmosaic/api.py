"""One entry point: ``quantize_(model, method, calib, **options)`` (torchao-style)."""

from __future__ import annotations

import torch
from torch import nn

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
    error metrics.  Options a method's ``prepare`` step takes (its ``prepare_inputs``; e.g. sfmp's
    ``salience``, a precomputed Fisher diagonal per decoder linear, or ``salience_tokens``, the
    tokens to estimate it from instead of ``calib``) go to that step.  ``calib_cache`` (a
    :class:`~bitmosaic.pipeline.calib_cache.CalibCache`) shares the float-model statistics between
    runs.  See :func:`bitmosaic.pipeline.pipeline.quantize_model`.
    """
    from .methods import get_method, list_methods

    takes = {i for m in list_methods() for i in get_method(m).prepare_inputs}
    inputs = {k: options.pop(k) for k in list(options) if k in takes}  # checked by the pipeline
    spec, config = method_config(method, options, scheme)
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
        method_inputs=inputs,
        calib_cache=calib_cache,
    )
