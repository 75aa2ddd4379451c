"""GPTQ (Frantar et al., 2023) with blocked lazy batch updates, as a pure function.

The algorithm (Babai paper, Algorithm 1; GPTQ paper Algorithm 1): visit the columns in a
processing order; quantize column ``i`` to ``q``, and move the error ``(w - q) / U_ii`` onto the
not-yet-quantized columns through row ``i`` of ``U = chol(H^-1)^T``.  Updates to columns outside
the current block are applied lazily once per block (identical numbers, better memory traffic).

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

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from ..formats.grid import IntGrid, dequantize_codes, quantize_codes
from ..formats.layout import default_g_idx, normalize_group_size, num_groups
from .hessian import damp_hessian
from .orders import groups_contiguous
from .rtn import QuantResult
from .scales import ScaleMethod, find_scale_zero

__all__ = ["ColumnQuantizer", "IntColumnQuantizer", "gptq_quantize"]


class ColumnQuantizer(Protocol):
    """The per-column quantization step of GPTQ (GPTQ paper Alg. 1, DPQ paper Alg. 1 lines 4-10).

    ``fit(cols)``: ``cols`` is ``[out, k]`` (one group's current weights) -> ``(scale, zero)``, each
    ``[out]``.  ``quantize(w, scale, zero)``: ``w`` is ``[out]`` (one error-updated column) ->
    ``(codes, dequantized)``, each ``[out]`` in ``w``'s float dtype; GPTQ propagates
    ``w - dequantized`` (Eq. 12 of the DPQ paper), so ``dequantized`` must be the weight that
    inference will use.
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

    def quantize(
        self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q = quantize_codes(w, scale, zero, self.grid.maxq, clip=self.clip)
        return q, dequantize_codes(q, scale, zero)


@contextmanager
def _single_thread():
    """The per-column steps are tiny vector ops: running them on one thread avoids OpenMP
    fork/join overhead, which dominates them (and explodes on a busy machine)."""
    old = torch.get_num_threads()
    if old == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


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
) -> QuantResult:
    """Quantize ``W`` (``[out, in]``) against Hessian ``H`` (``[in, in]``).

    ``perm`` is the processing order (see :mod:`bitmosaic.algorithms.orders`); ``dtype`` is the
    working precision (default: float32, or float64 if ``W`` is float64).  Returns codes in the
    original column order with the damped Hessian used and the per-row sum of step errors
    ``sum_i ((w'_i - q_i) / U_ii)^2``, which equals ``(w - q)^T H_damped (w - q)``.

    ``scales``/``zeros`` (``[out, G]``, contiguous groups) fix the grid in advance, as the
    scale searches of SSQR and HPTQ need; they imply ``static_groups``.

    ``quantizer`` replaces the per-column step (default ``IntColumnQuantizer(grid, scale_method,
    clip)``, in which case ``grid``, ``scale_method`` and ``clip`` are ignored); static groups
    without explicit ``scales`` are fitted with ``quantizer.fit`` on each contiguous group of the
    original weights.
    """
    out, n = W.shape
    if H.shape != (n, n):
        raise ValueError(f"Hessian shape {tuple(H.shape)} does not match weight in_features {n}")
    dtype = dtype or (torch.float64 if W.dtype == torch.float64 else torch.float32)
    if quantizer is None:
        quantizer = IntColumnQuantizer(grid, scale_method, clip)
    W = W.to(dtype).clone()
    H = H.to(dtype)
    dead = torch.diagonal(H) == 0
    W[:, dead] = 0
    Hd, _, _ = damp_hessian(H, percdamp)

    g = normalize_group_size(group_size, n)
    G = num_groups(n, group_size)
    perm = torch.arange(n, device=W.device) if perm is None else perm.to(W.device)
    if scales is not None:
        static_groups = True
        static_s = scales.to(dtype)
        static_z = (zeros if zeros is not None else torch.zeros_like(scales)).to(dtype)
        if static_s.shape != (out, num_groups(n, group_size)):
            raise ValueError(f"scales shape {tuple(static_s.shape)} != (out, groups) = ({out}, {G})")
    elif static_groups:
        static_s = W.new_empty(out, G)
        static_z = W.new_empty(out, G)
        for k in range(G):
            static_s[:, k], static_z[:, k] = quantizer.fit(W[:, k * g : (k + 1) * g])
    aligned = static_groups or groups_contiguous(perm, g)

    # Work in processing order.
    Wp = W[:, perm]
    Hp = Hd[perm][:, perm]
    Lp = torch.linalg.cholesky(Hp)
    U = torch.linalg.cholesky(torch.cholesky_inverse(Lp), upper=True)  # GPTQ's Hinv

    orig_group = perm // g  # contiguous group of the column at each processing position
    if aligned:
        starts = [0] + [i for i in range(1, n) if orig_group[i] != orig_group[i - 1]]
        pos_group = orig_group  # scales indexed by original group
    else:
        starts = list(range(0, n, g))
        pos_group = torch.arange(n, device=W.device) // g
    start_set = set(starts)
    pos_group_list = pos_group.tolist()

    scales = W.new_zeros(out, G)
    zeros = W.new_zeros(out, G)
    codes_p = torch.empty(out, n, dtype=dtype, device=W.device)
    errsum = W.new_zeros(out)
    s_col = z_col = None
    # A dynamic group's scale is computed from fully updated weights, so its first column must
    # start a block; static scales need no such cut (act-order would otherwise shred the blocks).
    for i1, i2 in _block_bounds(n, block_size, [] if static_groups else starts):
        W1 = Wp[:, i1:i2].clone()
        E1 = torch.empty_like(W1)
        U1 = U[i1:i2, i1:i2]
        with _single_thread():
            for i in range(i2 - i1):
                col = i1 + i
                k = pos_group_list[col]
                if col in start_set:
                    if static_groups:
                        scales[:, k], zeros[:, k] = static_s[:, k], static_z[:, k]
                    else:
                        # group columns are W1[:, i:i+len] (a block never crosses a group start)
                        glen = min(g, n - k * g) if aligned else min(g, n - col)
                        cols = torch.cat([W1[:, i:], Wp[:, i2:]], dim=1)[:, :glen]
                        scales[:, k], zeros[:, k] = quantizer.fit(cols)
                    s_col, z_col = scales[:, k], zeros[:, k]
                w = W1[:, i]
                q, dq = quantizer.quantize(w, s_col, z_col)
                codes_p[:, col] = q
                d = U1[i, i]
                err = (w - dq) / d
                errsum += err * err
                W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
                E1[:, i] = err
        Wp[:, i2:] -= E1 @ U[i1:i2, i2:]

    codes = torch.empty_like(codes_p)
    codes[:, perm] = codes_p
    if aligned:
        g_idx = default_g_idx(n, g, device=W.device)
    else:
        g_idx = torch.empty(n, dtype=torch.long, device=W.device)
        g_idx[perm] = pos_group
    return QuantResult(
        codes=codes.to(torch.int32),
        scales=scales,
        zeros=zeros,
        g_idx=g_idx,
        perm=perm,
        hessian=Hd,
        step_errors=errsum,
    )
