"""Vector GPTQ on llama.cpp's lattice codebooks ``IQ3_S`` and ``IQ2_XS`` (issue 72), so the GGUF file holds
the calibrated weights exactly (layouts: :mod:`bitmosaic.formats.gguf_lattice`).

Scales first, then fixed (as the k-quant and IQ4 paths of :mod:`.gguf_grid` do): each input weighted by its
importance ``diag(H)`` (what llama.cpp's importance matrix holds),

1. per sub-block (IQ2_XS: 16 weights, IQ3_S: 32) a float scale: for trial scales ``r * max|w| / max(grid)``
   the nearest codebook points (signs of the weights; IQ2_XS's even parity by flipping the cheapest
   sign), then the weighted least-squares scale for those points, the one with the least error kept;
2. per super-block of 256 an fp16 ``d`` and the 4-bit ``s`` (IQ2_XS ``d * (0.5 + s) / 4``, IQ3_S
   ``d * (1 + 2 s)``): candidates ``d`` around ``max scale / max level``, each sub-block's ``s`` rounded,
   the ``d`` with the least weighted error of the super-block's nearest points kept.

Then the solve -- the Babai paper's nearest plane (GPTQ back to front, /work/shared/papers) with a codebook
for the rounding: columns go in runs of ``dim`` (a codebook point: 8 for IQ2_XS, 4 for IQ3_S; runs ordered
by the caller's order, e.g. act-order, by their first column in it).  With ``U`` the upper Cholesky factor
of ``H^-1`` in that order, a run ``b`` of every row is rounded to the codebook point ``q`` minimising
``||(w_b - q) U_bb^-1||^2`` -- the exact GPTQ loss of the run -- among the ``K`` points nearest under that
metric's diagonal (all 512 scored at once, on ``|w|`` with the weights' signs; IQ2_XS's parity fixed on
each), and ``E_b = (w_b - q) U_bb^-1`` is fed to the later columns, ``W_rest -= E_b U_b,rest`` (block GPTQ:
``W - Q = E U`` as for single columns, so the loss is ``sum ||E||^2``).  Nothing is refitted afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import gguf_lattice as gl
from .gguf_grid import GGUFGridResult, importance
from .hessian import gptq_factor

__all__ = ["LatticeResult", "candidates", "lattice_scales", "lattice_rtn", "lattice_gptq"]

_FIT_RATIOS = [0.6 + 0.06 * i for i in range(10)]  # trial scales: r * max|w| / max(grid)
_D_RATIOS = [0.8 + 0.05 * i for i in range(9)]  # candidate d: r * largest scale / largest level
_K = 8  # codebook candidates scored under the full metric in the solve
_CHUNK = 1 << 15  # points searched at once (x 512 distances)


def _levels(t: gl.LatticeType) -> torch.Tensor:
    """The 16 multipliers of ``d`` a 4-bit ``s`` gives."""
    s = torch.arange(16, dtype=torch.float32)
    return (0.5 + s) * 0.25 if t.name == "IQ2_XS" else 1 + 2 * s


def candidates(w: torch.Tensor, m: torch.Tensor, scale: torch.Tensor, t: gl.LatticeType, k: int):
    """The ``k`` codebook points nearest each row of ``w`` ``[R, dim]`` times ``scale`` ``[R]`` under the
    diagonal weights ``m`` (``[R, dim]`` or ``[1, dim]``), signs those of ``w`` (IQ2_XS: the cheapest sign
    flipped where their parity is odd, its cost added).  Returns ``(idx [R, k], neg [R, k, dim] bool,
    q [R, k, dim])``, ``q`` the signed unscaled points, nearest first."""
    G = gl.codebook(t, w.device, w.dtype)
    a, neg0 = w.abs(), w < 0
    ma = m * a
    # distance = sum(m a^2) + scale * rel, rel = scale * m.G^2 - 2 (m a).G: one product, ranked (scale >= 0)
    rel = torch.cat([scale[:, None] * m.expand_as(a), -2 * ma], -1) @ torch.cat([G * G, G], -1).T
    k = min(k, G.shape[0])
    idx = rel.argmin(-1, keepdim=True) if k == 1 else rel.topk(k, -1, largest=False).indices
    g = G[idx]  # [R, k, dim]
    neg = neg0[:, None, :].expand_as(g).clone()
    if t.parity:
        odd = neg0.sum(-1) % 2 == 1  # [R]
        cost = ma[:, None, :] * g  # the cost of flipping one sign is 4 * scale * m * |w| * g
        flip = torch.nn.functional.one_hot(cost.argmin(-1), t.dim).bool() & odd[:, None, None]
        neg ^= flip
        if k > 1:
            pen = 4 * scale[:, None] * cost.amin(-1) * odd[:, None]
            order = (scale[:, None] * rel.gather(-1, idx) + pen).argsort(-1)
            idx, neg, g = (
                idx.gather(-1, order),
                neg[torch.arange(len(w))[:, None], order],
                G[idx.gather(-1, order)],
            )
    return idx, neg, torch.where(neg, -g, g)


def _nearest(w, m, scale, t, k):
    """The best of :func:`candidates` by the diagonal weighted error: ``(idx [R], neg [R, dim], q)``."""
    idx, neg, q = candidates(w, m, scale, t, k)
    err = (m[:, None, :] * (w[:, None, :] - scale[:, None, None] * q) ** 2).sum(-1)
    j = err.argmin(-1, keepdim=True)
    r = torch.arange(len(w), device=w.device)
    return idx.gather(-1, j)[:, 0], neg[r, j[:, 0]], q[r, j[:, 0]]


def _points(w, m, scale, t):
    """:func:`_nearest` over all points of ``w`` ``[R, dim]`` in chunks (``k`` 4 with parity, else 1)."""
    parts = [_nearest(w[i : i + _CHUNK], m[i : i + _CHUNK], scale[i : i + _CHUNK], t, 4 if t.parity else 1)
             for i in range(0, len(w), _CHUNK)]  # fmt: skip
    return tuple(torch.cat(x) for x in zip(*parts, strict=True))


def _sub_scales(x, m, t):
    """Per sub-block the float scale of step 1 (module doc): ``x``, ``m`` ``[S, sub]`` -> ``[S]``."""
    S, per = x.shape[0], t.sub // t.dim
    gmax = float(gl.codebook(t).max())
    amax = x.abs().amax(-1)
    best_s, best_err = torch.zeros_like(amax), torch.full_like(amax, float("inf"))
    xs, ms = x.reshape(-1, t.dim), m.reshape(-1, t.dim)
    for r in _FIT_RATIOS:
        _, _, q = _points(xs, ms, (r * amax / gmax).repeat_interleave(per), t)
        q = q.reshape(S, t.sub)
        num, den = (m * x * q).sum(-1), (m * q * q).sum(-1)
        s = torch.where(den > 0, num / den.clamp(min=1e-30), 0).clamp(min=0)
        err = (m * (x - s[:, None] * q) ** 2).sum(-1)
        better = err < best_err
        best_s, best_err = torch.where(better, s, best_s), torch.where(better, err, best_err)
    return best_s


def lattice_scales(
    W: torch.Tensor, imp: torch.Tensor, t: gl.LatticeType
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d fp16 [out, in / 256], s uint8 [out, in / sub])`` of ``W`` for input weights ``imp`` ``[in]``
    (module doc)."""
    out, n = W.shape
    x = W.float().reshape(-1, t.sub)
    m = imp.float().reshape(1, n // t.sub, t.sub).expand(out, -1, -1).reshape(-1, t.sub)
    fs = _sub_scales(x, m, t).reshape(-1, gl.QK // t.sub)  # [super-blocks, nsub]
    lv = _levels(t).to(W.device)
    smax = fs.amax(-1)
    best_err = torch.full_like(smax, float("inf"))
    best_d, best_s = torch.zeros_like(smax), torch.zeros_like(fs)
    xs, ms = x.reshape(-1, t.dim), m.reshape(-1, t.dim)
    for r in _D_RATIOS:
        d = (r * smax / lv[-1]).half().float()
        d = torch.where(torch.isfinite(d), d, 0)
        ratio = torch.where(d[:, None] > 0, fs / d[:, None].clamp(min=1e-30), 0)
        s = (ratio[..., None] - lv).abs().argmin(-1)  # the nearest level
        db = d[:, None] * lv[s]  # float32 as ggml: ``d * level``
        _, _, q = _points(xs, ms, db.reshape(-1).repeat_interleave(t.sub // t.dim), t)
        err = (m * (x - db.reshape(-1, 1) * q.reshape(-1, t.sub)) ** 2).sum(-1)
        err = err.reshape(-1, gl.QK // t.sub).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_d, best_s = torch.where(better, d, best_d), torch.where(better[:, None], s, best_s)
    return best_d.half().reshape(out, -1), best_s.to(torch.uint8).reshape(out, -1)


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
    idx, neg, _ = _points(W.float().reshape(-1, t.dim), m, db, t)
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
    cols = _run_order(perm, n, t.dim, W.device)
    dead = torch.diagonal(H) == 0
    Hd_diag, U, pivots, _ = gptq_factor(H.to(dtype), percdamp, cols, overwrite=overwrite_hessian)
    Wp = W.to(dtype).masked_fill(dead[None, :], 0)[:, cols].clone()
    dbp = db[:, cols].to(dtype)
    idx = torch.empty(out, n // t.dim, dtype=torch.long, device=W.device)
    neg = torch.empty(out, n, dtype=torch.bool, device=W.device)
    errsum = Wp.new_zeros(out)
    eye = torch.eye(t.dim, dtype=dtype, device=W.device)
    rows = torch.arange(out, device=W.device)
    block_size = max(t.dim, block_size // t.dim * t.dim)
    for i1 in range(0, n, block_size):
        i2 = min(n, i1 + block_size)
        E1 = Wp.new_zeros(out, i2 - i1)
        for c in range(i1, i2, t.dim):
            e = c + t.dim
            Uinv = torch.linalg.solve_triangular(U[c:e, c:e], eye, upper=True)
            m = (Uinv * Uinv).sum(-1)[None, :]  # diag(U_bb^-1 U_bb^-T)
            w, sc = Wp[:, c:e], dbp[:, c]
            ix, ng, q = candidates(w, m, sc, t, _K)
            E = (w[:, None, :] - sc[:, None, None] * q) @ Uinv  # [out, K, dim]
            j = (E * E).sum(-1).argmin(-1)
            Eb = E[rows, j]
            idx[:, c // t.dim], neg[:, c:e] = ix[rows, j], ng[rows, j]
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
