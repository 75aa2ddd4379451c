"""The MSE scale search at GEMM speed, with the reference's chosen scales bit for bit (issue 74).

:func:`bitmosaic.algorithms.scales.find_scale_zero` with ``method="mse"`` picks, per row, the first of
80 shrink candidates minimising ``sum |w - Q(w)|^2.4`` in float32 torch arithmetic (``_mse_search``).
:func:`mse_search` returns the same scale and zero per row, in three steps:

1. The candidates' scales and zeros ``[R, C]``: the reference's own arithmetic
   (:func:`~bitmosaic.algorithms.scales.range_scale_zero` of ``p * xmin``, ``p * xmax``), evaluated in
   C++ (:func:`candidate_scales`, the same floats bit for bit).
2. ``csrc/scalesearch.cpp``: per row, every candidate's error approximately (torch's exact float32
   distances ``d``; ``d^2.4`` within the relative error ``APPROX_REL``, checked over every float32
   exponent and mantissa by the tests; summed in double), threads over rows, a candidate dropped as
   soon as its partial sum (a lower bound) leaves the survivor margin.  With ``E`` torch's float32
   error and ``A`` the approximation, ``|E - A| <= kappa A + alpha`` (:func:`error_bound`: torch's
   pow within 2 ulp, any float32 summation order of ``n`` nonnegative terms within ``gamma_n``,
   underflow within ``2^-125`` per term), so the true winner is among the candidates with
   ``A (1 - kappa) <= A_min (1 + kappa) + 2 alpha`` (``kappa`` is taken twice the bound).
3. A row with one survivor has its winner; rows with several get those candidates' errors from the
   reference's exact torch arithmetic and keep the first minimum in candidate order (strict ``<``, as
   the reference); rows holding a non-finite weight go to the reference itself (min-max kept).

Identical results need the reference's per-element values to be position independent: torch
evaluates ``pow`` vectorised (Sleef) except in a loop's scalar tail, so the fast path runs only where
every parallel chunk of the reference's ``[C, rows, cols]`` tensor is a multiple of 32 elements
(:func:`_reference_vectorised`: group sizes 16/32/64/128 and full rows of real layers), and the exact
re-evaluation runs in serial blocks of whole 32-element multiples (padded with a repeated row where
``cols`` is not a multiple of 32).  Otherwise (other shapes, float64, another norm, a GPU, no
compiler) the reference runs.
"""

from __future__ import annotations

import math

import torch

from ..algorithms import scales as _scales
from ..formats.grid import IntGrid
from . import build
from .isa import isa_number

__all__ = [
    "APPROX_REL",
    "TORCH_POW_REL",
    "candidate_scales",
    "error_bound",
    "extension",
    "install",
    "mse_search",
]

APPROX_REL = 2.0**-21  # relative error of the kernel's d^2.4 (tests/kernels/test_scale_search.py, exhaustive)
TORCH_POW_REL = 2.0**-22  # torch's float32 pow: Sleef powf_u10 (1.0 ulp) or glibc powf (< 1 ulp); 2 ulp taken
_GRAIN = 32768  # at::internal::GRAIN_SIZE: torch's elementwise loops split into threads from here
_NORM = 2.4


def extension():
    """The compiled ``scalesearch`` extension, or ``None`` (no compiler, ``$BITMOSAIC_NO_EXT=1``)."""
    return build.load("scalesearch")


def error_bound(n: int) -> tuple[float, float]:
    """``(kappa, 2 alpha)`` with ``|E - A| <= kappa A + alpha`` for a row of ``n`` columns, ``kappa``
    twice the first-order bound (the factor covers the second-order terms)."""
    u = 2.0**-24
    gamma_f = n * u / (1 - n * u)  # float32 sum of n nonnegative terms, any order
    gamma_d = 2 * n * 2.0**-53 / (1 - 2 * n * 2.0**-53)  # the kernel's double sums (< 2n additions)
    k = TORCH_POW_REL + gamma_f * (1 + TORCH_POW_REL) + APPROX_REL + gamma_d * (1 + APPROX_REL)
    alpha = 2 * n * 2.0**-125  # underflowed terms (d^2.4 < 2^-126) on either side
    return 2 * k, 2 * alpha


