"""Layer Hessians ``H = 2/n * sum_i x_i x_i^T`` of the L2 output objective (GPTQ §2), their damped
factorisations, and the thread setting of the sequential solves that use them.

Accumulation is a running mean so that ``H`` has the same scale whatever the number of
calibration tokens; float32 by default, float64 on request.  :func:`damp_hessian` and
:func:`gptq_factor` share one damping schedule: every failed factorisation raises the damping
tenfold with a warning, then :class:`DampingError`.
"""

from __future__ import annotations

import warnings
from collections.abc import Container, Iterator
from contextlib import contextmanager

import torch

__all__ = ["HessianAccumulator", "damp_hessian", "gptq_factor", "solver_threads", "DampingError",
           "HessianSpentError"]


class DampingError(RuntimeError):
    """Raised when the damped Hessian stays non positive-definite after all retries."""


class HessianSpentError(RuntimeError):
    """A factorisation in the Hessian's own memory (``gptq_factor(overwrite=True)``) failed and
    would need the matrix again to retry with more damping: recompute it and solve with a kept one."""


@contextmanager
def solver_threads(threads: int | None, device: torch.device | str = "cpu") -> Iterator[None]:
    """Run one sequential solve (GPTQ, Babai, min-pivot) with ``threads`` CPU threads, set once.

    Why: those solves are long chains of small dependent ops, and many small ops open
    an OpenMP region anyway (``torch.round`` goes parallel above 2048 elements, MKL threads
    ``ger``/``gemm``/``potri`` by its own rules).  libgomp's barriers wait for every thread of the
    team, so whenever another process holds a core each region costs a scheduler slice: measured
    here on 2 shared cores, ~8 ms for a 2049-element ``round_`` (2000x), 1.4-23 s for a
    ``cholesky_inverse`` that takes 4-55 ms on one thread, and 35-50 s for a 4096x4096 GPTQ that
    takes 5 s on one thread.  Toggling ``set_num_threads`` per block only moved the stalls to the
    factorisations and block products.  ``None`` keeps the caller's setting (e.g. a dedicated
    many-core machine with ``OMP_WAIT_POLICY=PASSIVE``); non-CPU devices are left alone.
    """
    old = torch.get_num_threads()
    if threads is None or torch.device(device).type != "cpu" or old == threads:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class HessianAccumulator:
    """Running ``2/n X^T X`` over inputs ``[..., in_features]``.

    Only the upper triangle is accumulated, one block row ``H[i:i+B, i:] += x_iᵀ x[:, i:]`` at a
    time: ``n²/2 + nB/2`` multiply-adds per token instead of ``n²`` (measured 18% less time at
    n = 576 and 43% less at n = 1536).  :attr:`H` mirrors it into the full symmetric matrix when
    read, in place: the accumulator holds one ``n x n`` matrix (0.8 GB at n = 14336 in float32),
    never a second one.  The matrix is a normal tensor even when ``add`` runs under
    ``torch.inference_mode``, so callers may use it anywhere.
    """

    def __init__(
        self, in_features: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        self.in_features = in_features
        self.dtype = dtype
        self.device = device
        self.n = 0
        with torch.inference_mode(False):  # a normal tensor: usable (and mirrored) outside that mode
            self._upper = torch.zeros(in_features, in_features, dtype=dtype, device=device)
        self._mirrored = False
        self._block = 256 if in_features >= 1024 else 128

    @property
    def H(self) -> torch.Tensor:
        """The symmetric ``[in, in]`` Hessian so far: the accumulator's own matrix, its lower triangle
        overwritten by the upper one's mirror (``add`` never reads below the diagonal blocks, and
        a later ``add`` mirrors again on the next read).  The values equal ``triu(U) + triu(U, 1).T``
        bit for bit, signs of zeros included (``+ 0.0`` turns ``-0.0`` into ``+0.0`` as that sum does)."""
        if not self._mirrored:
            U, n, B = self._upper, self.in_features, self._block
            with torch.no_grad():
                for i in range(0, n, B):
                    D = U[i : i + B, i : i + B]
                    low = torch.ones_like(D, dtype=torch.bool).tril_(-1)
                    D[low] = D.T[low]
                    U[i + B :, i : i + B] = U[i : i + B, i + B :].T
                U.add_(0.0)
            self._mirrored = True
        return self._upper

    def take(self) -> torch.Tensor:
        """:attr:`H`, handed over: the accumulator keeps no reference and takes no more tokens."""
        H = self.H
        self._upper = None
        return H

    @property
    def block_starts(self) -> range:
        """First rows of the block rows :meth:`add` updates one at a time."""
        return range(0, self.in_features, self._block)

    def block_row(self, k: int) -> torch.Tensor:
        """A view of block row ``k`` of the accumulated upper triangle (``H[i:i+B, i:]`` unscaled by
        the mirror): what :meth:`add` with ``blocks`` computes, for sharing between processes."""
        i = self.block_starts[k]
        self._mirrored = False
        return self._upper[i : i + self._block, i:]

    def add(self, x: torch.Tensor, blocks: Container[int] | None = None) -> None:
        """Add the tokens of ``x``; ``blocks``: compute only these block rows (the others keep their
        old values times the running-mean factor), each bit for bit what a full ``add`` gives."""
        x = x.reshape(-1, x.shape[-1]).to(device=self.device, dtype=self.dtype)
        m = x.shape[0]
        if m == 0:
            return
        self._mirrored = False
        keep = self.n / (self.n + m)
        self.n += m
        alpha = 2.0 / self.n  # scaled in the product: no scaled copy of x
        B = self._block
        for k, i in enumerate(range(0, self.in_features, B)):
            row = self._upper[i : i + B, i:]
            row.mul_(keep)  # the block rows only: below them the mirror writes (half the traffic of a
            if blocks is None or k in blocks:  # thin expert's many small adds)
                row.addmm_(x[:, i : i + B].T, x[:, i:], alpha=alpha)


def _damping_tries(H: torch.Tensor, percdamp: float, max_tries: int, stacklevel: int):
    """Yield ``(H_damped, percdamp)`` with the damping raised tenfold (and a warning) after each
    failed try; the caller returns on success.  Raises DampingError when the tries run out."""
    H = H.clone()
    diag = torch.diagonal(H)
    diag[diag == 0] = 1.0  # dead inputs
    mean_diag = diag.mean()
    pd = percdamp
    for _ in range(max_tries):
        Hd = H.clone()
        torch.diagonal(Hd).add_(pd * mean_diag)
        yield Hd, pd
        new = pd * 10 if pd > 0 else 1e-6
        warnings.warn(
            f"Hessian not positive-definite with damping {pd:g} x mean(diag); retrying with {new:g}",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )
        pd = new
    raise DampingError(
        f"Hessian is not positive-definite even with damping {pd:g} x mean(diag): the calibration "
        "inputs are degenerate; use more calibration samples or a larger --damp"
    )


def damp_hessian(
    H: torch.Tensor, percdamp: float = 0.01, max_tries: int = 6
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Return ``(H_damped, L, percdamp_used)`` with ``L`` the lower Cholesky factor of ``H_damped``.

    Dead inputs (``H_jj == 0``) get ``H_jj = 1`` (their weights should be zeroed by the caller).
    ``H_damped = H + percdamp * mean(diag H) * I``; when Cholesky fails the damping is raised
    tenfold with a warning (never silently), up to ``max_tries`` times, then DampingError.
    """
    for Hd, pd in _damping_tries(H, percdamp, max_tries, stacklevel=2):
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            return Hd, L, pd
    raise AssertionError("unreachable")  # _damping_tries raises


def _tril_inverse_(L: torch.Tensor, base: int = 128) -> torch.Tensor:
    """Invert the lower-triangular ``L`` in place, by recursive 2x2 blocks (``[[A, 0], [B, C]]^-1 =
    [[A^-1, 0], [-C^-1 B A^-1, C^-1]]``): ``n^3/3`` flops in matrix products, a third of a
    triangular solve against the identity, and no memory beyond one ``n/2 x n/2`` product (the
    factor of a 14336-wide Hessian is 0.8 GB in float32).  Returns ``L``."""
    n = L.shape[0]
    if n <= base:
        eye = torch.eye(n, dtype=L.dtype, device=L.device)
        L.copy_(torch.linalg.solve_triangular(L, eye, upper=False))
        return L
    h = n // 2
    A, B, C = L[:h, :h], L[h:, :h], L[h:, h:]
    _tril_inverse_(A, base)
    _tril_inverse_(C, base)
    BA = B @ A
    torch.matmul(C, BA, out=B)
    del BA
    B.neg_()
    return L


def _transpose_(M: torch.Tensor, block: int = 256) -> torch.Tensor:
    """``M.T`` in place (square ``M``), swapping ``block x block`` tiles."""
    n = M.shape[0]
    for i in range(0, n, block):
        D = M[i : i + block, i : i + block]
        D.copy_(D.T.clone())
        for j in range(i + block, n, block):
            a, b = M[i : i + block, j : j + block], M[j : j + block, i : i + block]
            t = a.clone()
            a.copy_(b.T)
            b.copy_(t.T)
    return M


def _flip_both_(M: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """``M.flip(0, 1)`` in place (square ``M``), a block of ``rows`` rows at a time."""
    n = M.shape[0]
    half = n // 2
    for r0 in range(0, half, rows):
        r1 = min(r0 + rows, half)
        top = M[r0:r1].flip(0, 1)  # a copy
        M[r0:r1] = M[n - r1 : n - r0].flip(0, 1)
        M[n - r1 : n - r0] = top
    if n % 2:
        M[half] = M[half].flip(0)
    return M


def _permute_sym_(M: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``M[p][:, p]`` in place: the columns a block of rows at a time, then the rows along the
    cycles of ``p`` (one row of scratch).  Returns ``M``."""
    n = M.shape[0]
    step = max(1, (1 << 22) // max(n, 1))
    for r in range(0, n, step):
        M[r : r + step] = M[r : r + step].index_select(1, p)
    pl, seen = p.tolist(), bytearray(n)
    for start in range(n):
        if seen[start]:
            continue
        seen[start] = 1
        if pl[start] == start:
            continue
        tmp, i = M[start].clone(), start
        while pl[i] != start:  # row i takes row p[i]
            M[i] = M[pl[i]]
            i = pl[i]
            seen[i] = 1
        M[i] = tmp
    return M


def gptq_factor(
    H: torch.Tensor, percdamp: float, perm: torch.Tensor, max_tries: int = 6, overwrite: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """``(diag(H_damped), U, pivots, percdamp_used)`` for GPTQ on processing order ``perm``
    (``H_damped`` equals ``H`` off the diagonal, so only its diagonal is returned).

    ``U`` is GPTQ's ``Hinv``: the upper Cholesky factor of ``(H_damped)_p^{-1}`` (``_p``: rows and
    columns in processing order).  It comes from *one* Cholesky, of the Babai basis order
    ``J H_p J`` (``J`` the reversal): with ``J H_p J = L L^T``, ``U = J L^{-1} J`` (Babai paper,
    App. B: GPTQ back to front is Babai's nearest plane on that factor).  No explicit inverse is
    factorised again, so no second Cholesky can fail on an ill-conditioned ``H``, and LAPACK's
    ``potri`` (whose many OpenMP barriers stall badly on a busy machine) is not used.

    ``pivots[k] = 1 / U_kk^2 = D_kk``: the LDL pivots of ``H_p`` in processing order, i.e. the
    ``D`` of the Babai bound (Thm. 5) reversed.  A failed factorisation, or a non-finite inverse,
    raises the damping as :func:`damp_hessian` does (warning, then DampingError).

    ``overwrite=True``: ``H`` (exactly symmetric, as :class:`HessianAccumulator` makes it) is
    permuted, factorised and inverted in its own memory and ``U`` is that memory: no second
    ``n x n`` matrix (0.8 GB at ``n = 14336``), the same numbers.  ``H`` is garbage afterwards.  A
    try that fails cannot be retried (torch's factorisation zeroes the other triangle, so the
    matrix is gone): :class:`HessianSpentError`, without a warning, and the caller solves again
    with a kept ``H``, which retries (and warns) exactly as if it had never been handed over.
    """
    # Memory: H and one permuted copy (none with ``overwrite``), factorised, inverted and flipped
    # in place, plus one n/2 x n/2 product (d = 14336 makes each full matrix 0.8 GB in float32).
    # The copy is laid out column-major for the factorisation, which LAPACK then does in place (a
    # row-major ``out=`` costs torch a column-major copy); the factor is transposed back in place.
    n = H.shape[0]
    dead = torch.diagonal(H) == 0
    # mean of the diagonal with dead inputs counted as 1, reduced as a strided vector like the
    # diagonal view of a repaired copy of H is (the same numbers as before, without that copy)
    buf = H.new_zeros(n, 2)
    buf[:, 0] = torch.diagonal(H)
    buf[:, 0][dead] = 1.0
    mean_diag = buf[:, 0].mean()
    h_diag = torch.diagonal(H).clone()
    basis = perm.flip(0)
    dead_p = dead.index_select(0, basis)
    pd = percdamp
    for _ in range(max_tries):
        amount = pd * mean_diag
        if overwrite:  # L = (J H_p J)^T, what the copy below holds, in H's own memory
            L = _transpose_(_permute_sym_(H, basis))
        else:
            L = torch.empty_like(H)  # row-major storage; L.mT is J H_p J, column-major
            step = max(1, (1 << 22) // max(n, 1))
            for r in range(0, n, step):
                L[r : r + step] = H[basis.unsqueeze(1), basis[r : r + step]].T
        dp = torch.diagonal(L)
        dp[dead_p] = 1.0
        dp.add_(amount)
        info = torch.empty((), dtype=torch.int32, device=H.device)
        torch.linalg.cholesky_ex(L.mT, out=(L.mT, info))
        if int(info) == 0:
            _transpose_(L)  # the lower factor, row-major
            pivots = (torch.diagonal(L) ** 2).flip(0)
            _tril_inverse_(L)
            if bool(torch.isfinite(L.sum())):  # one cheap reduction: inf/NaN anywhere shows
                diag = h_diag
                diag[dead] = 1.0
                diag.add_(amount)
                return diag, _flip_both_(L), pivots, pd
        if overwrite:
            raise HessianSpentError(f"the factorisation with damping {pd:g} x mean(diag) failed in place")
        del L
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
