"""Quantization orders: permutations of the input columns that GPTQ visits front to back.

Every function here returns a *processing order* for GPTQ run front-to-back, the convention in
which the good orders come first; ``direction="back"`` (:func:`apply_direction`) reverses it.
Babai's nearest plane algorithm visits its basis from the last vector to the first, so
GPTQ on processing order ``p`` equals Babai on basis order ``p.flip(0)`` (Babai paper, Thm. 4
and App. B); in Babai's terms act-order is the *ascending* Hessian diagonal (paper §4.5).

- ``natural``: ``0..n-1``.
- ``act``: GPTQ's act-order, ``diag(H)`` descending (stable).
- ``gar``: Group-Aware Reordering (DPQ paper §3.3): columns sorted by ``diag(H)`` descending
  *within* each contiguous group, groups sorted by their largest ``diag(H)``.  Each group stays
  contiguous, so its scale is one contiguous run and inference needs no ``g_idx`` gather.
- ``min-pivot``: the Babai paper's Algorithm 3: a pivoted LDL (Cholesky) of ``H`` that always
  takes the *smallest* remaining Schur-complement pivot, i.e. Gram-Schmidt taking the shortest
  residual basis vector next; that pivot sequence is Babai's basis order, so GPTQ processes it
  reversed.
"""

from __future__ import annotations

from typing import Literal

import torch

from ..formats.layout import normalize_group_size
from .hessian import solver_threads

__all__ = [
    "OrderName",
    "ORDERS",
    "natural_order",
    "act_order",
    "gar_order",
    "min_pivot_order",
    "min_pivot_sequence",
    "apply_direction",
    "make_order",
    "groups_contiguous",
]

OrderName = Literal["natural", "act", "gar", "min-pivot"]
ORDERS: tuple[str, ...] = ("natural", "act", "gar", "min-pivot")


def natural_order(H: torch.Tensor) -> torch.Tensor:
    return torch.arange(H.shape[0], device=H.device)


def act_order(H: torch.Tensor) -> torch.Tensor:
    return torch.argsort(torch.diagonal(H), descending=True, stable=True)


def gar_order(H: torch.Tensor, group_size: int | None) -> torch.Tensor:
    n = H.shape[0]
    g = normalize_group_size(group_size, n)
    d = torch.diagonal(H)
    starts = list(range(0, n, g))
    within = [s + torch.argsort(d[s : s + g], descending=True, stable=True) for s in starts]
    group_key = torch.stack([d[s : s + g].max() for s in starts])
    group_rank = torch.argsort(group_key, descending=True, stable=True)
    return torch.cat([within[k] for k in group_rank.tolist()])


def min_pivot_sequence(H: torch.Tensor, block_size: int = 64, threads: int | None = 1) -> torch.Tensor:
    """Pivot sequence of the min-pivot LDL of ``H`` (Babai basis order), float64 internally.

    Babai paper Algorithm 3: Cholesky with *minimum* diagonal pivoting (ties: lowest index).
    Blocked like LAPACK's pivoted ``pstrf``: a panel of ``block_size`` columns is computed
    left-looking against the panel only, then the Schur complement of the remaining columns is
    formed by one matrix product (``~n^3/3`` flops in BLAS-3 instead of ``n`` growing
    matrix-vector products).  Every column and every pivot update ``d -= col^2`` is the unblocked
    algorithm's up to the summation order of the Schur complement.  When a pivot is ``<= 0``
    (numerically singular remainder) the columns left follow in ascending ``diag(H)`` (stable).
    Runs on ``H``'s device with one host sync per panel; ``threads`` as in
    :func:`bitmosaic.algorithms.hessian.solver_threads`.
    """
    with solver_threads(threads, H.device):
        return _min_pivot(H, block_size)


def _min_pivot(H: torch.Tensor, block_size: int) -> torch.Tensor:
    # B[j] = column j of the Schur complement of the remaining columns (rows are contiguous)
    B = H.to(torch.float64).T.contiguous()
    n = B.shape[0]
    dev = B.device
    diag0 = torch.diagonal(B).clone()
    d = diag0.clone()  # Schur-complement diagonal of the remaining columns
    idx = torch.arange(n, device=dev)  # original index of each remaining column (ascending)
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=dev)
    seq = torch.empty(n, dtype=torch.long, device=dev)
    k = 0
    while k < n:
        m = idx.numel()
        kb = min(block_size, m)
        PT = B.new_zeros(kb, m)  # the panel's columns of L, one per row
        avail = torch.ones(m, dtype=torch.bool, device=dev)
        piv = B.new_empty(kb)
        for t in range(kb):
            jl = torch.argmin(torch.where(avail, d, inf)).reshape(1)  # first minimum: lowest index
            piv[t : t + 1] = d.index_select(0, jl)
            seq[k + t : k + t + 1] = idx.index_select(0, jl)
            r = piv[t].sqrt()
            col = B.index_select(0, jl)[0]
            if t:
                col = col - PT[:t].T @ PT[:t].index_select(1, jl)[:, 0]
            col = (col / r).masked_fill_(~avail, 0.0).index_copy_(0, jl, r.reshape(1))  # no sync
            PT[t] = col
            avail.index_fill_(0, jl, False)
            d = d - col * col
        bad = (piv <= 0).nonzero()
        if bad.numel():  # singular remainder from the first non-positive pivot on
            t0 = k + int(bad[0, 0]) + 1
            taken = torch.zeros(n, dtype=torch.bool, device=dev)
            taken[seq[:t0]] = True
            rest = (~taken).nonzero().flatten()
            seq[t0:] = rest[torch.argsort(diag0[rest], stable=True)]
            return seq
        keep = avail.nonzero().flatten()
        Pk = PT.index_select(1, keep)
        B = B.index_select(0, keep).index_select(1, keep).addmm_(Pk.T, Pk, alpha=-1)
        d, idx = d.index_select(0, keep), idx.index_select(0, keep)
        k += kb
    return seq


def min_pivot_order(H: torch.Tensor) -> torch.Tensor:
    return min_pivot_sequence(H).flip(0)


def apply_direction(perm: torch.Tensor, direction: str) -> torch.Tensor:
    if direction == "front":
        return perm
    if direction == "back":
        return perm.flip(0)
    raise ValueError(f"direction must be 'front' or 'back', got {direction!r}")


def make_order(
    H: torch.Tensor, order: str = "natural", group_size: int | None = None, direction: str = "front"
) -> torch.Tensor:
    """The processing permutation for ``order`` and ``direction`` (see module doc)."""
    if order == "natural":
        perm = natural_order(H)
    elif order == "act":
        perm = act_order(H)
    elif order == "gar":
        perm = gar_order(H, group_size)
    elif order in ("min-pivot", "min_pivot", "minpivot"):
        perm = min_pivot_order(H)
    else:
        raise ValueError(f"unknown order {order!r}; choose one of {', '.join(ORDERS)}")
    return apply_direction(perm, direction)


def groups_contiguous(perm: torch.Tensor, group_size: int | None) -> bool:
    """True when every contiguous column group occupies one contiguous run of ``perm``."""
    n = perm.numel()
    g = normalize_group_size(group_size, n)
    grp = (perm // g).cpu()
    changes = int((grp[1:] != grp[:-1]).sum()) if n > 1 else 0
    return changes == -(-n // g) - 1
