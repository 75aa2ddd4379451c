"""Method ``fp8``: weights rounded to an FP8 grid (E4M3 ±448 / ±240, E5M2) with a per-channel (or
per-tensor) scale ``max|W| / Z_max`` -- the FP8 weight side of the W8A8-FP8 baseline of the DPQ
paper (Table 3).  Stored as real FP8 bytes (:class:`~bitmosaic.modules.qmodules.FP8Linear`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..algorithms.dpq import fp8_weight_scale
from ..formats.fp import fp_round, get_float_format
from ..modules.qmodules import FP8Linear
from .common import shared
from .options import like, option
from .registry import LayerStats, Method, WeightQuantConfig, register

__all__ = ["FP8WeightConfig", "FP8WeightResult"]


@dataclass
class FP8WeightResult:
    """FP8-grid values ``v`` (float32, ``[out, in]``) and scale ``s`` (``[out|1, 1]``): ``W ≈ v s``."""

    values: torch.Tensor
    scale: torch.Tensor
    fmt: str
    perm: None = None
    hessian: torch.Tensor | None = None
    info: dict = field(default_factory=dict)

    def lattice_scales(self) -> None:
        return None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.values * self.scale).to(dtype)


@dataclass
class FP8WeightConfig(WeightQuantConfig):
    unused: ClassVar[dict[str, str]] = {
        "group_size": "fp8 has one scale per channel or tensor (--per-channel)",
        "sym": "FP8 values are signed floats",
        "scale": "the FP8 scale is max|W| / the format's maximum",
        "clip": "FP8 rounding saturates at the format's maximum",
    }

    bits: int = like(WeightQuantConfig, "bits", 8, range=(8, 8))
    group_size: int | None = like(WeightQuantConfig, "group_size", None)
    sym: bool = like(WeightQuantConfig, "sym", True)
    fmt: str = option("e4m3", help="FP8 format of the weights", choices=("e4m3", "e4m3-240", "e5m2"))
    per_channel: bool = shared("per_channel", True)
    pow2: bool = shared("pow2")

    def __post_init__(self) -> None:
        f = get_float_format(self.fmt)
        if f.bits != 8 or self.bits != 8:
            raise ValueError(
                f"fp8 weights are 8-bit formats (e4m3, e4m3-240, e5m2); got {self.fmt}, bits={self.bits}"
            )
        super().__post_init__()


def _pack_fp8(res: FP8WeightResult, cfg: FP8WeightConfig, bias):
    return FP8Linear.from_values(res.values, res.scale, res.fmt, bias)


def quantize_fp8(weight, stats: LayerStats, cfg: FP8WeightConfig) -> FP8WeightResult:
    W = weight.float()
    s = fp8_weight_scale(W, cfg.fmt, per_channel=cfg.per_channel, pow2=cfg.pow2)
    return FP8WeightResult(fp_round(W / s, cfg.fmt), s, cfg.fmt)


@register
class FP8(Method):
    name, config_cls = "fp8", FP8WeightConfig
    description = "FP8 (E4M3/E5M2) weights, per-channel scale"
    needs_hessian = False

    def quantize(self, weight, stats, cfg, state=None, name=None):
        return quantize_fp8(weight, stats, cfg)

    def pack(self, res, cfg, bias):
        return _pack_fp8(res, cfg, bias)
