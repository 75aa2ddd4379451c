"""Method ``sq-acts``: SQ-format on activations (SQ-format paper §3.2.2, Algorithm 2).

Smoothing first (SmoothQuant, ``alpha = 0.5`` by default; the transform runs before the group's
Hessian is accumulated, so the Hessian comes from the smoothed inputs), then W4 GPTQ weights exactly
as method ``smoothquant`` with ``solver="gptq"`` makes them (same config fields, same packed layout:
both stand on :class:`~.common.SmoothingConfig` and run :func:`~.common.quantize_gptq`), activations
in SQ-format at inference (:class:`~bitmosaic.modules.sq.SQActLinear`), ``strategy="dynamic"`` or
``"static"``.  The weights are calibrated on 16-bit activations, so W4A8, W4A4 and W4A(SQ) built
from the same calibration differ only in their activations.  The static mask comes from ``Ā_j`` of
the smoothed calibration inputs and the smoothed float ``W'`` (Algorithm 2, line 6).  Activation
scales (``act_scale``, both strategies): per token, per token and bank, or per token and
``act_scale_group`` channels (independent of the bank); with a static mask, ``act_scale_calib``
fixes the bank/group scales from the calibration inputs' ``max|x_j|`` (fully static activations).
The paper does not print the granularity; its Table 2 fits per-bank scales (issue 25).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..algorithms.sq import STATIC_IMPORTANCE, static_act_scales, static_channel_mask, static_importance
from ..algorithms.types import QuantResult
from ..errors import OptionError
from ..formats.sq import act_name, parse_sq
from ..formats.sq_act import ACT_SCALES
from ..modules.qlinear import QuantLinear
from ..modules.sq import STRATEGIES, SQActLinear
from .common import SmoothingConfig, quantize_gptq, shared, smoothing_transform
from .options import option
from .registry import LayerStats, Method, register

__all__ = ["SQActs", "SQActsConfig", "SQActResult", "quantize_sq_acts"]


@dataclass
class SQActResult(QuantResult):
    """A W4 result plus the static channel mask of its activations (``None`` when dynamic) and its
    calibrated ``(low, high)`` activation scales (``None`` unless ``act_scale_calib``)."""

    channel_mask: torch.Tensor | None = field(default=None, kw_only=True)
    act_scales: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, kw_only=True)


@dataclass
class SQActsConfig(SmoothingConfig):
    """Algorithm 2.  ``strategy``: dynamic | static; ``act_scale``: token | bank | group (with
    ``act_scale_group`` channels), ``act_scale_calib``: static bank/group scales from calibration;
    ``static_importance``: aw (the paper) | a | abs-aw (ablations)."""

    needs_act_stats: ClassVar[bool] = True
    unused: ClassVar[dict[str, str]] = {"act": "sq-acts quantizes the activations itself (--sq)"}
    solver: str = shared(
        "solver", "gptq", help="the weight quantizer after smoothing: gptq (the W4 baseline's)"
    )
    sq: str = shared("sq", "16-(8/4)-0.5")
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
    res = quantize_gptq(weight, stats, cfg)  # smoothquant's solver="gptq" (the config insists on it)
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
class SQActs(Method):
    name, config_cls = "sq-acts", SQActsConfig
    description = "SQ-format on activations (Algorithm 2): smoothing + W4 GPTQ, dynamic or static split"

    def quantize(self, weight, stats, cfg, state=None, name=None):
        return quantize_sq_acts(weight, stats, cfg)

    def pack(self, res, cfg, bias):
        return _pack_sq_acts(res, cfg, bias)

    def transform(self, caps, cfg, state):
        return smoothing_transform(caps, cfg, cfg.smooth)
