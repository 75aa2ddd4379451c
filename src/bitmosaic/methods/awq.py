"""Method ``awq`` (Lin et al., 2024, §3.2): per-channel scales folded into the preceding ops, then
weight quantization.

Scales ``s = mean|x|^r / wmag^(1-r)`` with ``r`` searched on a grid to minimise the quantized group's
output error (computed exactly through the float input's Hessian), then an output-aware clipping
search per (row, group), then RTN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..algorithms.awq import awq_clip_search, awq_search_scales
from ..algorithms.rtn import rtn_quantize
from ..algorithms.types import QuantResult
from ..errors import OptionError
from ..formats.grid import IntGrid, quantize_codes
from ..formats.layout import default_g_idx
from .common import foldable_groups, shared, weight_fake_quant
from .registry import LayerStats, Method, WeightQuantConfig, register

__all__ = ["AWQ", "AWQConfig", "awq_transform", "quantize_awq"]


@dataclass
class AWQConfig(WeightQuantConfig):
    refuses: ClassVar[dict[str, str]] = {
        "gguf_type": "AWQ's scale search rounds to nearest on bitmosaic's integer grid, not a GGUF type's "
        "sub-block scales; use --method gptq --gguf-type TYPE (its scale fit and solve weight the inputs "
        "by the same activations)"
    }
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
class AWQ(Method):
    name, config_cls = "awq", AWQConfig
    description = "AWQ: activation-aware scale search + output-aware clip search, then RTN"

    def quantize(self, weight, stats, cfg, state=None, name=None):
        return quantize_awq(weight, stats, cfg)

    def transform(self, caps, cfg, state):
        return awq_transform(caps, cfg)
