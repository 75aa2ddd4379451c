"""GPTQ (Frantar et al., 2023) with blocked lazy batch updates, as a pure function.

The algorithm (Babai paper, Algorithm 1; GPTQ paper Algorithm 1): visit the columns in a
processing order; quantize column ``i`` to ``q``, and move the error ``(w - q) / U_ii`` onto the
not-yet-quantized columns through row ``i`` of ``U = chol(H^-1)^T``.  Updates are applied lazily
(GPTQ §3, "lazy batch-updates"): rank one within an inner block of 32 columns, by one matrix
product onto the rest of the block of ``block_size`` columns, and by one more onto the columns
after the block (the same numbers up to summation order, far less memory traffic).  ``U`` and the
LDL pivots come from one Cholesky factorisation (:func:`bitmosaic.algorithms.hessian.gptq_factor`).

Group parameters:

- ``static_groups=True``: scales/zeros of every contiguous group are fixed from the original
  weights before any update (required by the Babai equivalence, whose lattice is fixed).
- otherwise, when the order keeps each contiguous group in one run (natural, GAR, and either
  reversed), a group's scale is computed from its *current* (error-updated) weights when the first
  of its columns is reached; ``g_idx`` stays the trivial ``j // g``.
- otherwise (act-order, min-pivot) groups are formed by processing position, as in the reference
  GPTQ act-order, and a non-trivial ``g_idx`` records each column's group.

``clip=False`` keeps unbounded integers ``round(w'/s) + z`` (the no-clipping lattice, Babai paper
§3.1, §4.4); the rounding error is then at most ``s/2`` per step, which gives the bound in
:func:`bitmosaic.algorithms.bounds.babai_bound`.

The per-column step is pluggable through a :class:`ColumnQuantizer`: ``fit`` gives a group's
scale/zero from its (current) weights, ``quantize`` maps one column to codes and to the value the
error is measured against.  The default :class:`IntColumnQuantizer` is the plain INT-k grid; the
DPQ paper's two-level INT4 -> FP8 -> 16-bit step (§3.1, Eqs. 7-11) is
:class:`bitmosaic.algorithms.dpq.DualPrecisionQuantizer`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..devices import release_host_memory
from ..formats.grid import IntGrid, dequantize_codes, quantize_codes
from ..formats.layout import default_g_idx, normalize_group_size, num_groups
from .hessian import gptq_factor, solver_threads
from .orders import groups_contiguous
from .scales import ScaleMethod, find_scale_zero, group_scale_zero
from .types import QuantResult

__all__ = ["ColumnQuantizer", "ColumnStep", "IntColumnQuantizer", "gptq_quantize"]

# One column: error-updated weights ``[out]`` -> ``(codes, dequantized)`` (a group's scale bound).
ColumnStep = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# Columns per rank-one inner block; the rest of a block gets their errors by one matrix product.
_INNER = 32

WIDE_SOLVE_MIN = 4096  # in_features from which GPTQ's large ops use the caller's threads


class ColumnQuantizer(Protocol):
    """The per-column quantization step of GPTQ (GPTQ paper Alg. 1, DPQ paper Alg. 1 lines 4-10).

    ``fit(cols)``: ``cols`` is ``[out, k]`` (one group's current weights) -> ``(scale, zero)``, each
    ``[out]``.  ``quantize(w, scale, zero)``: ``w`` is ``[out]`` (one error-updated column) ->
    ``(codes, dequantized)``, each ``[out]`` in ``w``'s float dtype; GPTQ propagates
    ``w - dequantized`` (Eq. 12 of the DPQ paper), so ``dequantized`` must be the weight that
    inference will use.

    Optional ``for_group(k) -> ColumnQuantizer``: the quantizer of group ``k`` (one per group, e.g.
    SFMP's per-block widths), used for that group's ``fit`` and columns.

    Optional ``column_step(scale, zero)``: ``quantize`` bound to one group's scale/zero (GPTQ calls
    it once per group and the returned function once per column), for quantizers that can precompute
    per group; it must return exactly what ``quantize`` returns.
    """

    def fit(self, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def quantize(
        self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class IntColumnQuantizer:
    """Uniform INT-k grid: ``find_scale_zero`` per group, ``round(w/s) + z`` per column (Eqs. 1-2)."""

    grid: IntGrid
    scale_method: ScaleMethod = "minmax"
    clip: bool = True

    def fit(self, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return find_scale_zero(cols, self.grid, self.scale_method)

    def fit_groups(self, W: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`fit` of every contiguous group of ``g`` columns of ``W`` -> ``[out, G]`` each (the
        same numbers; the fast MSE search takes all groups in one call, issue 74).  A subclass that
        overrides :meth:`fit` gets one :meth:`fit` per group."""
        if type(self).fit is not IntColumnQuantizer.fit:
            sz = [self.fit(W[:, k : k + g]) for k in range(0, W.shape[1], g)]
            return torch.stack([s for s, _ in sz], 1), torch.stack([z for _, z in sz], 1)
        return group_scale_zero(W, self.grid, g, self.scale_method)

    def quantize(
        self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q = quantize_codes(w, scale, zero, self.grid.maxq, clip=self.clip)
        return q, dequantize_codes(q, scale, zero)

    def column_step(self, scale: torch.Tensor, zero: torch.Tensor) -> ColumnStep:
        """:meth:`quantize` for one group, with in-place ops (the same arithmetic)."""
        maxq, clip = self.grid.maxq, self.clip

        def step(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q = torch.div(w, scale).round_().add_(zero)
            if clip:
                q.clamp_(0, maxq)
            return q, (q - zero).mul_(scale)

        return step


def _code_dtype(quantizer: ColumnQuantizer) -> torch.dtype | None:
    """``uint8`` where every code is an integer in ``[0, 255]`` (a clipped INT grid of up to 8 bits),
    else ``None`` (the working dtype: unclipped codes and other quantizers' codes)."""
    if isinstance(quantizer, IntColumnQuantizer) and quantizer.clip and quantizer.grid.maxq <= 255:
        return torch.uint8
    return None


def _column_step(quantizer: ColumnQuantizer, scale: torch.Tensor, zero: torch.Tensor) -> ColumnStep:
    make = getattr(quantizer, "column_step", None)
    if make is not None:
        return make(scale, zero)
    return lambda w: quantizer.quantize(w, scale, zero)


def _for_group(quantizer: ColumnQuantizer, k: int) -> ColumnQuantizer:
    """The quantizer of group ``k``: ``quantizer.for_group(k)`` when it has one (a width per row
    and group, SFMP's bit map), else ``quantizer`` itself."""
    make = getattr(quantizer, "for_group", None)
    return quantizer if make is None else make(k)


def _block_bounds(n: int, block_size: int, group_starts: list[int]) -> list[tuple[int, int]]:
    cuts = sorted(set(range(0, n, block_size)) | set(group_starts) | {n})
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    grid: IntGrid,
    group_size: int | None = None,
    *,
    perm: torch.Tensor | None = None,
    clip: bool = True,
    scale_method: ScaleMethod = "minmax",
    static_groups: bool = False,
    block_size: int = 128,
    percdamp: float = 0.01,
    dtype: torch.dtype | None = None,
    scales: torch.Tensor | None = None,
    zeros: torch.Tensor | None = None,
    quantizer: ColumnQuantizer | None = None,
    threads: int | None = 1,
    overwrite_hessian: bool = False,
) -> QuantResult:
    """Quantize ``W`` (``[out, in]``) against Hessian ``H`` (``[in, in]``).

    ``perm`` is the processing order (see :mod:`bitmosaic.algorithms.orders`); ``dtype`` is the
    working precision (default: float32, or float64 if ``W`` is float64).  Returns codes in the
    original column order with the damped Hessian used, the per-row sum of step errors
    ``sum_i ((w'_i - q_i) / U_ii)^2``, which equals ``(w - q)^T H_damped (w - q)``, and the LDL
    pivots ``D_kk = 1 / U_kk^2`` in processing order (``pivots``; see :func:`gptq_factor`).

    ``scales``/``zeros`` (``[out, G]``, contiguous groups) fix the grid in advance, as the
    scale searches of SSQR and HPTQ need; they imply ``static_groups``.

    ``quantizer`` replaces the per-column step (default ``IntColumnQuantizer(grid, scale_method,
    clip)``, in which case ``grid``, ``scale_method`` and ``clip`` are ignored); static groups
    without explicit ``scales`` are fitted with ``quantizer.fit`` on each contiguous group of the
    original weights.

    Runs on ``W``'s device.  On the CPU the solve (factorisation, column loop, block products) runs
    with ``threads`` threads, set once for the call and restored (``None``: the caller's setting;
    see :func:`bitmosaic.algorithms.hessian.solver_threads`); group fits (``quantizer.fit``, e.g.
    the vectorised MSE search: a few large ops) run in the caller's setting, and so do the
    factorisation and the between-block updates when ``H`` is at least ``WIDE_SOLVE_MIN`` wide
    (results then depend on the caller's thread count, as every multi-threaded BLAS result may).

    ``overwrite_hessian``: factorise ``H`` in its own memory (:func:`gptq_factor` with
    ``overwrite``; the same numbers, one ``[in, in]`` matrix less; ``H`` is garbage afterwards, and a
    factorisation that needs more damping raises
    :class:`~bitmosaic.algorithms.hessian.HessianSpentError` instead of retrying).  ``W`` is never
    modified.
    """
    if H.shape != (W.shape[1], W.shape[1]):
        raise ValueError(f"Hessian shape {tuple(H.shape)} does not match weight in_features {W.shape[1]}")
    if quantizer is None:
        quantizer = IntColumnQuantizer(grid, scale_method, clip)
    caller = torch.get_num_threads()

    wide = threads is not None and H.shape[0] >= WIDE_SOLVE_MIN

    def fit(cols: torch.Tensor, k: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        # k None: every group of cols at once ([out, G] each), None where the quantizer has no fit_groups
        many = getattr(quantizer, "fit_groups", None) if k is None else None
        if k is None and many is None:
            return None
        with solver_threads(caller, W.device):
            if k is None:
                sz = many(cols, normalize_group_size(group_size, W.shape[1]))
            else:
                sz = _for_group(quantizer, k).fit(cols)
        if wide and W.device.type == "cpu":  # memory: the fit's freed temporaries (devices.py)
            release_host_memory()
        return sz

    def large_op():
        # The factorisation and the between-block updates of a wide solve are a few large ops (a
        # 14336-wide factorisation: 30 s on one thread, 16 s on two), not a chain of small ones:
        # they run in the caller's threads; the column loop stays in ``threads``.
        return solver_threads(caller if wide else None, W.device)

    with solver_threads(threads, W.device):
        return _gptq(
            W, H, group_size, perm, static_groups, block_size, percdamp, dtype, scales, zeros, quantizer,
            fit, large_op, overwrite_hessian,
        )  # fmt: skip


def _gptq(W, H, group_size, perm, static_groups, block_size, percdamp, dtype, scales, zeros, quantizer, fit,
          large_op, overwrite):  # fmt: skip
    """:func:`gptq_quantize` in its threads: factorise, fix or plan the groups, solve block by block
    (:func:`_solve_block`), each block's errors onto the columns after it by one product (GPTQ §3)."""
    out, n = W.shape
    dtype = dtype or (torch.float64 if W.dtype == torch.float64 else torch.float32)
    dev = W.device
    W = W.to(dtype)  # read only: the working copy is WT below (memory: no clone of W)
    H = H.to(device=dev, dtype=dtype)
    dead = torch.diagonal(H) == 0  # dead inputs: their weights count as zero
    perm = torch.arange(n, device=dev) if perm is None else perm.to(dev)
    with large_op():
        Hd_diag, U, pivots, _ = gptq_factor(H, percdamp, perm, overwrite=overwrite)
    del H

    g = normalize_group_size(group_size, n)
    G = num_groups(n, group_size)
    static = _static_scales(W, dead, g, G, scales, zeros, static_groups, fit)
    static_groups = static is not None
    aligned = static_groups or groups_contiguous(perm, g)
    starts, pos_group = _group_starts(perm, g, aligned)

    WT = _working_copy(W, dead, perm)
    del W  # memory: WT is the working copy from here on
    codesT = torch.empty_like(WT, dtype=_code_dtype(quantizer))  # memory: 1 byte per code on a clipped grid
    groups = _GroupSteps(quantizer, fit, g, n, aligned, pos_group, set(starts), static,
                         WT.new_zeros(out, G), WT.new_zeros(out, G))  # fmt: skip
    errsum = WT.new_zeros(out)
    step: ColumnStep | None = None
    diagU = torch.diagonal(U)
    # A dynamic group's scale is computed from fully updated weights, so its first column must
    # start a block; static scales need no such cut (act-order would otherwise shred the blocks).
    for i1, i2 in _block_bounds(n, block_size, [] if static_groups else starts):
        E1, step = _solve_block(WT, U, diagU, i1, i2, codesT, groups, step)
        errsum += (E1 * E1).sum(dim=0)
        if i2 < n:  # lazy: the block's errors onto the columns after it
            with large_op():
                WT[i2:].addmm_(U[i1:i2, i2:].T, E1, alpha=-1)

    del WT, U, diagU, E1
    codes = _original_order(codesT, perm)
    del codesT
    return QuantResult(
        codes=codes,
        scales=groups.scales,
        zeros=groups.zeros,
        g_idx=_g_idx(n, g, perm, aligned),
        perm=perm,
        hessian_diag=Hd_diag,
        step_errors=errsum,
        pivots=pivots,
    )


def _static_scales(
    W, dead, g, G, scales, zeros, static_groups, fit
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fixed ``(scales, zeros)`` (``[out, G]``, in ``W``'s dtype) of static groups: the given
    ``scales``/``zeros`` (which imply static groups), or fitted on each contiguous group of the
    original weights (dead inputs zeroed) before any update; ``None`` for dynamic groups."""
    out, dtype, dev = W.shape[0], W.dtype, W.device
    if scales is not None:
        static_s = scales.to(device=dev, dtype=dtype)
        static_z = (zeros if zeros is not None else torch.zeros_like(scales)).to(device=dev, dtype=dtype)
        if static_s.shape != (out, G):
            raise ValueError(f"scales shape {tuple(static_s.shape)} != (out, groups) = ({out}, {G})")
        return static_s, static_z
    if not static_groups:
        return None
    if bool(dead.any()):
        got = fit(W.masked_fill(dead, 0), None)
    else:
        got = fit(W, None)
    if got is not None:
        return got
    static_s = W.new_empty(out, G)
    static_z = W.new_empty(out, G)
    for k in range(G):
        cols, dk = W[:, k * g : (k + 1) * g], dead[k * g : (k + 1) * g]
        if bool(dk.any()):
            cols = cols.masked_fill(dk, 0)
        static_s[:, k], static_z[:, k] = fit(cols, k)
    return static_s, static_z


def _group_starts(perm: torch.Tensor, g: int, aligned: bool) -> tuple[list[int], list[int]]:
    """``(starts, pos_group)``: the processing positions where a group's first column is reached,
    and the group (the index of its scale column) of the column at each position.  Aligned groups
    are the contiguous groups of the original order; otherwise groups are formed by processing
    position (reference GPTQ act-order)."""
    n = perm.numel()
    orig_group = (perm // g).tolist()  # contiguous group of the column at each processing position
    if aligned:
        starts = [0] + [i for i in range(1, n) if orig_group[i] != orig_group[i - 1]]
        return starts, orig_group  # scales indexed by original group
    return list(range(0, n, g)), [i // g for i in range(n)]


def _working_copy(W: torch.Tensor, dead: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``W`` in processing order, one weight column per row (every per-column op reads a
    contiguous vector), with the dead inputs' weights zeroed."""
    WT = W.T.index_select(0, perm)
    dead_p = dead.index_select(0, perm)
    if bool(dead_p.any()):
        WT[dead_p] = 0
    return WT


@dataclass
class _GroupSteps:
    """The groups' scales/zeros (``[out, G]``) and column steps, made when a group's first column
    is reached: static groups copy their fixed scales, dynamic ones fit the group's current
    (error-updated) weights."""

    quantizer: ColumnQuantizer
    fit: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
    g: int
    n: int
    aligned: bool
    pos_group: list[int]
    starts: set[int]
    static: tuple[torch.Tensor, torch.Tensor] | None
    scales: torch.Tensor
    zeros: torch.Tensor
    steps: dict[int, ColumnStep] = field(default_factory=dict)

    def step_at(self, col: int, WT: torch.Tensor) -> ColumnStep:
        """The column step of the group that starts at processing position ``col``."""
        k = self.pos_group[col]
        if k not in self.steps:
            if self.static is not None:
                self.scales[:, k], self.zeros[:, k] = self.static[0][:, k], self.static[1][:, k]
            else:  # the group's current weights: a block starts at col (see _gptq)
                glen = min(self.g, self.n - k * self.g) if self.aligned else min(self.g, self.n - col)
                self.scales[:, k], self.zeros[:, k] = self.fit(WT[col : col + glen].T.contiguous(), k)
            qk = _for_group(self.quantizer, k)
            self.steps[k] = _column_step(qk, self.scales[:, k].clone(), self.zeros[:, k].clone())
        return self.steps[k]


def _solve_block(WT, U, diagU, i1, i2, codesT, groups: _GroupSteps, step):
    """Quantize the columns ``i1 .. i2-1`` (processing order) of the working copy ``WT`` (GPTQ paper
    Alg. 1): each column ``i`` to ``q``, its error ``(w - q) / U_ii`` onto the later columns of the
    block through row ``i`` of ``U`` -- rank one within an inner block of ``_INNER`` columns, by one
    matrix product onto the rest of the block (GPTQ §3, lazy batch-updates).  Writes the codes into
    ``codesT``; returns the block's scaled errors ``E1`` (``[i2 - i1, out]``) and the column step in
    use at its end (``step``: the one in use at its start)."""
    W1, U1 = WT[i1:i2], U[i1:i2, i1:i2]
    E1 = torch.empty_like(W1)
    start_set = groups.starts
    for a in range(0, i2 - i1, _INNER):
        b = min(a + _INNER, i2 - i1)
        for i in range(a, b):
            col = i1 + i
            if col in start_set:
                step = groups.step_at(col, WT)
            w = W1[i]
            q, dq = step(w)
            codesT[col] = q
            torch.sub(w, dq, out=E1[i]).div_(diagU[col])
            if i + 1 < b:  # error onto the rest of the inner block, rank one
                W1[i + 1 : b].addr_(U1[i, i + 1 : b], E1[i], alpha=-1)
        if b < i2 - i1:  # lazy: the inner block's errors onto the rest of the block
            W1[b:].addmm_(U1[a:b, b:].T, E1[a:b], alpha=-1)
    return E1, step


def _original_order(codesT: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """The codes (``[n, out]`` in processing order) as int32 ``[out, n]`` in the original column
    order, in chunks (memory: no second ``[out, in]`` array of codes)."""
    n, out = codesT.shape
    codes = torch.empty(out, n, dtype=torch.int32, device=codesT.device)
    chunk = max(1, (1 << 22) // max(out, 1))
    for k in range(0, n, chunk):
        codes.T[perm[k : k + chunk]] = codesT[k : k + chunk].to(torch.int32)
    return codes


def _g_idx(n: int, g: int, perm: torch.Tensor, aligned: bool) -> torch.Tensor:
    """Each column's group: the trivial ``j // g`` for aligned groups, else by processing position."""
    if aligned:
        return default_g_idx(n, g, device=perm.device)
    g_idx = torch.empty(n, dtype=torch.long, device=perm.device)
    g_idx[perm] = torch.arange(n, device=perm.device) // g
    return g_idx
