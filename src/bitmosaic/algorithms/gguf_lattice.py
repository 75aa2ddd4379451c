"""Vector GPTQ on llama.cpp's lattice codebooks ``IQ3_S``, ``IQ2_S``, ``IQ2_XS``, ``IQ3_XXS`` and ``IQ2_XXS``
(issue 72), so the GGUF file holds the calibrated weights exactly (layouts:
:mod:`bitmosaic.formats.gguf_lattice`).

Scales first, then fixed (as the k-quant and IQ4 paths of :mod:`.gguf_grid` do): each input weighted by its
importance ``diag(H)`` (what llama.cpp's importance matrix holds),

1. per sub-block (IQ2_XS / IQ2_S: 16 weights, the others 32) a float scale: for trial scales
   ``r * max|w| / max(grid)`` the nearest codebook points (signs of the weights; where a parity group of 8
   -- IQ2_XS / IQ2_XXS: one point, IQ3_XXS: two -- has odd parity, the cheapest sign flipped, the point
   chosen with that cost: :func:`nearest_many`), then the weighted least-squares scale for those points,
   the one with the least error kept;
2. per super-block of 256 an fp16 ``d`` and the 4-bit ``s`` (IQ2_XS / IQ2_S / IQ2_XXS ``d * (0.5 + s) / 4``,
   IQ3_XXS ``d * (0.5 + s) / 2``, IQ3_S ``d * (1 + 2 s)``): candidates ``d`` around ``max scale / max
   level``, each sub-block's ``s`` rounded, the ``d`` with the least weighted error of the super-block's
   nearest points kept.

Every trial scale of a sub-block (step 1) and every candidate ``d`` of a super-block (step 2) is searched
in one pass over the codebook (``csrc/latticesearch.cpp`` where compiled, the same results bit for bit).

Then the solve -- the Babai paper's nearest plane (GPTQ back to front, /work/shared/papers) with a codebook
for the rounding: columns go in runs (a codebook point, or the two points of an IQ3_XXS parity group:
8 columns for IQ2_XS / IQ2_S / IQ2_XXS / IQ3_XXS, 4 for IQ3_S; runs ordered by the caller's order, e.g.
act-order, by their first column in it).  With ``U`` the upper Cholesky factor of ``H^-1`` in that order,
a run ``b`` of every row is rounded to the codebook point(s) ``q`` minimising ``||(w_b - q) U_bb^-1||^2``
-- the exact GPTQ loss of the run -- among the ``K`` points nearest under that metric's diagonal (all
scored at once, on ``|w|`` with the weights' signs -- IQ3_S / IQ2_S store every sign: free --, parity
fixed on each elsewhere; IQ3_XXS: the ``K x K`` pairs of each point's ``K`` nearest), and ``E_b = (w_b -
q) U_bb^-1`` is fed to the later columns, ``W_rest -= E_b U_b,rest`` (block GPTQ: ``W - Q = E U`` as for
single columns, so the loss is ``sum ||E||^2``).  Nothing is refitted afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..formats import gguf_lattice as gl
from .gguf_grid import GGUFGridResult, importance
from .hessian import gptq_factor

__all__ = [
    "LatticeResult",
    "candidates",
    "run_candidates",
    "nearest_many",
    "nearest_k",
    "lattice_scales",
    "lattice_rtn",
    "lattice_gptq",
]

_FIT_RATIOS = [0.6 + 0.06 * i for i in range(10)]  # trial scales: r * max|w| / max(grid)
_D_RATIOS = [0.8 + 0.05 * i for i in range(9)]  # candidate d: r * largest scale / largest level
_K = 8  # codebook candidates scored under the full metric in the solve
_CHUNK = 1 << 15  # points searched at once (x 512 -- IQ2_S 1024 -- distances)
_SUPER_CHUNK = 2048  # super-blocks whose scales are searched at once (bounds memory)
# A faster nearest_many with the same results bit for bit, injected from a higher layer (the C++ kernel:
# bitmosaic.kernels.lattice_search.install()); called with nearest_many's arguments, it returns its tuple
# or None where it does not apply.  Without it (or a compiler) the torch reference below runs.
_fast_nearest: Callable | None = None


def set_fast_nearest(fn: Callable | None) -> Callable | None:
    """Install ``fn`` as the fast :func:`nearest_many` (``None``: the reference); returns the previous."""
    global _fast_nearest
    prev, _fast_nearest = _fast_nearest, fn
    return prev


def _levels(t: gl.LatticeType) -> torch.Tensor:
    """The 16 multipliers of ``d`` a 4-bit ``s`` gives."""
    off, mul, post = t.level
    return (off + mul * torch.arange(16, dtype=torch.float32)) * post


def nearest_many(a: torch.Tensor, m: torch.Tensor, s: torch.Tensor, G: torch.Tensor, parity: bool):
    """Per point ``i`` (``|w|`` ``a [N, dim]``, weights ``m [N, dim]``) and trial scale ``s [N, C]`` the first
    codebook point ``g`` of ``G [P, dim]`` minimising ``r = s A_g - 2 B_g`` (``A_g = sum m g^2``, ``B_g =
    sum (m a) g``: the weighted error ``sum m (a - s g)^2`` is ``sum m a^2 + s r``) and, with ``parity``,
    minimising ``r + 4 F_g``, ``F_g = min_j (m_j a_j) g_j`` (the error with the cheapest sign flipped).
    Returns ``(idx, val, fidx, fval)``, each ``[N, C]`` (int32 / float32; the flip pair zero without
    parity).  The torch reference of ``csrc/latticesearch.cpp`` (same operations, same order)."""
    if _fast_nearest is not None:
        got = _fast_nearest(a, m, s, G, parity)
        if got is not None:
            return got
    N, C = s.shape
    idx, fidx = (torch.zeros(N, C, dtype=torch.int32, device=a.device) for _ in range(2))
    val, fval = (torch.zeros(N, C, device=a.device) for _ in range(2))
    for i in range(0, N, _CHUNK // 4):
        ai, mi = a[i : i + _CHUNK // 4], m[i : i + _CHUNK // 4]
        A = B = F = None
        for j in range(G.shape[1]):
            mj, maj, gj = mi[:, j : j + 1], mi[:, j : j + 1] * ai[:, j : j + 1], G[:, j]
            A = (mj * gj) * gj if A is None else A + (mj * gj) * gj
            B = maj * gj if B is None else B + maj * gj
            F = maj * gj if F is None else torch.minimum(F, maj * gj)
        for c in range(C):
            r = s[i : i + _CHUNK // 4, c : c + 1] * A - 2.0 * B
            val[i : i + len(ai), c], ix = r.min(-1)
            idx[i : i + len(ai), c] = ix.int()
            if parity:
                fval[i : i + len(ai), c], ix = (r + 4.0 * F).min(-1)
                fidx[i : i + len(ai), c] = ix.int()
    return idx, val, fidx, fval


def candidates(w: torch.Tensor, m: torch.Tensor, scale: torch.Tensor, t: gl.LatticeType, k: int):
    """The ``k`` codebook points nearest each row of ``w`` ``[R, dim]`` times ``scale`` ``[R]`` under the
    diagonal weights ``m`` (``[R, dim]`` or ``[1, dim]``), signs those of ``w`` (IQ2_XS: the cheapest sign
    flipped where their parity is odd, its cost added).  Returns ``(idx [R, k], neg [R, k, dim] bool,
    q [R, k, dim])``, ``q`` the signed unscaled points, nearest first."""
    G = gl.codebook(t, w.device, w.dtype)
    a, neg0 = w.abs(), w < 0
    ma = m * a
    k = min(k, G.shape[0])
    # distance = sum(m a^2) + scale * rel, rel = scale * m.G^2 - 2 (m a).G, ranked (scale >= 0)
    idx, rel = nearest_k(a.contiguous(), m.expand_as(a).contiguous(), scale.to(w.dtype).contiguous(), G, k)
    idx = idx.long()
    g = G[idx]  # [R, k, dim]
    neg = neg0[:, None, :].expand_as(g).clone()
    if t.parity:
        odd = neg0.sum(-1) % 2 == 1  # [R]
        cost = ma[:, None, :] * g  # the cost of flipping one sign is 4 * scale * m * |w| * g
        flip = torch.nn.functional.one_hot(cost.argmin(-1), t.dim).bool() & odd[:, None, None]
        neg ^= flip
        if k > 1:
            pen = 4 * scale[:, None] * cost.amin(-1) * odd[:, None]
            order = (scale[:, None] * rel + pen).argsort(-1)
            idx, neg, g = (
                idx.gather(-1, order),
                neg[torch.arange(len(w))[:, None], order],
                G[idx.gather(-1, order)],
            )
    return idx, neg, torch.where(neg, -g, g)


def run_candidates(w: torch.Tensor, m: torch.Tensor, scale: torch.Tensor, t: gl.LatticeType, k: int):
    """:func:`candidates` for a run of ``t.run`` columns (``[R, run]``): one point, or (IQ3_XXS) the two
    points sharing a sign parity, whose ``k x k`` combinations of each point's ``k`` nearest (signs of
    ``w``) get the cheapest sign of the eight flipped where their parity is odd.  Returns ``(idx [R, K,
    points], neg [R, K, run], q [R, K, run])``."""
    n_pts = t.run // t.dim
    if n_pts == 1:
        idx, neg, q = candidates(w, m, scale, t, k)
        return idx[..., None], neg, q
    free = dataclasses.replace(t, sign_group=0)  # each point's nearest, signs as the weights'
    parts = [candidates(w[:, p * t.dim : (p + 1) * t.dim], m[:, p * t.dim : (p + 1) * t.dim], scale, free, k)
             for p in range(n_pts)]  # fmt: skip
    (i0, _, q0), (i1, _, q1) = parts
    R, K = i0.shape
    idx = torch.stack([i0[:, :, None].expand(R, K, K), i1[:, None, :].expand(R, K, K)], -1)
    idx = idx.reshape(R, K * K, 2)
    g = torch.cat([q0[:, :, None, :].expand(R, K, K, t.dim), q1[:, None, :, :].expand(R, K, K, t.dim)], -1)
    g = g.abs().reshape(R, K * K, t.run)
    neg0 = w < 0
    odd = neg0.sum(-1) % 2 == 1
    cost = (m * w.abs())[:, None, :] * g  # the cost of flipping one sign is 4 * scale * m * |w| * g
    flip = torch.nn.functional.one_hot(cost.argmin(-1), t.run).bool() & odd[:, None, None]
    neg = neg0[:, None, :] ^ flip
    return idx, neg, torch.where(neg, -g, g)


def nearest_k(a: torch.Tensor, m: torch.Tensor, s: torch.Tensor, G: torch.Tensor, k: int):
    """Per point (``a``, ``m`` ``[N, dim]``, one scale ``s [N]``) the ``k`` first codebook points by
    ``r = s A_g - 2 B_g`` (:func:`nearest_many`), ascending, ties in codebook order: ``(idx int32 [N, k],
    r [N, k])``.
    The torch reference of ``csrc/latticesearch.cpp``'s ``nearest_k``."""
    if _fast_nearest is not None:
        got = _fast_nearest(a, m, s, G, k=k)
        if got is not None:
            return got
    A = B = None
    for j in range(G.shape[1]):
        mj, maj, gj = m[:, j : j + 1], m[:, j : j + 1] * a[:, j : j + 1], G[:, j]
        A = (mj * gj) * gj if A is None else A + (mj * gj) * gj
        B = maj * gj if B is None else B + maj * gj
    r, order = (s[:, None] * A - 2.0 * B).sort(dim=-1, stable=True)
    return order[:, :k].int(), r[:, :k]


