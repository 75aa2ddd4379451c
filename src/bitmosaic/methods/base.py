"""The shape of every method: a config (its options) and a :class:`Method` with lifecycle hooks.

Learned from llm-compressor's modifiers (``on_initialize``/``on_start``/``on_finalize``, run state
kept apart from the recipe) and torchao's config-keyed handlers.  The calibration pipeline
(:mod:`bitmosaic.pipeline`) calls the hooks in this order and names no method:

1. ``prepare(model, config, ctx) -> state``: once, on the float model, before any layer is
   calibrated (global work: SFMP's Fisher salience and bit allocation).  The returned ``state`` is
   the run's state; it is handed to every later hook and never written into the config.
2. ``transform(caps, config, state)``: once per decoder layer, on statistics of the float layer's
   group inputs, returning per-channel factors the pipeline folds into the preceding ops
   (SmoothQuant, AWQ, MosaicQuant's smoothing; later: rotations).
3. ``quantize(weight, stats, config, state, name)``: one linear (or several stacked row-wise when
   ``row_separable``) -> a :class:`~bitmosaic.algorithms.types.QuantResult`.
4. ``pack(result, config, bias)``: the result as a quantized module (default: the packed
   :class:`~bitmosaic.modules.qlinear.QuantLinear`).
5. ``finalize(model, config, state, ctx)``: once, after the last layer (SFMP folds permutations).

``saved_info(report)`` adds to what a saved model records; ``summary_lines(report)`` to what the CLI
prints.  Hooks report through ``ctx.record(key, value)`` (into ``report.calibration``).  What a
method needs from the model (decoder layers, groups, fold targets; the Fisher salience service)
comes in the :class:`MethodContext`, so no method imports the pipeline or the model maps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from ..algorithms.observers import ActObserver
from ..algorithms.types import QuantResult
from ..errors import OptionError
from ..formats.act import ActQuantSpec
from .options import ConfigMeta, check_range, option, rename_old_keys

__all__ = ["LayerStats", "Method", "MethodContext", "WeightQuantConfig"]


@dataclass
class LayerStats:
    """Calibration statistics of one linear layer's input."""

    hessian: torch.Tensor | None = None  # 2/n X^T X (undamped), [in, in]
    act: ActObserver | None = None  # per-channel input statistics (max, mean |x|, mean)
    # the caller reads ``hessian`` no more: a method with ``may_overwrite_hessian`` may use its memory
    hessian_disposable: bool = False
    # the per-channel factors ``s`` a transform folded into this input (it now sees ``X / s``), or None
    input_scales: torch.Tensor | None = None


_SCHEME_SUFFIX = {"int": "", "e4m3": "-FP8", "e4m3-240": "-FP8-240", "e5m2": "-E5M2", "e2m1": "-FP4"}


@dataclass
class WeightQuantConfig(metaclass=ConfigMeta):
    """Settings shared by every weight quantizer (each field declared with :func:`~.options.option`;
    a subclass lists the inherited ones it does not use in ``unused``)."""

    unused: ClassVar[dict[str, str]] = {}
    # another method's option (its keyword) this one refuses, and why (with the fix)
    refuses: ClassVar[dict[str, str]] = {}

    bits: int = option(4, help="weight bits", range=(1, 8), aliases=("--wbits",))
    group_size: int | None = option(
        128, help="weights per scale along the input; -1 = per-channel", type=int
    )
    sym: bool = option(
        False, help="symmetric integer grid (--asym: asymmetric)", negative="--asym", old_names=("symmetric",)
    )
    scale: str = option(
        "minmax", help="group scale search: min-max or MSE-optimal", choices=("minmax", "mse"),
        old_names=("scale_method",),
    )  # fmt: skip
    clip: bool = option(True, help="clip codes to the grid (--no-clip: unbounded integers, lattice analysis)")
    act: ActQuantSpec | None = option(
        None, help="activation quantizer at each linear's input (--scheme --abits --afmt --a-*; none = A16)",
        flag="--abits", shared=True,
    )  # fmt: skip

    # the old names, read-only (code outside the methods still reads them)
    @property
    def symmetric(self) -> bool:
        return self.sym

    @property
    def scale_method(self) -> str:
        return self.scale

    @property
    def percdamp(self) -> float:
        """The Hessian damping the generic pipeline passes to its solves and reports: the method's
        ``--damp`` where its config has one (every Hessian method's), else GPTQ's 0.01."""
        return getattr(self, "damp", 0.01)

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


@dataclass
class MethodContext:
    """What the pipeline hands a method's model-level hooks (``prepare``/``finalize``).

    ``arch``: the model's architecture map (``layers(model)``, ``layers_path``, ``sequential``
    groups, ``smooth_prev``); ``names``: the qualified decoder linears this (method, config) was
    resolved for; ``calib``: the calibration tokens; ``inputs``: the extra inputs the caller gave
    for this method (its ``prepare_inputs``); ``fisher(names, tokens, cache)``: the pipeline's
    Fisher-salience service (``({name: [out, in]}, info)``); ``record(key, value)`` puts a fact in
    the run report (``report.calibration[key]``)."""

    arch: Any
    names: list[str]
    calib: torch.Tensor
    progress: bool = True
    inputs: dict = field(default_factory=dict)
    fisher: Callable | None = None
    entry: tuple | None = None  # the (method, config) this context belongs to
    _record: dict = field(default_factory=dict, repr=False)

    def record(self, key: str, value) -> None:
        self._record[key] = value


