"""Method ``sq-weights``: SQ-format on weights (SQ-format paper §3.2.1, Algorithm 1).

Smoothing first (SmoothQuant, ``alpha = 0.5`` by default; the transform runs before the group's
Hessian is accumulated, so the Hessian comes from the smoothed inputs, Algorithm 1 line 3), then
GPTQ through the SQ mixed grid (:func:`bitmosaic.algorithms.sq.sq_gptq`), saved as
:class:`~bitmosaic.modules.sq.SQWeightLinear`.  Combines with any activation quantizer
(``--abits 4/8``: W(SQ)A4, W(SQ)A8).  Banks must stay contiguous, so the order is natural
(act-order's ``g_idx`` would split banks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..algorithms.sq import IMPORTANCE_FORMS, MASK_TIMINGS, sq_gptq
from ..errors import OptionError
from ..formats.sq import parse_sq, weight_name
from ..modules.sq import SQWeightLinear
from .common import SmoothingConfig, require_hessian, shared, smoothing_transform
from .options import option
from .registry import LayerStats, Method, register

__all__ = ["SQWeights", "SQWeightsConfig", "quantize_sq_weights"]


@dataclass
class SQWeightsConfig(SmoothingConfig):
    """Algorithm 1.  ``importance``: ``obs`` (SparseGPT's saliency) or ``paper`` (Alg. 1 line 4);
    ``mask_timing``: ``lazy`` (per bank, from the updated weights) or ``upfront`` (the paper)."""

    unused: ClassVar[dict[str, str]] = {
        **dict.fromkeys(
            ("bits", "group_size", "sym", "scale"), "SQ-format sets its own grids and banks (use --sq)"
        ),
        "solver": "its weights are GPTQ through the SQ grid",
    }
    sq: str = shared("sq")
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
        return smoothing_transform(caps, cfg, cfg.smooth)
