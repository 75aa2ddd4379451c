"""Per-group scale and zero-point selection for uniform integer grids.

``minmax`` takes the group's range (including 0, as GPTQ does); ``mse`` searches a grid of
shrink factors ``p in {1, 1-1/grid, ..., 1-max_shrink}`` of that range and keeps, per row and
group, the one minimising ``sum |w - Q(w)|^norm`` (GPTQ's ``Quantizer(mse=True)``: grid 100,
max_shrink 0.8, norm 2.4).  Scales are rounded to float16 before codes are derived, so what is
simulated is exactly what a packed checkpoint stores.

Scales go down to the smallest float16 subnormal, ``2^-24``: a group whose range needs a smaller
step (``max|w| < ~2^-21`` at 4 bits, e.g. an all-zero group of dead inputs) gets ``2^-24``, and
its weights are then represented to within ``2^-25`` absolute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from ..formats.grid import IntGrid, fp16_ceil
from ..formats.layout import normalize_group_size, num_groups

__all__ = ["ScaleMethod", "range_scale_zero", "find_scale_zero", "group_scale_zero", "set_fast_mse_search"]

ScaleMethod = Literal["minmax", "mse"]

# Smallest positive float16 (subnormal): every scale is fp16-exact (fp16_ceil) and at least this.
_MIN_SCALE = 2.0**-24
# Elements of ``candidates x rows x cols`` evaluated at once by the MSE search (bounds memory):
# on the CPU a cache-sized chunk; on a GPU every candidate of a group at once (64 Mi elements,
# 256 MB in float32), since each chunk there costs a chain of small kernel launches (measured on an
# H200: 40 chunks per 128-column group of an 8B layer took half of its GPTQ time).
_MSE_CHUNK_ELEMS = 1 << 21
_MSE_CHUNK_ELEMS_GPU = 1 << 26
# A faster MSE search with the same chosen scales bit for bit, injected from a higher layer (the C++
# kernel: bitmosaic.kernels.scale_search.install(), issue 74); called with _mse_search's arguments, it
# returns (scale, zero) or None where it does not apply (then _mse_search runs).  This module stays
# pure torch: without it, or without a compiler, the reference below is the search.
_fast_mse_search: Callable | None = None
_BATCH_ROWS = 1 << 15  # rows (stacked groups) per call of the fast search in group_scale_zero


def set_fast_mse_search(fn: Callable | None) -> Callable | None:
    """Install ``fn`` as the fast MSE search (``None``: the reference only); returns the previous one."""
    global _fast_mse_search
    prev, _fast_mse_search = _fast_mse_search, fn
    return prev


def range_scale_zero(
    xmin: torch.Tensor, xmax: torch.Tensor, grid: IntGrid, *, check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale/zero mapping ``[xmin, xmax]`` (elementwise, any shape) onto the grid.

    Scales are fp16-exact and at least ``2^-24`` (the smallest fp16 subnormal), so what is stored
    in half precision is what was simulated.  ``check=False``: no float16-overflow test (see
    :func:`~bitmosaic.formats.grid.fp16_ceil`), for ranges inside one already checked.
    """
    xmin = torch.minimum(xmin, torch.zeros_like(xmin))
    xmax = torch.maximum(xmax, torch.zeros_like(xmax))
    if grid.symmetric:
        amax = torch.maximum(xmin.abs(), xmax)
        scale = 2 * amax / grid.maxq
    else:
        scale = (xmax - xmin) / grid.maxq
    scale = fp16_ceil(scale.clamp(min=_MIN_SCALE), check=check)
    if grid.symmetric:
        zero = torch.full_like(scale, float(grid.sym_zero))
    else:
        zero = torch.round(-xmin / scale).clamp(0, grid.maxq)
    return scale, zero