def _reference_vectorised(rows: int, cols: int, n_cand: int, chunk_elems: int) -> bool:
    """Whether the reference evaluates every ``pow`` of its chunks in torch's vectorised loop: each
    chunk's ``numel`` and each thread's share of it a multiple of 32 (2 AVX-512 vectors), and the
    exact re-evaluation's padded serial blocks (:func:`_exact_block`) fit under torch's grain."""
    if _exact_block(cols) == 0:
        return False
    threads = torch.get_num_threads()
    step = max(1, chunk_elems // max(1, rows * cols))
    sizes = {min(step, n_cand - c0) for c0 in range(0, n_cand, step)}
    for c in sizes:
        numel = c * rows * cols
        if numel % 32:
            return False
        if numel < _GRAIN or threads == 1:
            continue
        parts = min(threads, -(-numel // _GRAIN))
        if (-(-numel // parts)) % 32:
            return False
    return True


def _exact_block(cols: int) -> int:
    """Rows per serial block of :func:`_exact_errors`: a multiple of ``32 / gcd(cols, 32)`` (so the
    block is whole 32-element multiples) with fewer than ``_GRAIN`` elements; 0 where none fits."""
    m = 32 // math.gcd(cols, 32)
    per = (_GRAIN - 1) // cols
    return per - per % m


def _exact_errors(w, S, Z, cand, row, maxq):
    """The reference's float32 error of candidate ``cand[i]`` on row ``row[i]``, in serial blocks
    (fewer than ``_GRAIN`` elements, whole 32-element multiples: every pow vectorised; a short last
    block is padded by repeating its last pair, whose extra errors are dropped)."""
    cols = w.shape[1]
    per, m = _exact_block(cols), 32 // math.gcd(cols, 32)
    n = cand.numel()
    out = torch.empty(n, dtype=w.dtype)
    for i in range(0, n, per):
        c, r = cand[i : i + per], row[i : i + per]
        k = c.numel()
        if k % m:
            pad = m - k % m
            c, r = torch.cat([c, c[-1:].expand(pad)]), torch.cat([r, r[-1:].expand(pad)])
        wb = w.index_select(0, r)
        s, z = S[r, c][:, None], Z[r, c][:, None]
        e = torch.div(wb, s).round_().add_(z).clamp_(0, maxq).sub_(z)
        out[i : i + k] = e.mul_(s).sub_(wb).abs_().pow_(_NORM).sum(dim=1)[:k]
    return torch.nan_to_num_(out, nan=float("inf"))


def candidate_scales(xmin, xmax, ps, grid: IntGrid, ext=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's candidate scales and zeros ``[rows, C]``: :func:`range_scale_zero` of ``xmin * p``,
    ``xmax * p`` for each shrink ``p`` of ``ps``, bit for bit (``csrc/scalesearch.cpp`` evaluates the
    same float32 operations per element, in C++: the torch form took most of the search's time).
    Needs the compiled extension (``ext``, default :func:`extension`), as :func:`mse_search` does."""
    ext = ext or extension()
    sym_zero = grid.sym_zero if grid.symmetric else 0
    return tuple(ext.candidate_scales(xmin.contiguous(), xmax.contiguous(), ps.contiguous(), grid.maxq,
                                      grid.symmetric, sym_zero))  # fmt: skip


def mse_search(
    w, xmin, xmax, grid: IntGrid, scale, zero, mse_grid, max_shrink, norm, chunk_elems, ref_rows=None
):
    """``_mse_search``'s result (the same arguments), or ``None`` where the fast path does not apply.
    ``ref_rows``: the rows of the reference calls this one stands for (several groups stacked as rows;
    default all of ``w``'s), whose chunking must be vectorised."""
    if norm != _NORM or w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2:
        return None
    n_cand = int(max_shrink * mse_grid)
    rows, cols = w.shape
    if n_cand <= 0 or rows == 0 or not _reference_vectorised(ref_rows or rows, cols, n_cand, chunk_elems):
        return None
    ext = extension()
    if ext is None:
        return None
    ps = torch.tensor([1 - i / mse_grid for i in range(n_cand)], dtype=w.dtype)
    S, Z = candidate_scales(xmin, xmax, ps, grid, ext)  # [rows, C]
    kappa, alpha2 = error_bound(cols)
    win, alive = ext.mse_survivors(w, S, Z, grid.maxq, kappa, alpha2, isa_number(ext=ext))
    win = win.long()
    several = (win == -1).nonzero().flatten()
    if several.numel():
        sub, cand = alive[several].nonzero(as_tuple=True)
        err = torch.full((several.numel(), n_cand), float("inf"), dtype=w.dtype)
        err[sub, cand] = _exact_errors(w, S, Z, cand, several[sub], grid.maxq)
        win[several] = err.min(dim=1).indices  # the first minimum in candidate order
    bad = (win == -2).nonzero().flatten()
    win[bad] = 0
    s_out, z_out = S.gather(1, win[:, None])[:, 0], Z.gather(1, win[:, None])[:, 0]
    if bad.numel():  # a non-finite weight: the reference on those rows (it keeps the min-max scale)
        s_out[bad], z_out[bad] = _scales._mse_search(
            w[bad], xmin[bad], xmax[bad], grid, scale[bad], zero[bad], mse_grid, max_shrink, norm, chunk_elems
        )
    return s_out, z_out


def install() -> None:
    """Make :func:`mse_search` the MSE search of :mod:`bitmosaic.algorithms.scales` (built on first use)."""
    _scales.set_fast_mse_search(mse_search)
