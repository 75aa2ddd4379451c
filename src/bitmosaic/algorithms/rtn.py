"""Round-to-nearest (RTN): the baseline every second-order method is measured against."""

from __future__ import annotations

import torch

from ..formats.grid import IntGrid, quantize_codes
from ..formats.layout import default_g_idx
from .scales import ScaleMethod, group_scale_zero
from .types import QuantResult

__all__ = ["rtn_quantize"]


def rtn_quantize(
    W: torch.Tensor,
    grid: IntGrid,
    group_size: int | None = None,
    scale_method: ScaleMethod = "minmax",
    clip: bool = True,
) -> QuantResult:
    """Quantize each weight to its nearest grid point with per-group scales."""
    W = W.float() if W.dtype not in (torch.float32, torch.float64) else W
    scales, zeros = group_scale_zero(W, grid, group_size, scale_method)
    g_idx = default_g_idx(W.shape[1], group_size, device=W.device)
    codes = quantize_codes(W, scales[:, g_idx], zeros[:, g_idx], grid.maxq, clip=clip)
    return QuantResult(codes.to(torch.int32), scales, zeros, g_idx)