def _points(w: torch.Tensor, m: torch.Tensor, scale: torch.Tensor, t: gl.LatticeType):
    """The nearest codebook point of each point of ``w`` ``[R, dim]`` (weights ``m``) for each of its trial
    scales ``scale [R, C]``, the weights' signs, and where a sign group (``t.sign_group`` consecutive
    weights) has odd parity the cheapest sign of it flipped: exactly the best choice under that rule
    (:func:`nearest_many`).  Returns ``(idx [R, C], neg [R, C, dim] bool, q [R, C, dim])``, ``q`` the signed
    unscaled points."""
    R, C = scale.shape
    G = gl.codebook(t, w.device, w.dtype)
    a, neg0 = w.abs(), w < 0
    idx, val, fidx, fval = nearest_many(
        a.contiguous(), m.contiguous(), scale.float().contiguous(), G, t.parity
    )
    idx = idx.long()
    neg = neg0[:, None, :].expand(R, C, t.dim).clone()
    if t.parity:
        k = t.sign_group // t.dim  # points per sign group: 1 or 2
        odd = (neg0.reshape(-1, t.sign_group).sum(-1) % 2 == 1)[:, None]  # [R / k, 1]
        if k == 1:
            flip = odd.expand(R, C)
        else:  # the flip goes into the point where it costs less (the first on a tie)
            v, fv = val.reshape(-1, 2, C), fval.reshape(-1, 2, C)
            first = fv[:, 0] + v[:, 1] <= v[:, 0] + fv[:, 1]
            flip = torch.stack([odd & first, odd & ~first], 1).reshape(R, C)
        idx = torch.where(flip, fidx.long(), idx)
        g = G[idx]
        j = ((w.abs() * m)[:, None, :] * g).argmin(-1)
        neg ^= torch.nn.functional.one_hot(j, t.dim).bool() & flip[..., None]
    else:
        g = G[idx]
    return idx, neg, torch.where(neg, -g, g)