def _mse_search(
    w: torch.Tensor,
    xmin: torch.Tensor,
    xmax: torch.Tensor,
    grid: IntGrid,
    scale: torch.Tensor,
    zero: torch.Tensor,
    mse_grid: int,
    max_shrink: float,
    norm: float,
    chunk_elems: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All shrink candidates at once (chunked), the same arithmetic per candidate as GPTQ's loop.

    Candidate ``i`` evaluates ``p_i = 1 - i / mse_grid`` (rounded to ``w``'s dtype, as ``p * xmin``
    with a Python float does); the first candidate with the smallest error wins, as the loop's
    strict ``err < best`` does, and rows whose every error is NaN keep the min-max scale.
    """
    n_cand = int(max_shrink * mse_grid)
    if n_cand <= 0:
        return scale, zero
    rows, cols = w.shape
    ps = torch.tensor([1 - i / mse_grid for i in range(n_cand)], dtype=w.dtype, device=w.device)
    step = max(1, chunk_elems // max(1, rows * cols))
    best = torch.full_like(scale, float("inf"))
    for c0 in range(0, n_cand, step):
        p = ps[c0 : c0 + step, None]  # [C, 1]
        # p <= 1: inside the range range_scale_zero already checked for float16 overflow
        s1, z1 = range_scale_zero(p * xmin, p * xmax, grid, check=False)  # [C, rows]
        s3, z3 = s1[:, :, None], z1[:, :, None]
        # dequantize(quantize(w)) - w, in place: the arithmetic of quantize_codes/dequantize_codes
        c = torch.div(w, s3).round_().add_(z3).clamp_(0, grid.maxq).sub_(z3)  # [C, rows, cols]
        err = c.mul_(s3).sub_(w).abs_().pow_(norm).sum(dim=2)  # same per-row reduction as [rows, cols]
        err = torch.nan_to_num_(err, nan=float("inf"))
        cbest, idx = err.min(dim=0)  # first minimum along candidates
        better = cbest < best
        idx = idx[None, :]
        best = torch.where(better, cbest, best)
        scale = torch.where(better, s1.gather(0, idx)[0], scale)
        zero = torch.where(better, z1.gather(0, idx)[0], zero)
    return scale, zero


def find_scale_zero(
    w: torch.Tensor,
    grid: IntGrid,
    method: ScaleMethod = "minmax",
    *,
    mse_grid: int = 100,
    max_shrink: float = 0.8,
    norm: float = 2.4,
    chunk_elems: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero per row of ``w`` (``[rows, cols]``: one group's columns) -> two ``[rows]``.

    ``mse`` evaluates the ``int(max_shrink * mse_grid)`` candidates vectorised, at most
    ``chunk_elems`` elements at a time (default: by ``w``'s device, see ``_MSE_CHUNK_ELEMS``); the
    result is that of the sequential loop, whatever the chunk.
    """
    if method not in ("minmax", "mse"):
        raise ValueError(f"unknown scale method {method!r}; use 'minmax' or 'mse'")
    xmin = w.amin(dim=1)
    xmax = w.amax(dim=1)
    scale, zero = range_scale_zero(xmin, xmax, grid)
    if method == "minmax":
        return scale, zero
    if chunk_elems is None:
        chunk_elems = _MSE_CHUNK_ELEMS if w.device.type == "cpu" else _MSE_CHUNK_ELEMS_GPU
    args = (w.contiguous(), xmin, xmax, grid, scale, zero, mse_grid, max_shrink, norm, chunk_elems)
    if _fast_mse_search is not None:
        got = _fast_mse_search(*args)
        if got is not None:
            return got
    return _mse_search(*args)


def _fast_rows(
    w: torch.Tensor, grid: IntGrid, ref_rows: int, **kw
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fast search on every row of ``w`` at once, standing for reference calls of ``ref_rows``
    rows each, or ``None`` where it does not apply.  Its rows are independent (each is the
    reference's result for that row), so many groups can go in one call; the reference's own
    chunking differs with the rows, so it is never batched."""
    if _fast_mse_search is None:
        return None
    xmin, xmax = w.amin(dim=1), w.amax(dim=1)
    scale, zero = range_scale_zero(xmin, xmax, grid)
    chunk = kw.get("chunk_elems") or (_MSE_CHUNK_ELEMS if w.device.type == "cpu" else _MSE_CHUNK_ELEMS_GPU)
    return _fast_mse_search(w.contiguous(), xmin, xmax, grid, scale, zero, kw.get("mse_grid", 100),
                            kw.get("max_shrink", 0.8), kw.get("norm", 2.4), chunk, ref_rows)  # fmt: skip


def group_scale_zero(
    W: torch.Tensor, grid: IntGrid, group_size: int | None, method: ScaleMethod = "minmax", **kw
) -> tuple[torch.Tensor, torch.Tensor]:
    """Static scales/zeros for every contiguous group of ``W`` -> ``[out, G]`` each.

    With the fast MSE search installed and equal groups, the groups go stacked as rows, up to
    ``_BATCH_ROWS`` a call (the same result as one call per group)."""
    out, n = W.shape
    g = normalize_group_size(group_size, n)
    G = num_groups(n, group_size)
    if method == "mse" and G > 1 and n == G * g and _fast_mse_search is not None:
        # at most _BATCH_ROWS stacked groups a call (memory: the candidates' scales are [rows, 80])
        step = max(1, _BATCH_ROWS // G)
        parts = [_fast_rows(W[i : i + step].reshape(-1, g), grid, out, **kw) for i in range(0, out, step)]
        if all(p is not None for p in parts):
            return (
                torch.cat([p[0] for p in parts]).view(out, G),
                torch.cat([p[1] for p in parts]).view(out, G),
            )
    scales = W.new_empty(out, G)
    zeros = W.new_empty(out, G)
    for k in range(G):
        scales[:, k], zeros[:, k] = find_scale_zero(W[:, k * g : (k + 1) * g], grid, method, **kw)
    return scales, zeros
