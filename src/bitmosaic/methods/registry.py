"""One registry of quantization methods, by name (torchao-style config + function).

A method is a typed config dataclass plus a function ``fn(weight, stats, config) -> QuantResult``
that turns one linear layer's weight and its calibration statistics into integer codes and
scales; the pipeline packs the result into a :class:`~bitmosaic.modules.qlinear.QuantLinear`.

Two optional hooks: ``pack`` (result -> module, for formats beyond the plain packed layout) and
``transform`` (``fn(captures, config) -> per-group info``), which runs once per decoder layer
*before* its linears are quantized, on statistics of the float layer's inputs, and returns the
per-channel factors to fold into the preceding ops (SmoothQuant, AWQ; see
:mod:`bitmosaic.pipeline.smoothing`); and ``allocate`` (``fn(saliences, config) -> summary``), run
once on the float model before calibration with the Fisher diagonal of every decoder linear
(SFMP's global bit allocation; see :mod:`bitmosaic.pipeline.fisher`).

Every config carries ``act``: the activation quantizer applied at the input of each quantized
linear (``None`` = 16-bit activations), so every weight method composes with every activation
format.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..algorithms.observers import ActObserver
from ..algorithms.types import QuantResult
from ..formats.act import ActQuantSpec

__all__ = ["LayerStats", "WeightQuantConfig", "MethodSpec", "register_method", "get_method", "list_methods"]


@dataclass
class LayerStats:
    """Calibration statistics of one linear layer's input."""

    hessian: torch.Tensor | None = None  # 2/n X^T X (undamped), [in, in]
    act: ActObserver | None = None  # per-channel input statistics (max, mean |x|, mean)
    name: str | None = None  # qualified name of the linear (methods with a model-wide plan: sfmp)


_SCHEME_SUFFIX = {"int": "", "e4m3": "-FP8", "e4m3-240": "-FP8-240", "e5m2": "-E5M2", "e2m1": "-FP4"}


@dataclass
class WeightQuantConfig:
    """Settings shared by every weight quantizer."""

    bits: int = 4
    group_size: int | None = 128  # None = per-channel
    symmetric: bool = False
    scale_method: str = "minmax"  # "minmax" | "mse"
    clip: bool = True
    act: ActQuantSpec | None = None  # activation quantizer at each linear's input (None = A16)

    def __post_init__(self) -> None:
        if isinstance(self.act, dict):
            self.act = ActQuantSpec(**self.act)
        if self.act is not None and not isinstance(self.act, ActQuantSpec):
            raise TypeError(f"act must be an ActQuantSpec, a dict or None, got {type(self.act).__name__}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def scheme(self) -> str:
        """``W4A16``-style name (``-FP8``/``-FP4`` suffix for float activations)."""
        if self.act is None:
            return f"W{self.bits}A16"
        suffix = _SCHEME_SUFFIX[self.act.fmt]
        return f"W{self.bits}A{self.act.bits}{suffix}"


@dataclass(frozen=True)
class MethodSpec:
    name: str
    config_cls: type
    fn: Callable[[torch.Tensor, LayerStats, object], QuantResult]
    needs_hessian: bool = True
    description: str = ""
    # True when every output row is quantized independently given the Hessian (GPTQ, Babai, RTN):
    # linears sharing one Hessian (q/k/v, gate/up) are then stacked row-wise and quantized as one
    # matrix, so the factorisation, order and column loop run once per group, not once per linear
    row_separable: bool = False
    # result -> nn.Module packing; None means the standard packed QuantLinear
    pack: Callable[[QuantResult, object, torch.Tensor | None], torch.nn.Module] | None = field(default=None)
    transform: Callable | None = field(default=None)
    # ``fn(saliences {qualified linear name: Fisher diagonal [out, in]}, config) -> summary``: a
    # model-wide plan made once, on the float model, before any layer is calibrated (sfmp)
    allocate: Callable | None = field(default=None)

    def make_config(self, **kwargs) -> WeightQuantConfig:
        names = {f.name for f in dataclasses.fields(self.config_cls)}
        unknown = sorted(k for k in kwargs if k not in names)
        if unknown:
            raise ValueError(
                f"method {self.name!r} has no option(s) {unknown}; its options are {sorted(names)}"
            )
        return self.config_cls(**kwargs)


_REGISTRY: dict[str, MethodSpec] = {}


def register_method(
    name: str,
    config_cls: type,
    *,
    needs_hessian: bool = True,
    description: str = "",
    pack=None,
    transform=None,
    row_separable: bool = False,
    allocate=None,
):
    """Decorator: register ``fn(weight, stats, config) -> QuantResult`` under ``name``."""

    def deco(fn):
        if name in _REGISTRY:
            raise ValueError(f"method {name!r} is already registered")
        _REGISTRY[name] = MethodSpec(
            name, config_cls, fn, needs_hessian, description, row_separable, pack, transform, allocate
        )
        return fn

    return deco


def get_method(name: str) -> MethodSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(_REGISTRY))}") from None


def list_methods() -> list[str]:
    return sorted(_REGISTRY)