def _sub_scales(x, m, t):
    """Per sub-block the float scale of step 1 (module doc): ``x``, ``m`` ``[S, sub]`` -> ``[S]``."""
    S, per, C = x.shape[0], t.sub // t.dim, len(_FIT_RATIOS)
    gmax = float(gl.codebook(t).max())
    amax = x.abs().amax(-1)
    trial = torch.stack([r * amax / gmax for r in _FIT_RATIOS], -1)
    _, _, q = _points(x.reshape(-1, t.dim), m.reshape(-1, t.dim), trial.repeat_interleave(per, 0), t)
    q = q.reshape(S, per, C, t.dim).transpose(1, 2).reshape(S, C, t.sub)
    x, m = x[:, None, :], m[:, None, :]
    num, den = (m * x * q).sum(-1), (m * q * q).sum(-1)
    s = torch.where(den > 0, num / den.clamp(min=1e-30), 0).clamp(min=0)
    err = (m * (x - s[..., None] * q) ** 2).sum(-1)  # [S, C]
    best = err.argmin(-1, keepdim=True)  # the first least error, as a sequential strict < over the trials
    return torch.where(err.gather(-1, best) < float("inf"), s.gather(-1, best), 0)[:, 0]


def _block_scales(x, m, t, lv):
    """Step 2 (module doc) for whole super-blocks: ``x``, ``m`` ``[B * 256 / sub, sub]`` -> ``(d, s)``."""
    nsub, per, C = gl.QK // t.sub, t.sub // t.dim, len(_D_RATIOS)
    fs = _sub_scales(x, m, t).reshape(-1, nsub)  # [B, nsub]
    smax = fs.amax(-1)
    d = torch.stack([(r * smax / lv[-1]).half().float() for r in _D_RATIOS], -1)  # [B, C]
    d = torch.where(torch.isfinite(d), d, 0)
    ratio = torch.where(d[..., None] > 0, fs[:, None, :] / d[..., None].clamp(min=1e-30), 0)  # [B, C, nsub]
    s = (ratio[..., None] - lv).abs().argmin(-1)  # the nearest level
    db = d[..., None] * lv[s]  # float32 as ggml: ``d * level``
    trial = db.transpose(1, 2).reshape(-1, C).repeat_interleave(per, 0)  # [points, C]
    _, _, q = _points(x.reshape(-1, t.dim), m.reshape(-1, t.dim), trial, t)
    q = q.reshape(-1, per, C, t.dim).transpose(1, 2).reshape(-1, C, t.sub)  # [subs, C, sub]
    err = (m[:, None, :] * (x[:, None, :] - db.transpose(1, 2).reshape(-1, C, 1) * q) ** 2).sum(-1)
    err = err.reshape(-1, nsub, C).sum(1)  # [B, C]
    best = err.argmin(-1, keepdim=True)
    ok = err.gather(-1, best)[:, 0] < float("inf")
    bd = torch.where(ok, d.gather(-1, best)[:, 0], 0)
    bs = torch.where(ok[:, None], s.gather(1, best[..., None].expand(-1, 1, nsub))[:, 0], 0)
    return bd, bs


