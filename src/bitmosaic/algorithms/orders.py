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
    return torch.cat([within[int(k)] for k in group_rank])


def min_pivot_sequence(H: torch.Tensor) -> torch.Tensor:
    """Pivot sequence of the min-pivot LDL of ``H`` (Babai basis order), float64 internally.

    Left-looking pivoted Cholesky: ``O(n^3)`` like the factorisation GPTQ does anyway.
    """
    A = H.to(torch.float64)
    n = A.shape[0]
    L = torch.zeros(n, n, dtype=torch.float64, device=A.device)
    d = torch.diagonal(A).clone()  # current Schur-complement diagonal
    taken = torch.zeros(n, dtype=torch.bool, device=A.device)
    seq = torch.empty(n, dtype=torch.long, device=A.device)
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=A.device)
    for k in range(n):
        j = int(torch.argmin(torch.where(taken, inf, d)))
        seq[k] = j
        piv = d[j]
        if piv <= 0:  # numerically singular remainder: keep the remaining order by diagonal
            rest = (~taken).nonzero().flatten()
            rest = rest[rest != j]
            rest = rest[torch.argsort(torch.diagonal(A)[rest], stable=True)]
            seq[k + 1 :] = rest
            break
        col = A[:, j] - L[:, :k] @ L[j, :k]
        col = col / piv.sqrt()
        col[taken] = 0
        col[j] = piv.sqrt()
        L[:, k] = col
        taken[j] = True
        d = d - col * col
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
