"""Method ``rtn``: round-to-nearest with per-group min-max or MSE scales, on the INT grid or a
microscaling format (``wfmt``: MXFP4, NVFP4, MXFP8, FP8 block; :mod:`.microscale`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..algorithms.mx import mx_rtn
from ..algorithms.rtn import rtn_quantize
from ..formats.grid import IntGrid
from .common import shared
from .microscale import SPLIT_ROWS, STACK_ROWS, is_mx, mx_post_init
from .registry import LayerStats, Method, WeightQuantConfig, register


@dataclass
class RTNConfig(WeightQuantConfig):
    wfmt: str = shared("wfmt")
    mx_rule: str = shared("mx_rule")

    def __post_init__(self) -> None:
        super().__post_init__()
        mx_post_init(self)

    stack_rows, split_rows = STACK_ROWS, SPLIT_ROWS


@register
class RTN(Method):
    name, config_cls, description = "rtn", RTNConfig, "round-to-nearest"
    needs_hessian, row_separable = False, True
    grid_fallback = True  # what a linear without statistics of its own is rounded with (registry.py)

    def quantize(self, weight, stats: LayerStats, cfg: RTNConfig, state=None, name=None):
        if is_mx(cfg):
            return mx_rtn(weight, cfg.wfmt, method=cfg.scale, rule=cfg.mx_rule)
        grid = IntGrid(cfg.bits, cfg.symmetric)
        return rtn_quantize(weight, grid, cfg.group_size, cfg.scale_method, cfg.clip)
