"""Babai's nearest plane algorithm on the Hessian lattice (Babai paper §3.2, App. A.2, Alg. 4).

The quantization problem ``min_q ||X (w - s*(q - z))||^2`` is a closest-vector problem on the
lattice with basis ``B = R diag(s)`` where ``H = R^T R`` (Theorem 1: any factor of ``H`` gives the
same geometry, so we take the upper-triangular Cholesky factor, which makes the QR step trivial).
Babai visits the basis from the last vector to the first; at step ``k`` the residual's component
along the ``k``-th Gram-Schmidt direction is ``y_k`` (the triangular frame makes that direction
``e_k`` with length ``R_kk s_k``), so the coefficient is ``round(y_k / (R_kk s_k))`` and the
lattice vector ``R[:, k] * s_k (q_k - z_k)`` is subtracted from the residual.

This is an independent implementation (no GPTQ code is shared): run back-to-front, GPTQ gives
the same integers (Theorem 4), which the test-suite checks.  No LLL reduction is done, as in the
paper (it is scale-dependent and incompatible with clipping, App. A.2).
"""

from __future__ import annotations

import torch

from ..formats.grid import IntGrid, dequantize_codes, quantize_codes
from .hessian import solver_threads

__all__ = ["babai_nearest_plane"]


def babai_nearest_plane(
    W: torch.Tensor,
    H: torch.Tensor,
    grid: IntGrid,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    basis_order: torch.Tensor | None = None,
    clip: bool = True,
    *,
    return_pivots: bool = False,
    threads: int | None = 1,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Integer codes ``[out, in]`` for target rows ``W`` on the lattice of (damped) ``H``.

    ``scales``/``zeros`` are per weight (``[out, in]``, fixed before the search); ``basis_order`` is
    the order of the basis vectors (Babai processes it from last to first).  ``return_pivots``: also
    return ``D_kk = R_kk^2`` in basis order, the squared Gram-Schmidt lengths of the Babai bound
    (Thm. 5), from the factorisation already done.  ``threads``: as in
    :func:`bitmosaic.algorithms.hessian.solver_threads` (one thread by default).
    """
    with solver_threads(threads, W.device):
        return _babai(W, H, grid, scales, zeros, basis_order, clip, return_pivots)


def _babai(W, H, grid, scales, zeros, basis_order, clip, return_pivots):
    out, n = W.shape
    dtype = torch.float64 if W.dtype == torch.float64 else torch.float32
    P = torch.arange(n, device=W.device) if basis_order is None else basis_order.to(W.device)
    Wp = W.to(dtype)[:, P]
    s = scales.to(dtype)[:, P]
    z = zeros.to(dtype)[:, P]
    R = torch.linalg.cholesky(H.to(dtype)[P][:, P]).T  # upper triangular, H_P = R^T R
    Y = Wp @ R.T  # target in the triangular frame: Y[o, i] = sum_j R[i, j] w[o, j]
    q = torch.empty_like(Wp)
    for k in range(n - 1, -1, -1):
        w_eff = Y[:, k] / R[k, k]
        qk = quantize_codes(w_eff, s[:, k], z[:, k], grid.maxq, clip=clip)
        q[:, k] = qk
        Y[:, : k + 1] -= dequantize_codes(qk, s[:, k], z[:, k])[:, None] * R[: k + 1, k][None, :]
    codes = torch.empty_like(q)
    codes[:, P] = q
    codes = codes.to(torch.int32)
    return (codes, torch.diagonal(R) ** 2) if return_pivots else codes
