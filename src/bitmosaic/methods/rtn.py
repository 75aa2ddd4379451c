"""Method ``rtn``: round-to-nearest with per-group min-max or MSE scales."""

from __future__ import annotations

from dataclasses import dataclass

from ..algorithms.rtn import rtn_quantize
from ..formats.grid import IntGrid
from .registry import LayerStats, WeightQuantConfig, register_method


@dataclass
class RTNConfig(WeightQuantConfig):
    pass


@register_method(
    "rtn", RTNConfig, needs_hessian=False, description="round-to-nearest", row_separable=True
)
def quantize_rtn(weight, stats: LayerStats, cfg: RTNConfig):
    return rtn_quantize(weight, IntGrid(cfg.bits, cfg.symmetric), cfg.group_size, cfg.scale_method, cfg.clip)
