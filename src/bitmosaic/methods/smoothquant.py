"""Methods ``smoothquant`` and ``awq``: per-channel factors folded into the preceding ops, then
weight quantization.

- ``smoothquant`` (Xiao et al., 2023, §4 Eq. 4): ``s_j = max|X_j|^α / max|W_j|^(1-α)``, α fixed
  (0.5, the paper's default) or searched per group on a grid to minimise the group's output
  error after weight *and* activation quantization on a token sample.  The weights are then
  quantized with RTN (the paper's setting) or GPTQ (``weights="gptq"``, the combination SQ-format
  and MosaicQuant use).
- ``awq`` (Lin et al., 2024, §3.2): scales ``s = mean|x|^r / wmag^(1-r)`` with ``r`` searched on a
  grid to minimise the quantized group's output error (computed exactly through the float
  input's Hessian), then an output-aware clipping search per (row, group), then RTN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..algorithms.awq import awq_clip_search, awq_search_scales
from ..algorithms.rtn import rtn_quantize
from ..algorithms.smooth import search_alpha, smooth_scales, smoothing_loss
from ..algorithms.types import QuantResult
from ..errors import OptionError
from ..formats.grid import IntGrid, quantize_codes
from ..formats.layout import default_g_idx
from .common import act_fake_quant, foldable_groups, shared, weight_fake_quant
from .gptq import GPTQConfig, quantize_gptq
from .options import like, option, parse_alpha, parse_floats
from .registry import LayerStats, Method, WeightQuantConfig, register

__all__ = ["SmoothQuantConfig", "AWQConfig", "weight_fake_quant", "act_fake_quant"]

ALPHA_GRID = tuple(i / 20 for i in range(21))


@dataclass
class SmoothQuantConfig(GPTQConfig):
    # SmoothQuant's own weight quantizer settings (the paper's RTN): not GPTQ's act-order + MSE
    # defaults, which would change its results and slow the alpha search tenfold
    scale: str = like(WeightQuantConfig, "scale", "minmax")
    order: str = shared("order", "natural")
    static_groups: bool | None = like(GPTQConfig, "static_groups", False)  # the paper's (dynamic) GPTQ
    alpha: float | None = option(
        0.5, help="migration strength in [0, 1], or 'search' (per group, on --alpha-grid)", parse=parse_alpha,
        type=float,
    )  # fmt: skip
    alpha_grid: tuple[float, ...] = option(
        ALPHA_GRID, help="alpha values searched (comma list)", parse=parse_floats
    )
    solver: str = shared(
        "solver", "rtn", help="the weight quantizer after smoothing: rtn (the paper) | gptq",
        old_names=("weights",), deprecated=("--smooth-weights",),
    )  # fmt: skip
    max_tokens: int = shared("max_tokens")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.solver not in ("rtn", "gptq"):
            raise ValueError(f"smoothquant solver (weights) must be 'rtn' or 'gptq', got {self.solver!r}")
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1] (or None to search), got {self.alpha}")


def smoothquant_transform(caps, cfg: SmoothQuantConfig):
    qw, qx = weight_fake_quant(cfg), act_fake_quant(cfg.act)

    def factors(cap, weights):
        amax = cap.observer.channel_absmax
        if cfg.alpha is not None:
            return smooth_scales(amax, weights, cfg.alpha), {"alpha": cfg.alpha}
        res = search_alpha(cap.sample, amax, weights, qw, qx, cfg.alpha_grid)
        # Our decision (the paper has no search): keep the group unsmoothed when no alpha
        # beats it on the searched objective, so the search can never make a group worse.
        base = smoothing_loss(cap.sample, weights, torch.ones_like(res.scales), qw, qx, dtype=torch.float32)
        info = {"alpha": res.alpha, "loss": res.losses[res.alpha], "unsmoothed_loss": base}
        if base <= res.losses[res.alpha]:
            return None, {**info, "alpha": None}
        return res.scales, info

    return foldable_groups(caps, factors)


def quantize_smoothquant(weight, stats: LayerStats, cfg: SmoothQuantConfig) -> QuantResult:
    if cfg.solver == "gptq":
        return quantize_gptq(weight, stats, cfg)
    return rtn_quantize(weight, IntGrid(cfg.bits, cfg.sym), cfg.group_size, cfg.scale, cfg.clip)


@dataclass
class AWQConfig(WeightQuantConfig):
    n_grid: int = shared("n_grid")
    duo_scaling: bool = shared("duo_scaling")
    clip_search: bool = shared("clip_search")
    max_shrink: float = shared("max_shrink")
    max_tokens: int = shared("max_tokens", 256)  # the search works through Hessians

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_grid < 1 or not 0.0 < self.max_shrink < 1.0:
            raise OptionError("awq needs n_grid >= 1 and 0 < max_shrink < 1")
        if not self.clip and self.clip_search:
            raise OptionError(
                "awq: clip=False (--no-clip) contradicts its output-aware clip search, which picks "
                "clipped ranges; pass clip_search=False as well, or drop --no-clip"
            )


def awq_transform(caps, cfg: AWQConfig):
    qw = weight_fake_quant(cfg)

    def factors(cap, weights):
        res = awq_search_scales(
            cap.observer.channel_absmean,
            weights,
            cap.hessian,
            qw,
            n_grid=cfg.n_grid,
            duo_scaling=cfg.duo_scaling,
            group_size=cfg.group_size,
        )
        gain = 1.0 - min(res.losses.values(), default=res.identity_loss) / max(res.identity_loss, 1e-30)
        return (None if res.ratio is None else res.scales), {"ratio": res.ratio, "loss_gain": gain}

    return foldable_groups(caps, factors)


def quantize_awq(weight, stats: LayerStats, cfg: AWQConfig) -> QuantResult:
    grid = IntGrid(cfg.bits, cfg.sym)
    if not cfg.clip_search or stats.hessian is None:
        return rtn_quantize(weight, grid, cfg.group_size, cfg.scale, cfg.clip)
    W = weight.float()
    scales, zeros = awq_clip_search(
        W, stats.hessian.float(), grid, cfg.group_size, cfg.n_grid, cfg.max_shrink
    )
    g_idx = default_g_idx(W.shape[1], cfg.group_size, device=W.device)
    codes = quantize_codes(W, scales[:, g_idx], zeros[:, g_idx], grid.maxq)
    return QuantResult(codes.to(torch.int32), scales, zeros, g_idx, info={"clip_search": True})


@register
class SmoothQuant(Method):
    name, config_cls = "smoothquant", SmoothQuantConfig
    description = "SmoothQuant: migrate activation outliers into weights (alpha fixed/searched), RTN or GPTQ"

    def quantize(self, weight, stats, cfg, state=None, name=None):
        return quantize_smoothquant(weight, stats, cfg)

    def transform(self, caps, cfg, state):
        return smoothquant_transform(caps, cfg)


@register
class AWQ(Method):
    name, config_cls = "awq", AWQConfig
    description = "AWQ: activation-aware scale search + output-aware clip search, then RTN"

    def quantize(self, weight, stats, cfg, state=None, name=None):
        return quantize_awq(weight, stats, cfg)

    def transform(self, caps, cfg, state):
        return awq_transform(caps, cfg)
