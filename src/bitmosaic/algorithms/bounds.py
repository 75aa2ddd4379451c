"""Error measures and the no-clipping error bound (Babai paper, Theorem 5, App. C.1).

For GPTQ run on processing order ``p`` without clipping, every output row satisfies

    (w - w_hat)^T H (w - w_hat)  <=  1/4 * sum_k D_kk * s_k^2

with ``D`` the diagonal of the LDL decomposition of ``H`` permuted into Babai's basis order
(``p`` reversed) and ``s_k`` the scale of the weight at basis position ``k``.  ``D_kk`` is the
squared length of the ``k``-th Gram-Schmidt vector: the variance of input ``k`` left after
regressing on the inputs before it in basis order, i.e. on the inputs GPTQ processes *after* it.
The bound is tight (attained when every rounding lands half a step away).
"""

from __future__ import annotations

import torch

__all__ = ["ldl_diagonal", "babai_bound", "hessian_error", "relative_output_error"]


def ldl_diagonal(H: torch.Tensor) -> torch.Tensor:
    """``D`` of ``H = L D L^T`` (unit lower ``L``), via Cholesky: ``D = diag(chol(H))^2``."""
    return torch.diagonal(torch.linalg.cholesky(H)) ** 2


def babai_bound(H: torch.Tensor, weight_scales: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Per-row bound ``1/4 sum_k D_kk s_k^2`` for GPTQ on processing order ``perm``.

    ``weight_scales`` is ``[out, in]`` (each weight's scale, original column order); ``H`` is the
    damped Hessian the algorithm used.  GPTQ and Babai results carry ``D`` already, in processing
    order (``QuantResult.pivots``): the bound is then ``1/4 sum_k pivots[k] s[:, perm[k]]^2`` with
    no factorisation.
    """
    basis = perm.flip(0)
    D = ldl_diagonal(H[basis][:, basis].to(torch.float64))
    return 0.25 * (weight_scales.to(torch.float64)[:, basis] ** 2 * D[None, :]).sum(dim=1)


def hessian_error(W: torch.Tensor, Wq: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """Per-row ``(w - w_hat)^T H (w - w_hat)``."""
    E = (W - Wq).to(H.dtype)
    return ((E @ H) * E).sum(dim=1)


def relative_output_error(W: torch.Tensor, Wq: torch.Tensor, H: torch.Tensor) -> float:
    """``||X W^T - X W_hat^T||^2 / ||X W^T||^2`` for the ``X`` behind ``H = 2/n X^T X``."""
    num = hessian_error(W, Wq, H).sum()
    den = hessian_error(W, torch.zeros_like(W), H).sum()
    return float(num / den) if den > 0 else 0.0
