"""Method ``babai``: Babai's nearest plane algorithm on the Hessian lattice (the Babai paper's
equivalence made usable).

It runs with static group scales on the basis order that makes it equal to GPTQ on the same
``order``/``direction`` with ``static_groups=True`` (Babai paper §4, Theorem 4; Algorithm 4): Babai's
basis order is GPTQ's processing order reversed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..algorithms.babai import babai_nearest_plane
from ..algorithms.hessian import damp_hessian
from ..algorithms.scales import group_scale_zero
from ..algorithms.types import QuantResult
from ..formats.grid import IntGrid
from ..formats.layout import default_g_idx
from .common import HESSIAN_DTYPES, processing_order, require_hessian, shared
from .registry import LayerStats, Method, WeightQuantConfig, register

__all__ = ["Babai", "BabaiConfig", "quantize_babai"]


@dataclass
class BabaiConfig(WeightQuantConfig):
    refuses: ClassVar[dict[str, str]] = {
        "gguf_type": "Babai's nearest plane with static groups is GPTQ in the reverse order (Babai paper "
        "Theorem 4), so on a GGUF type's grid it is --method gptq --gguf-type TYPE --order ORDER "
        "(e.g. --order min-pivot)"
    }
    order: str = shared("order", "natural")
    direction: str = shared("direction")
    damp: float = shared("damp")
    solver_dtype: str = shared("solver_dtype", "float64")


def quantize_babai(weight, stats: LayerStats, cfg: BabaiConfig) -> QuantResult:
    H0 = require_hessian(stats, "babai")
    dtype = HESSIAN_DTYPES[cfg.solver_dtype]
    W = weight.to(dtype).clone()
    H = H0.to(device=W.device, dtype=dtype)
    W[:, torch.diagonal(H) == 0] = 0
    Hd, _, _ = damp_hessian(H, cfg.damp)
    grid = IntGrid(cfg.bits, cfg.sym)
    scales, zeros = group_scale_zero(W, grid, cfg.group_size, cfg.scale)
    g_idx = default_g_idx(W.shape[1], cfg.group_size, device=W.device)
    perm = processing_order(H0, cfg).to(W.device)  # as gptq: from the undamped Hessian
    codes, D = babai_nearest_plane(
        W, Hd, grid, scales[:, g_idx], zeros[:, g_idx], perm.flip(0), cfg.clip, return_pivots=True
    )
    return QuantResult(codes, scales, zeros, g_idx, perm=perm, hessian=Hd, pivots=D.flip(0))


@register
class Babai(Method):
    name, config_cls, row_separable = "babai", BabaiConfig, True
    description = "Babai's nearest plane on the Hessian lattice"

    def quantize(self, weight, stats: LayerStats, cfg: BabaiConfig, state=None, name=None) -> QuantResult:
        return quantize_babai(weight, stats, cfg)
