"""Methods ``sq-weights`` (Algorithm 1) and ``sq-acts`` (Algorithm 2) of the SQ-format paper.

Both smooth first (SmoothQuant, ``alpha = 0.5`` by default; the transform runs before the group's
Hessian is accumulated, so the Hessian comes from the smoothed inputs, Algorithm 1 line 3).

- ``sq-weights``: GPTQ through the SQ mixed grid (:func:`bitmosaic.algorithms.sq.sq_gptq`),
  saved as :class:`~bitmosaic.modules.sq.SQWeightLinear`.  Combines with any activation quantizer
  (``--abits 4/8``: W(SQ)A4, W(SQ)A8).  Banks must stay contiguous, so the order is natural
  (act-order's ``g_idx`` would split banks).
- ``sq-acts``: W4 GPTQ weights exactly as method ``smoothquant`` with ``solver="gptq"`` makes them
  (same config fields, same packed layout), activations in SQ-format at inference
  (:class:`~bitmosaic.modules.sq.SQActLinear`), ``strategy="dynamic"`` or ``"static"``.  The
  weights are calibrated on 16-bit activations, so W4A8, W4A4 and W4A(SQ) built from the same
  calibration differ only in their activations.  The static mask comes from ``Ā_j`` of the
  smoothed calibration inputs and the smoothed float ``W'`` (Algorithm 2, line 6).  Activation
  scales (``act_scale``, both strategies): per token, per token and bank, or per token and
  ``act_scale_group`` channels (independent of the bank); with a static mask, ``act_scale_calib``
  fixes the bank/group scales from the calibration inputs' ``max|x_j|`` (fully static activations).
  The paper does not print the granularity; its Table 2 fits per-bank scales (issue 25).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..algorithms.sq import (
    IMPORTANCE_FORMS,
    MASK_TIMINGS,
    STATIC_IMPORTANCE,
    sq_gptq,
    static_act_scales,
    static_channel_mask,
    static_importance,
)
from ..algorithms.types import QuantResult
from ..errors import OptionError
from ..formats.sq import act_name, parse_sq, weight_name
from ..formats.sq_act import ACT_SCALES
from ..modules.qlinear import QuantLinear
from ..modules.sq import STRATEGIES, SQActLinear, SQWeightLinear
from .common import require_hessian, shared
from .options import like, option
from .registry import LayerStats, Method, register
from .smoothquant import SmoothQuantConfig, quantize_smoothquant, smoothquant_transform

__all__ = ["SQWeightsConfig", "SQActsConfig", "SQActResult"]


def _smooth_transform(caps, cfg):
    if not cfg.smooth:
        return [(None, {"reason": "smoothing off"}) for _ in caps]
    return smoothquant_transform(caps, cfg)


@dataclass
class SQWeightsConfig(SmoothQuantConfig):
    """Algorithm 1.  ``importance``: ``obs`` (SparseGPT's saliency) or ``paper`` (Alg. 1 line 4);
    ``mask_timing``: ``lazy`` (per bank, from the updated weights) or ``upfront`` (the paper)."""

    unused: ClassVar[dict[str, str]] = {
        **dict.fromkeys(
            ("bits", "group_size", "sym", "scale"), "SQ-format sets its own grids and banks (use --sq)"
        ),
        "solver": "its weights are GPTQ through the SQ grid",
    }
    sq: str = option(
        "16-(8/4)-0.75", help="SQ format bank-(high/low)-sparsity, e.g. 16-(8/4)-0.5 or 64-(fp8/fp4)-0.875"
    )
    importance: str = option(
        "obs", help="weight importance: obs (SparseGPT saliency) or paper (Alg. 1 line 4)",
        choices=IMPORTANCE_FORMS, deprecated=("--sq-importance",),
    )  # fmt: skip
    mask_timing: str = option(
        "lazy", help="mask per bank from the updated weights (lazy) or all first (upfront, the paper)",
        choices=MASK_TIMINGS,
    )  # fmt: skip
    smooth: bool = shared("smooth")

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_sq(self.sq)
        if self.importance not in IMPORTANCE_FORMS:
            raise OptionError(f"SQ importance must be one of {IMPORTANCE_FORMS}, got {self.importance!r}")
        if self.mask_timing not in MASK_TIMINGS:
            raise OptionError(f"SQ mask timing must be one of {MASK_TIMINGS}, got {self.mask_timing!r}")
        if self.order != "natural":
            raise OptionError("sq-weights keeps banks contiguous: GPTQ runs in natural order; drop --order")

    @property
    def scheme(self) -> str:
        return weight_name(parse_sq(self.sq), None if self.act is None else self.act.bits)


def _pack_sq_weights(res, cfg, bias):
    return SQWeightLinear.from_result(res, bias)


def quantize_sq_weights(weight, stats: LayerStats, cfg: SQWeightsConfig):
    H = require_hessian(stats, "sq-weights")
    return sq_gptq(
        weight,
        H,
        parse_sq(cfg.sq),
        importance=cfg.importance,
        mask_timing=cfg.mask_timing,
        percdamp=cfg.damp,
        block_size=cfg.block_size,
    )


@dataclass
class SQActResult(QuantResult):
    """A W4 result plus the static channel mask of its activations (``None`` when dynamic) and its
    calibrated ``(low, high)`` activation scales (``None`` unless ``act_scale_calib``)."""

    channel_mask: torch.Tensor | None = field(default=None, kw_only=True)
    act_scales: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, kw_only=True)


@dataclass
class SQActsConfig(SmoothQuantConfig):
    """Algorithm 2.  ``strategy``: dynamic | static; ``act_scale``: token | bank | group (with
    ``act_scale_group`` channels), ``act_scale_calib``: static bank/group scales from calibration;
    ``static_importance``: aw (the paper) | a | abs-aw (ablations)."""

    needs_act_stats: ClassVar[bool] = True
    unused: ClassVar[dict[str, str]] = {"act": "sq-acts quantizes the activations itself (--sq)"}
    solver: str = shared(
        "solver", "gptq", help="the weight quantizer after smoothing: gptq (the W4 baseline's)"
    )
    sq: str = like(SQWeightsConfig, "sq", "16-(8/4)-0.5")
    strategy: str = option(
        "dynamic", help="activation mask: per input (dynamic) or calibrated (static)", choices=STRATEGIES
    )
    act_scale: str = option(
        "token", help="activation scales (one per part) per token, per token and bank, or per token and "
        "--act-scale-group channels", choices=ACT_SCALES, deprecated=("--sq-act-scale",),
    )  # fmt: skip
    act_scale_group: int | None = option(
        None, help="channels per activation scale with --act-scale group (e.g. 128; any width, "
        "independent of the bank)", type=int, range=(1, None),
    )  # fmt: skip
    act_scale_calib: bool = option(
        False, help="static masks: bank/group activation scales calibrated once (max |x| of each part's "
        "channels on the calibration data) and shared by all tokens, instead of computed per token",
    )  # fmt: skip
    static_importance: str = option(
        "aw", help="static mask score: aw (the paper), a, abs-aw (ablations)", choices=STATIC_IMPORTANCE
    )
    smooth: bool = shared("smooth")

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_sq(self.sq)
        if self.act is not None:
            raise OptionError("sq-acts quantizes the activations itself (--sq); drop --abits/--scheme")
        if self.solver != "gptq":
            raise OptionError("sq-acts uses GPTQ weights (the W4 baseline's); drop --solver rtn")
        if self.strategy not in STRATEGIES:
            raise OptionError(f"--strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.act_scale not in ACT_SCALES:
            raise OptionError(f"--act-scale must be one of {', '.join(ACT_SCALES)}, got {self.act_scale!r}")
        if self.act_scale == "group" and self.act_scale_group is None:
            raise OptionError("--act-scale group needs a width: add --act-scale-group G (e.g. 128)")
        if self.act_scale != "group" and self.act_scale_group is not None:
            raise OptionError(
                f"--act-scale-group applies to --act-scale group (got --act-scale {self.act_scale}); "
                "drop it or add --act-scale group"
            )
        if self.act_scale_group is not None and (
            isinstance(self.act_scale_group, bool) or not isinstance(self.act_scale_group, int)
            or self.act_scale_group < 1
        ):
            raise OptionError(f"--act-scale-group must be a positive integer, got {self.act_scale_group!r}")
        if self.act_scale_calib and (self.strategy != "static" or self.act_scale == "token"):
            raise OptionError(
                "--act-scale-calib needs a static mask and per-bank or per-group scales: add "
                "--strategy static --act-scale bank (or group)"
            )
        if self.static_importance not in STATIC_IMPORTANCE:
            raise OptionError(
                f"static importance must be one of {STATIC_IMPORTANCE}, got {self.static_importance!r}"
            )

    @property
    def scheme(self) -> str:
        return act_name(self.bits, parse_sq(self.sq))


def _pack_sq_acts(res: SQActResult, cfg: SQActsConfig, bias):
    dense = QuantLinear.from_result(
        res, bits=cfg.bits, group_size=cfg.group_size, symmetric=cfg.sym, bias=bias
    )
    return SQActLinear.from_packed(
        dense, cfg.sq, cfg.strategy, cfg.act_scale, res.channel_mask, cfg.act_scale_group, res.act_scales
    )


def quantize_sq_acts(weight, stats: LayerStats, cfg: SQActsConfig) -> SQActResult:
    res = quantize_smoothquant(weight, stats, cfg)
    mask = None
    if cfg.strategy == "static":
        if stats.act is None:
            raise ValueError(
                "static sq-acts needs calibration activation statistics; run it through the pipeline"
            )
        imp = static_importance(
            weight, stats.act.channel_mean, stats.act.channel_absmean, cfg.static_importance
        )
        mask = static_channel_mask(imp.to(weight.device), parse_sq(cfg.sq))
    scales = None
    if cfg.act_scale_calib:
        absmax = stats.act.channel_absmax.to(weight.device)
        scales = static_act_scales(absmax, mask, parse_sq(cfg.sq), cfg.act_scale, cfg.act_scale_group)
    fields = {k: getattr(res, k) for k in res.__dataclass_fields__}
    return SQActResult(**fields, channel_mask=mask, act_scales=scales)


@register
class SQWeights(Method):
    name, config_cls = "sq-weights", SQWeightsConfig
    description = "SQ-format on weights (Algorithm 1): smoothing + GPTQ through the high/low bank grid"
    row_separable = True

    def quantize(self, weight, stats, cfg, state=None, name=None):
        return quantize_sq_weights(weight, stats, cfg)

    def pack(self, res, cfg, bias):
        return _pack_sq_weights(res, cfg, bias)

    def transform(self, caps, cfg, state):
        return _smooth_transform(caps, cfg)


@register
class SQActs(Method):
    name, config_cls = "sq-acts", SQActsConfig
    description = "SQ-format on activations (Algorithm 2): smoothing + W4 GPTQ, dynamic or static split"

    def quantize(self, weight, stats, cfg, state=None, name=None):
        return quantize_sq_acts(weight, stats, cfg)

    def pack(self, res, cfg, bias):
        return _pack_sq_acts(res, cfg, bias)

    def transform(self, caps, cfg, state):
        return _smooth_transform(caps, cfg)
