"""Orthogonal rotations for QuaRot-style incoherence processing (Ashkboos et al., 2024): pure math.

- :func:`hadamard_matrix`: a Hadamard matrix ``H`` (entries ±1, ``H Hᵀ = n I``) of order ``n`` when
  one is known here: ``n = m · 2^k`` with ``m`` = 1, 2, or the order of a Paley construction
  (Paley I: ``q + 1`` for a prime ``q ≡ 3 mod 4``; Paley II: ``2(q + 1)`` for a prime
  ``q ≡ 1 mod 4``), e.g. 12, 20, 28, 36 (576 = 36·16, 1536 = 12·128, 14336 = 28·512).
  :func:`hadamard_factor` says which ``m`` (or ``None``: none known).
- :func:`hadamard_transform`: ``x @ H / sqrt(n)`` along the last dimension in ``O(n log n)`` for
  the power-of-two factor (a fast Walsh-Hadamard transform: reshapes into butterflies) plus one
  small ``m × m`` matmul.
- :func:`block_hadamard_transform`: the block-diagonal ``I ⊗ H_b / sqrt(b)``: each run of ``b``
  consecutive channels transformed on its own (the block-wise rotation of BRQ / micro-rotated GPTQ for
  microscaling formats: it mixes values only inside one scale block).
- :func:`random_orthogonal`: a Haar-random orthogonal matrix from a seed (QR of a Gaussian, signs fixed).
- :func:`orthogonal_matrix`: the ``[n, n]`` matrix a rotation ``kind`` uses (normalised, orthogonal).
- :func:`cayley_step`: one descent step on the orthogonal group by the Cayley transform (SpinQuant's
  Cayley SGD, Liu et al. 2024, Sec. 3.2, after Li et al. 2020): the rotation stays exactly orthogonal.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = [
    "NoHadamardError",
    "cayley_step",
    "hadamard_factor",
    "hadamard_matrix",
    "hadamard_transform",
    "block_hadamard_transform",
    "orthogonal_matrix",
    "random_orthogonal",
    "random_signs",
]


class NoHadamardError(ValueError):
    """No Hadamard matrix of this order is known here."""


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    return all(q % d for d in range(2, math.isqrt(q) + 1))


def _paley_kind(m: int) -> str | None:
    """Which Paley construction gives order ``m`` from a prime field (``None``: neither)."""
    if m % 4 == 0 and _is_prime(m - 1) and (m - 1) % 4 == 3:
        return "I"
    if m % 4 == 0 and m % 2 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return "II"
    return None


def hadamard_factor(n: int) -> int | None:
    """The smallest ``m`` with ``n = m · 2^k`` and a known Hadamard matrix of order ``m`` (1, 2 or a
    Paley order), or ``None`` when none is known (Hadamard matrices exist only for 1, 2 and
    multiples of 4)."""
    if n < 1:
        return None
    m = n
    candidates = []
    while True:
        if m in (1, 2) or _paley_kind(m):
            candidates.append(m)
        if m % 2:
            break
        m //= 2
    return min(candidates) if candidates else None


def _legendre(q: int) -> list[int]:
    """χ(a) for a in GF(q), q prime: 0, 1 (square) or -1."""
    squares = {(a * a) % q for a in range(1, q)}
    return [0 if a == 0 else (1 if a in squares else -1) for a in range(q)]


@functools.lru_cache(maxsize=32)
def _paley(m: int) -> torch.Tensor:
    kind = _paley_kind(m)
    if kind == "I":  # q ≡ 3 mod 4: Jacobsthal Q is antisymmetric; H = I + [[0, 1ᵀ], [-1, Q]]
        q = m - 1
        chi = _legendre(q)
        Q = torch.tensor([[chi[(j - i) % q] for j in range(q)] for i in range(q)], dtype=torch.float64)
        S = torch.zeros(m, m, dtype=torch.float64)
        S[0, 1:] = 1
        S[1:, 0] = -1
        S[1:, 1:] = Q
        return S + torch.eye(m, dtype=torch.float64)
    if kind == "II":  # q ≡ 1 mod 4: Q symmetric; C = [[0, 1ᵀ], [1, Q]], each 0 -> A, ±1 -> ±B
        q = m // 2 - 1
        chi = _legendre(q)
        Q = torch.tensor([[chi[(j - i) % q] for j in range(q)] for i in range(q)], dtype=torch.float64)
        C = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        C[0, 1:] = 1
        C[1:, 0] = 1
        C[1:, 1:] = Q
        A = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        B = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        eye = torch.eye(q + 1, dtype=torch.float64)
        return torch.kron(C, B) + torch.kron(eye, A)
    raise NoHadamardError(f"no Paley construction of order {m}")


def _small(m: int) -> torch.Tensor:
    if m == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    if m == 2:
        return torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    return _paley(m)


def _require_factor(n: int) -> int:
    m = hadamard_factor(n)
    if m is None:
        raise NoHadamardError(
            f"no Hadamard matrix of order {n} is known here (known: m·2^k with m = 1, 2 or a Paley order "
            "such as 12, 20, 28, 36); use --rotate random (a random orthogonal matrix) or --rotate none"
        )
    return m


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """An unnormalised Hadamard matrix of order ``n`` (±1 entries, ``H Hᵀ = n I``):
    ``kron(H_m, H_{2^k})`` with the Sylvester ``H_{2^k}``; :class:`NoHadamardError` when none is known."""
    m = _require_factor(n)
    H = _small(m)
    p = n // m
    S = torch.ones(1, 1, dtype=torch.float64)
    while S.shape[0] < p:
        S = torch.cat([torch.cat([S, S], 1), torch.cat([S, -S], 1)], 0)
    return torch.kron(H, S).to(dtype)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """``x @ hadamard_matrix(n) / sqrt(n)`` over the last dimension (an orthogonal map), computed as a
    fast Walsh-Hadamard transform over the power-of-two factor and one ``m × m`` matmul; same dtype
    (16-bit inputs are transformed in float32: ``log2 n`` rounds of 16-bit sums would lose bits)."""
    n = x.shape[-1]
    m = _require_factor(n)
    p = n // m
    shape = x.shape
    work = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    y = x.to(work).reshape(-1, m, p)  # index i = a·p + b for kron(H_m, H_p)
    h = 1
    while h < p:  # butterflies: (y[.., j], y[.., j + h]) -> (sum, difference), blocks of 2h
        y = y.reshape(-1, m, p // (2 * h), 2, h)
        a, b = y[:, :, :, 0, :], y[:, :, :, 1, :]
        y = torch.stack((a + b, a - b), dim=3)
        h *= 2
    y = y.reshape(-1, m, p)
    if m > 1:  # (x @ kron(A, B)) = Aᵀ X B with X = x as [m, p]
        A = _small(m).to(device=x.device, dtype=y.dtype)
        y = torch.einsum("ac,rap->rcp", A, y)
    return (y.reshape(shape) / math.sqrt(n)).to(x.dtype)


def block_hadamard_transform(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x @ kron(I, hadamard_matrix(block)) / sqrt(block)`` over the last dimension: every ``block``
    consecutive channels rotated on their own (orthogonal; ``block`` must divide the width)."""
    n = x.shape[-1]
    if block < 1 or n % block:
        raise ValueError(f"a block rotation of {block} needs a width divisible by it, got {n}")
    return hadamard_transform(x.reshape(*x.shape[:-1], n // block, block)).reshape(x.shape)


def random_orthogonal(n: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A Haar-random orthogonal ``[n, n]`` matrix from ``seed`` (QR of a float64 Gaussian on the CPU,
    column signs fixed by ``diag(R) > 0``, so the same seed gives the same matrix)."""
    g = torch.Generator().manual_seed(int(seed))
    A = torch.randn(n, n, generator=g, dtype=torch.float64)
    Q, R = torch.linalg.qr(A)
    Q = Q * torch.sign(torch.diagonal(R)).where(torch.diagonal(R) != 0, torch.ones(()))[None, :]
    return Q.to(dtype)


def random_signs(n: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``n`` random ±1 from ``seed`` (QuaRot's randomised Hadamard: ``diag(s) H``)."""
    g = torch.Generator().manual_seed(int(seed))
    return (torch.randint(0, 2, (n,), generator=g) * 2 - 1).to(dtype)


def orthogonal_matrix(
    kind: str, n: int, seed: int, signs: bool = True, block: int | None = None
) -> torch.Tensor:
    """The normalised orthogonal ``[n, n]`` (float64) of a rotation ``kind``: ``"hadamard"``:
    ``diag(s) H / sqrt(n)`` with random signs ``s`` from ``seed`` (``signs=False``: ``H / sqrt(n)``);
    ``"block"``: the same with the block-diagonal ``kron(I, H_block) / sqrt(block)``;
    ``"random"``: a Haar-random orthogonal matrix (:func:`random_orthogonal`)."""
    if kind == "block":
        if block is None or n % block:
            raise ValueError(f"a block rotation of {block} needs a width divisible by it, got {n}")
        H = torch.kron(torch.eye(n // block, dtype=torch.float64), hadamard_matrix(block) / math.sqrt(block))
        return random_signs(n, seed)[:, None] * H if signs else H
    if kind == "hadamard":
        H = hadamard_matrix(n) / math.sqrt(n)
        return random_signs(n, seed)[:, None] * H if signs else H
    if kind == "random":
        return random_orthogonal(n, seed)
    raise ValueError(f"unknown rotation {kind!r}; use none, hadamard or random")


def cayley_step(X: torch.Tensor, G: torch.Tensor, lr: float) -> torch.Tensor:
    """One Cayley SGD step from the orthogonal ``X`` (``[n, n]``) against the Euclidean gradient ``G``
    of the loss at ``X`` (Li et al. 2020, Alg. 1, the optimizer SpinQuant uses, Sec. 3.2): with the
    skew-symmetric ``W = (G Xᵀ - X Gᵀ) / 2`` (``W X`` is the Riemannian gradient at ``X``) and the step
    ``a = min(lr, 1 / ||W||₁)`` (Li et al. cap it so: the step stays where the Cayley transform is a
    good descent curve, whatever the gradient's scale), ``X' = (I + a/2 W)⁻¹ (I - a/2 W) X``.  ``X'`` is
    orthogonal to rounding (the Cayley transform of a skew matrix is orthogonal), and to first order
    ``X' = X - a W X``, a descent direction: ``<G, W X> = ||W||² >= 0``.  Li et al. solve the same step
    by a fixed-point iteration; here it is one solve in float64."""
    Xd, Gd = X.double(), G.double()
    W = 0.5 * (Gd @ Xd.T - Xd @ Gd.T)
    norm1 = float(W.abs().sum(dim=0).max())  # the induced 1-norm: the largest column sum
    a = min(float(lr), 1.0 / (norm1 + 1e-8))
    eye = torch.eye(X.shape[0], dtype=torch.float64, device=X.device)
    return torch.linalg.solve(eye + 0.5 * a * W, (eye - 0.5 * a * W) @ Xd).to(X.dtype)