def lattice_scales(
    W: torch.Tensor, imp: torch.Tensor, t: gl.LatticeType
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d fp16 [out, in / 256], s uint8 [out, in / sub])`` of ``W`` for input weights ``imp`` ``[in]``
    (module doc), every trial scale of a sub-block (super-block) searched in one pass."""
    out, n = W.shape
    x = W.float().reshape(-1, t.sub)
    m = imp.float().reshape(1, n // t.sub, t.sub).expand(out, -1, -1).reshape(-1, t.sub)
    lv = _levels(t).to(W.device)
    step = _SUPER_CHUNK * (gl.QK // t.sub)
    parts = [_block_scales(x[i : i + step], m[i : i + step], t, lv) for i in range(0, len(x), step)]
    d, s = (torch.cat(p) for p in zip(*parts, strict=True))
    return d.half().reshape(out, -1), s.to(torch.uint8).reshape(out, -1)


@dataclass
class LatticeResult(GGUFGridResult):
    """Codes are the signed codebook values per weight, ``scales`` each sub-block's float32 multiplier
    (``zeros`` 1): the weight is ``scale * code``; ``aux`` holds what the type stores (``idx``, ``neg``,
    ``d``, ``s``; :mod:`bitmosaic.formats.gguf_lattice`)."""

    @property
    def lattice_type(self) -> gl.LatticeType:
        return gl.LATTICE_TYPES[self.gguf_type]

    def stored(self):
        a = self.aux
        return a["idx"], a["neg"], a["d"], a["s"]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return gl.dequantize(*self.stored(), self.lattice_type).to(dtype)


def _result(idx, neg, d, s, t: gl.LatticeType, gguf_type: str, **extra) -> LatticeResult:
    out, n = neg.shape
    g = gl.codebook(t, idx.device)[idx.long()].reshape(out, n)
    codes = torch.where(neg.bool(), -g, g).to(torch.int16)
    scales = gl.scale_of(d, s, t)
    g_idx = torch.arange(n, device=idx.device) // t.sub
    aux = {"idx": idx.to(torch.int16), "neg": neg.to(torch.uint8), "d": d, "s": s}
    return LatticeResult(codes=codes, scales=scales, zeros=torch.ones_like(scales), g_idx=g_idx,
                         gguf_type=gguf_type, aux=aux, **extra)  # fmt: skip


def lattice_rtn(
    W: torch.Tensor, gguf_type: str, d: torch.Tensor, s: torch.Tensor, imp: torch.Tensor | None = None
):
    """Each run of ``dim`` weights to its nearest codebook point (weights ``imp``) for the scales ``d``,
    ``s``: the rounding the solve improves on."""
    t = gl.LATTICE_TYPES[gguf_type]
    out, n = W.shape
    imp = torch.ones(n, device=W.device) if imp is None else imp.float()
    db = gl.scale_of(d, s, t).repeat_interleave(t.sub // t.dim, dim=1).reshape(-1)
    m = imp.reshape(1, -1, t.dim).expand(out, -1, -1).reshape(-1, t.dim)
    idx, neg, _ = _points(W.float().reshape(-1, t.dim), m, db[:, None], t)
    idx, neg = idx[:, 0], neg[:, 0]
    return _result(idx.reshape(out, -1), neg.reshape(out, n), d, s, t, gguf_type)


def _run_order(perm: torch.Tensor | None, n: int, dim: int, device) -> torch.Tensor:
    """Column order of whole runs of ``dim``: runs sorted by the first position of any of their columns in
    ``perm`` (natural order without one)."""
    runs = torch.arange(n // dim, device=device)
    if perm is not None:
        pos = torch.empty(n, dtype=torch.long, device=device)
        pos[perm.to(device)] = torch.arange(n, device=device)
        runs = pos.reshape(-1, dim).amin(-1).argsort()
    return (runs[:, None] * dim + torch.arange(dim, device=device)).reshape(-1)


def lattice_gptq(
    W: torch.Tensor,
    H: torch.Tensor,
    gguf_type: str,
    *,
    perm=None,
    block_size: int = 128,
    percdamp: float = 0.01,
    dtype=None,
    overwrite_hessian: bool = False,
) -> LatticeResult:
    """Vector GPTQ of ``W`` ``[out, in]`` against ``H`` on the ``gguf_type`` codebook, scales fixed first
    (module doc)."""
    t = gl.LATTICE_TYPES[gguf_type]
    out, n = W.shape
    dtype = dtype or torch.float32
    d, s = lattice_scales(W, importance(H), t)
    db = gl.scale_of(d, s, t).repeat_interleave(t.sub, dim=1)  # [out, in] per column
    cols = _run_order(perm, n, t.run, W.device)
    dead = torch.diagonal(H) == 0
    Hd_diag, U, pivots, _ = gptq_factor(H.to(dtype), percdamp, cols, overwrite=overwrite_hessian)
    Wp = W.to(dtype).masked_fill(dead[None, :], 0)[:, cols].clone()
    dbp = db[:, cols].to(dtype)
    idx = torch.empty(out, n // t.dim, dtype=torch.long, device=W.device)
    neg = torch.empty(out, n, dtype=torch.bool, device=W.device)
    errsum = Wp.new_zeros(out)
    eye = torch.eye(t.run, dtype=dtype, device=W.device)
    rows = torch.arange(out, device=W.device)
    block_size = max(t.run, block_size // t.run * t.run)
    for i1 in range(0, n, block_size):
        i2 = min(n, i1 + block_size)
        E1 = Wp.new_zeros(out, i2 - i1)
        for c in range(i1, i2, t.run):
            e = c + t.run
            Uinv = torch.linalg.solve_triangular(U[c:e, c:e], eye, upper=True)
            m = (Uinv * Uinv).sum(-1)[None, :]  # diag(U_bb^-1 U_bb^-T)
            w, sc = Wp[:, c:e], dbp[:, c]
            ix, ng, q = run_candidates(w, m, sc, t, _K)
            E = (w[:, None, :] - sc[:, None, None] * q) @ Uinv  # [out, K, dim]
            j = (E * E).sum(-1).argmin(-1)
            Eb = E[rows, j]
            idx[:, c // t.dim : e // t.dim], neg[:, c:e] = ix[rows, j], ng[rows, j]
            errsum += (Eb * Eb).sum(-1)
            E1[:, c - i1 : e - i1] = Eb
            if e < i2:
                Wp[:, e:i2] -= Eb @ U[c:e, e:i2]
        if i2 < n:
            Wp[:, i2:] -= E1 @ U[i1:i2, i2:]
    inv_runs = torch.empty(n // t.dim, dtype=torch.long, device=W.device)
    inv_runs[cols[:: t.dim] // t.dim] = torch.arange(n // t.dim, device=W.device)
    inv = torch.empty(n, dtype=torch.long, device=W.device)
    inv[cols] = torch.arange(n, device=W.device)
    return _result(idx[:, inv_runs], neg[:, inv], d, s, t, gguf_type, perm=cols, hessian_diag=Hd_diag,
                   step_errors=errsum, pivots=pivots)  # fmt: skip
