"""Layer Hessians ``H = 2/n * sum_i x_i x_i^T`` of the L2 output objective (GPTQ §2).

Accumulation is a running mean so that ``H`` has the same scale whatever the number of
calibration tokens; float32 by default, float64 on request.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

__all__ = ["HessianAccumulator", "damp_hessian", "DampingError"]


class DampingError(RuntimeError):
    """Raised when the damped Hessian stays non positive-definite after all retries."""


@dataclass
class HessianAccumulator:
    """Running ``2/n X^T X`` over inputs ``[..., in_features]``."""

    in_features: int
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    H: torch.Tensor = field(init=False)
    n: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.H = torch.zeros(self.in_features, self.in_features, dtype=self.dtype, device=self.device)

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(device=self.device, dtype=self.dtype)
        m = x.shape[0]
        if m == 0:
            return
        self.H.mul_(self.n / (self.n + m))
        self.n += m
        x = x * (2.0 / self.n) ** 0.5
        self.H.addmm_(x.T, x)


def damp_hessian(
    H: torch.Tensor, percdamp: float = 0.01, max_tries: int = 6
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Return ``(H_damped, L, percdamp_used)`` with ``L`` the lower Cholesky factor of ``H_damped``.

    Dead inputs (``H_jj == 0``) get ``H_jj = 1`` (their weights should be zeroed by the caller).
    ``H_damped = H + percdamp * mean(diag H) * I``; when Cholesky fails the damping is raised
    tenfold with a warning (never silently), up to ``max_tries`` times, then DampingError.
    """
    H = H.clone()
    diag = torch.diagonal(H)
    dead = diag == 0
    diag[dead] = 1.0
    mean_diag = diag.mean()
    pd = percdamp
    for _ in range(max_tries):
        Hd = H.clone()
        torch.diagonal(Hd).add_(pd * mean_diag)
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            return Hd, L, pd
        new = pd * 10 if pd > 0 else 1e-6
        warnings.warn(
            f"Hessian not positive-definite with damping {pd:g} x mean(diag); retrying with {new:g}",
            RuntimeWarning,
            stacklevel=2,
        )
        pd = new
    raise DampingError(
        f"Hessian is not positive-definite even with damping {pd:g} x mean(diag): the calibration "
        "inputs are degenerate; use more calibration samples or a larger --damp"
    )
