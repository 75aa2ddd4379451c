"""Method ``rtn``: round-to-nearest with per-group min-max or MSE scales."""

from __future__ import annotations

from dataclasses import dataclass

from ..algorithms.rtn import rtn_quantize
from ..formats.grid import IntGrid
from .registry import LayerStats, Method, WeightQuantConfig, register


@dataclass
class RTNConfig(WeightQuantConfig):
    pass


@register
class RTN(Method):
    name, config_cls, description = "rtn", RTNConfig, "round-to-nearest"
    needs_hessian, row_separable = False, True
    grid_fallback = True  # what a linear without statistics of its own is rounded with (registry.py)

    def quantize(self, weight, stats: LayerStats, cfg: RTNConfig, state=None, name=None):
        grid = IntGrid(cfg.bits, cfg.symmetric)
        return rtn_quantize(weight, grid, cfg.group_size, cfg.scale_method, cfg.clip)