class Method:
    """One quantization method: class attributes say what it is, the hooks what it does.

    Subclasses set ``name``, ``config_cls`` and ``description`` and implement :meth:`quantize`;
    every other hook does nothing by default.  ``needs_hessian``: the pipeline calibrates for it;
    ``row_separable``: every output row is quantized independently given the Hessian (GPTQ,
    Babai, RTN), so linears sharing one Hessian are stacked into one call; ``may_overwrite_hessian``:
    :meth:`quantize` factorises a ``LayerStats.hessian_disposable`` Hessian in its own memory (and
    raises :class:`~bitmosaic.algorithms.hessian.HessianSpentError` when it would need it again);
    its results carry ``step_errors`` and ``hessian_diag``, so the report needs no more of it;
    ``prepare_inputs``:
    keyword inputs ``quantize_`` passes through to ``prepare`` (``ctx.inputs``); ``grid_fallback``: this
    is the statistics-free method other configs' grids fall back to (:func:`~.registry.grid_fallback`)."""

    name: ClassVar[str] = ""
    config_cls: ClassVar[type] = WeightQuantConfig
    description: ClassVar[str] = ""
    needs_hessian: ClassVar[bool] = True
    row_separable: ClassVar[bool] = False
    may_overwrite_hessian: ClassVar[bool] = False
    prepare_inputs: ClassVar[tuple[str, ...]] = ()
    # the method :func:`~.registry.grid_fallback` quantizes a linear with on another config's grid (one)
    grid_fallback: ClassVar[bool] = False

    # -- what the pipeline asks --------------------------------------------------------------------
    @property
    def has_prepare(self) -> bool:
        return type(self).prepare is not Method.prepare

    def packs_plain(self, config) -> bool:
        """Whether ``config``'s results are packed as the plain integer grid of its bits/group size/symmetry
        (:meth:`pack` not overridden; a method that overrides it for some options only says so here)."""
        return type(self).pack is Method.pack

    def needs_prepare(self, config) -> bool:
        """Whether a run with ``config`` calls :meth:`prepare` (default: whenever the method has one; a
        method whose prepare serves one option only says so here, so its other runs can stream)."""
        return self.has_prepare

    @property
    def has_transform(self) -> bool:
        return type(self).transform is not Method.transform

    @property
    def has_finalize(self) -> bool:
        return type(self).finalize is not Method.finalize

    def make_config(self, **kwargs) -> WeightQuantConfig:
        kwargs = rename_old_keys(self.config_cls, kwargs, f"method {self.name!r}: ")
        names = {f.name for f in dataclasses.fields(self.config_cls)}
        unknown = sorted(k for k in kwargs if k not in names)
        if unknown:
            raise OptionError(
                f"method {self.name!r} has no option(s) {unknown}; its options are {sorted(names)}"
            )
        for k, v in kwargs.items():
            check_range(self.config_cls, k, v)
        return self.config_cls(**kwargs)

    # -- the hooks -----------------------------------------------------------------------------------
    def prepare(self, model: nn.Module, config, ctx: MethodContext) -> Any:
        """Global work on the float model before calibration; returns the run state."""
        return None

    def transform(self, caps, config, state) -> list[tuple[torch.Tensor | None, dict]]:
        """Per group capture: ``(factors to fold or None, report info)``."""
        raise NotImplementedError

    def quantize(self, weight: torch.Tensor, stats: LayerStats, config, state=None, name=None) -> QuantResult:
        """One weight ``[out, in]`` (``name``: its qualified name; ``None`` for stacked linears)."""
        raise NotImplementedError(f"method {self.name!r} must implement quantize()")

    def pack(self, result: QuantResult, config, bias: torch.Tensor | None) -> nn.Module:
        from ..modules.qlinear import QuantLinear

        if hasattr(result, "to_tensor"):  # a microscaling result (algorithms/mx.py): the ``mx`` kind
            from ..modules import mx

            return mx.from_result(result, bias)

        return QuantLinear.from_result(
            result, bits=config.bits, group_size=config.group_size, symmetric=config.sym, bias=bias,
            clip=getattr(config, "clip", None),
        )  # fmt: skip

    def finalize(self, model: nn.Module, config, state, ctx: MethodContext) -> None:
        """Model-level work after every layer is packed."""

    def saved_info(self, report) -> dict:
        """Extra ``quantization_config`` fields a saved model of this run records."""
        return {}

    def summary_lines(self, report) -> list[str]:
        """Extra lines the CLI prints after a run."""
        return []

    def __repr__(self) -> str:
        return f"<method {self.name}>"
