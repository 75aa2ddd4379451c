"""Method ``dpq``: W4A8 with FP8 compute (Dual Precision Quantization paper).

INT4 asymmetric group codes (default g128, MSE scales + clipping, §3.3) fitted on the FP8-rounded
weights, GPTQ-style compensation of the error of *both* levels (Eq. 12), Group-Aware Reordering
by default (§3.2; ``order="act"`` shows act-order's g_idx gather cost, ``"natural"`` no reorder),
and FP8 E4M3 activations with static per-tensor scales (§4.1).  ``naive=True`` is the paper's
"naive GPTQ" W4A8 baseline (only the INT4 error compensated, FP8 applied afterwards);
``solver="rtn"`` the RTN W4A8 baseline.  Saved as :class:`~bitmosaic.modules.qmodules.FP8ComputeQuantLinear`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..algorithms.dpq import INT4, dpq_quantize, fp8_on_top
from ..algorithms.rtn import rtn_quantize
from ..formats.act import ActQuantSpec
from ..formats.grid import IntGrid
from ..modules.qmodules import FP8ComputeQuantLinear
from .common import HESSIAN_DTYPES, processing_order, require_hessian, shared
from .options import like, option
from .registry import LayerStats, Method, WeightQuantConfig, register

__all__ = ["DPQConfig"]

FP8_RANGES = {448: "e4m3", 240: "e4m3-240"}


@dataclass
class DPQConfig(WeightQuantConfig):
    scale: str = like(WeightQuantConfig, "scale", "mse")
    order: str = shared("order", "gar")
    fp8_range: int = option(
        448, help="E4M3 range: 448 (OCP, Gaudi 3) or 240 (Gaudi 2)", choices=(448, 240), type=int
    )
    per_channel: bool = shared("per_channel", deprecated=("--fp8-per-channel",))
    margin: float = option(
        1.0, help="FP8 weight-scale headroom for compensated weights (1 = the paper's Eq. 6)",
        range=(1, None), deprecated=("--fp8-margin",),
    )  # fmt: skip
    pow2: bool = shared("pow2", deprecated=("--pow2-scales",))
    naive: bool = option(False, help="the paper's naive GPTQ W4A8 baseline (only the INT4 error compensated)")
    nearest_code: bool = option(
        False,
        help="ablation, not the paper: the INT4 code whose final FP8 value is nearest (Eqs. 7-9 round twice)",
    )
    solver: str = shared("solver", help="the INT solver: gptq | rtn (the RTN W4A8 baseline)")
    direction: str = shared("direction")
    block_size: int = shared("block_size")
    damp: float = shared("damp")
    solver_dtype: str = shared("solver_dtype")
    act: ActQuantSpec | None | str = like(WeightQuantConfig, "act", "fp8")  # E4M3 per-tensor static

    def __post_init__(self) -> None:
        if self.fp8_range not in FP8_RANGES:
            raise ValueError(f"fp8_range must be 448 or 240, got {self.fp8_range}")
        if self.order not in ("gar", "act", "natural"):
            raise ValueError(f"dpq order must be gar, act or natural, got {self.order!r}")
        if self.solver not in ("gptq", "rtn"):
            raise ValueError(f"dpq solver must be gptq or rtn, got {self.solver!r}")
        if self.sym:
            raise ValueError("dpq stores asymmetric INT codes (paper §2.1); drop --sym")
        if self.nearest_code and (self.naive or self.solver != "gptq" or not self.clip):
            raise ValueError(
                "--nearest-code is an ablation of DPQ's own solver; drop --naive, --solver rtn or --no-clip"
            )
        if self.act == "fp8":
            self.act = ActQuantSpec(self.fmt, 8, granularity="tensor", static=True, pow2=self.pow2)
        super().__post_init__()

    @property
    def fmt(self) -> str:
        return FP8_RANGES[self.fp8_range]


def _pack_dpq(res, cfg: DPQConfig, bias):
    return FP8ComputeQuantLinear.from_result(
        res, bits=cfg.bits, group_size=cfg.group_size, symmetric=False, bias=bias
    )


def quantize_dpq(weight, stats: LayerStats, cfg: DPQConfig):
    grid = INT4 if cfg.bits == 4 else IntGrid(cfg.bits)
    fp8 = {"per_channel": cfg.per_channel, "margin": cfg.margin, "pow2": cfg.pow2}
    if cfg.solver == "rtn":
        return fp8_on_top(rtn_quantize(weight, grid, cfg.group_size, cfg.scale, cfg.clip), cfg.fmt, **fp8)
    H = require_hessian(stats, "dpq")
    return dpq_quantize(
        weight,
        H,
        fmt=cfg.fmt,
        group_size=cfg.group_size,
        perm=processing_order(H, cfg),
        scale_method=cfg.scale,
        clip=cfg.clip,
        naive=cfg.naive,
        nearest=cfg.nearest_code,
        block_size=cfg.block_size,
        percdamp=cfg.damp,
        dtype=HESSIAN_DTYPES[cfg.solver_dtype],
        grid=grid,
        **fp8,
    )


@register
class DPQ(Method):
    name, config_cls = "dpq", DPQConfig
    description = "DPQ: W4A8 FP8 compute, dual-precision GPTQ, GAR"

    def quantize(self, weight, stats, cfg, state=None, name=None):
        return quantize_dpq(weight, stats, cfg)

    def pack(self, res, cfg, bias):
        return _pack_dpq(res, cfg, bias)
