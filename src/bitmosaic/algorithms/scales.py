"""Per-group scale and zero-point selection for uniform integer grids.

``minmax`` takes the group's range (including 0, as GPTQ does); ``mse`` searches a grid of
shrink factors ``p in {1, 1-1/grid, ..., 1-max_shrink}`` of that range and keeps, per row and
group, the one minimising ``sum |w - Q(w)|^norm`` (GPTQ's ``Quantizer(mse=True)``: grid 100,
max_shrink 0.8, norm 2.4).  Scales are rounded to float16 before codes are derived, so what is
simulated is exactly what a packed checkpoint stores.
"""

from __future__ import annotations

from typing import Literal

import torch

from ..formats.grid import IntGrid, dequantize_codes, fp16_ceil, quantize_codes
from ..formats.layout import normalize_group_size, num_groups

__all__ = ["ScaleMethod", "range_scale_zero", "find_scale_zero", "group_scale_zero"]

ScaleMethod = Literal["minmax", "mse"]

# Smallest normal float16: scales below it would lose precision when stored.
_MIN_SCALE = 2.0**-14


def range_scale_zero(
    xmin: torch.Tensor, xmax: torch.Tensor, grid: IntGrid
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale/zero mapping ``[xmin, xmax]`` (per row) onto the grid; scales are fp16-exact."""
    xmin = torch.minimum(xmin, torch.zeros_like(xmin))
    xmax = torch.maximum(xmax, torch.zeros_like(xmax))
    if grid.symmetric:
        amax = torch.maximum(xmin.abs(), xmax)
        scale = 2 * amax / grid.maxq
    else:
        scale = (xmax - xmin) / grid.maxq
    scale = fp16_ceil(scale.clamp(min=_MIN_SCALE))
    if grid.symmetric:
        zero = torch.full_like(scale, float(grid.sym_zero))
    else:
        zero = torch.round(-xmin / scale).clamp(0, grid.maxq)
    return scale, zero


def find_scale_zero(
    w: torch.Tensor,
    grid: IntGrid,
    method: ScaleMethod = "minmax",
    *,
    mse_grid: int = 100,
    max_shrink: float = 0.8,
    norm: float = 2.4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero per row of ``w`` (``[rows, cols]``: one group's columns) -> two ``[rows]``."""
    xmin = w.amin(dim=1)
    xmax = w.amax(dim=1)
    scale, zero = range_scale_zero(xmin, xmax, grid)
    if method == "minmax":
        return scale, zero
    if method != "mse":
        raise ValueError(f"unknown scale method {method!r}; use 'minmax' or 'mse'")
    best = torch.full_like(scale, float("inf"))
    for i in range(int(max_shrink * mse_grid)):
        p = 1 - i / mse_grid
        s1, z1 = range_scale_zero(p * xmin, p * xmax, grid)
        q = dequantize_codes(quantize_codes(w, s1[:, None], z1[:, None], grid.maxq), s1[:, None], z1[:, None])
        err = (q - w).abs_().pow_(norm).sum(dim=1)
        better = err < best
        if better.any():
            best = torch.where(better, err, best)
            scale = torch.where(better, s1, scale)
            zero = torch.where(better, z1, zero)
    return scale, zero


def group_scale_zero(
    W: torch.Tensor, grid: IntGrid, group_size: int | None, method: ScaleMethod = "minmax", **kw
) -> tuple[torch.Tensor, torch.Tensor]:
    """Static scales/zeros for every contiguous group of ``W`` -> ``[out, G]`` each."""
    out, n = W.shape
    g = normalize_group_size(group_size, n)
    G = num_groups(n, group_size)
    scales = W.new_empty(out, G)
    zeros = W.new_empty(out, G)
    for k in range(G):
        scales[:, k], zeros[:, k] = find_scale_zero(W[:, k * g : (k + 1) * g], grid, method, **kw)
    return scales, zeros
