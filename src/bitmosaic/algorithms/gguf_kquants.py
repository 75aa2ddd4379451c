"""GGUF's k-quants (llama.cpp's ``Q2_K`` .. ``Q6_K``) refitted to bitmosaic's integers.

A k-quant stores each row in super-blocks of 256 weights, split into sub-blocks that share one small
integer scale (and, for the types with a min, one small integer min), with one fp16 ``d`` (and ``dmin``)
per super-block (what ``gguf.quants`` and llama.cpp compute, in float32):

=======  =============  =================================  ===========  ======================
type     sub-blocks     weight                             codes ``q``  sub-block scale / min
=======  =============  =================================  ===========  ======================
Q2_K     16 x 16        ``d * sc * q - dmin * m``          0 .. 3       4-bit ``sc``, 4-bit ``m``
Q3_K     16 x 16        ``d * sc * (q - 4)``               0 .. 7       6-bit signed ``sc``
Q4_K     8 x 32         ``d * sc * q - dmin * m``          0 .. 15      6-bit ``sc``, 6-bit ``m``
Q5_K     8 x 32         ``d * sc * q - dmin * m``          0 .. 31      6-bit ``sc``, 6-bit ``m``
Q6_K     16 x 16        ``d * sc * (q - 32)``              0 .. 63      int8 ``sc``
=======  =============  =================================  ===========  ======================

A bitmosaic layer is ``scale * (code - zero)`` with one fp16 scale per group.  :func:`fit` keeps our
integers: per sub-block (groups contiguous, a multiple of the sub-block) the codes are ``code - zero``
shifted (types with a min: lowest value at 0, ``min = shift * scale``) or offset (symmetric types:
``q = code - zero + offset``, mirrored with a negative scale when that fits), so the sub-block's ideal
scale is our scale and its ideal min ``shift * scale``.  Those ideal scales and mins are then rounded to
the type's integers with one fp16 ``d`` / ``dmin`` per super-block, chosen by a search that minimizes
the squared weight error of the super-block (each sub-block's least-squares optimum weighted by how much
its weights depend on it), each integer scale tried one step either way with its best min; for the
types with a min, then alternately ``d`` and ``dmin`` solved by least squares for those integers and
the integers re-chosen, while the super-block's error falls.  Our integers are kept as they are; only
the scales move, so the error is that of 6-bit scales and mins (Q2_K: 4-bit; Q6_K: 8-bit scales)
relative to the super-block's largest -- with a min, mostly the min's rounding (``dmin / 2`` on every
weight of a sub-block).  Exact only when every scale of a super-block is an integer multiple of one fp16
number in the type's range, which a calibrated layer practically never is.  Re-choosing our codes for
the rounded scales would lower the error by under 2% (measured on random layers), so they are kept.

Sub-blocks whose integers the type cannot hold (wider than its codes, an asymmetric range a symmetric
type cannot offset, a group smaller than the sub-block) are re-rounded from our weights: min/max (types
with a min) or signed max-abs (symmetric types) onto the type's codes, then refitted the same way and
the codes re-chosen as the nearest for the final scales.

:func:`pack` writes the blocks in llama.cpp's byte layout; :func:`dequantize` is the float32 model of
a fit that the exporter checks the written bytes against (``gguf.quants``, bit for bit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["QK_K", "KType", "K_TYPES", "KFit", "fit", "fit_weights", "dequantize", "pack"]

QK_K = 256
_RATIOS = [0.7 + 0.02 * i for i in range(21)]  # d candidates: (largest / top) * ratio
_CHUNK = 1 << 21  # weights fitted at once
_ROUNDS = 8  # alternating least-squares rounds of the types with a min


@dataclass(frozen=True)
class KType:
    name: str
    sub: int  # weights per sub-block
    qmax: int  # codes 0 .. qmax
    with_min: bool  # ``d * sc * q - dmin * m`` (else ``d * sc * (q - offset)``)
    sc_lo: int  # the integer sub-block scales
    sc_hi: int
    m_hi: int  # the integer mins, 0 .. m_hi
    offset: int  # symmetric types: the weight is ``d * sc * (q - offset)``
    scale_bits: int

    @property
    def nsub(self) -> int:
        return QK_K // self.sub

    @property
    def qtype(self):
        import gguf

        return gguf.GGMLQuantizationType[self.name]

    @property
    def code_range(self) -> str:
        return f"0..{self.qmax}" if self.with_min else f"[{-self.offset}, {self.qmax - self.offset}]"

    def what(self) -> str:
        """How the type stores its scales (and mins)."""
        mins, ds = (" and min", "d, dmin") if self.with_min else ("", "d")
        bits = self.scale_bits
        return f"each {self.sub}-weight sub-block's scale{mins} as {bits}-bit integers times fp16 {ds}"

    def refitted(self) -> str:
        """The change a refit makes."""
        mins = " and mins" if self.with_min else ""
        return f"{self.name}: our integers kept, sub-block scales{mins} refitted to the type's integers"


K_TYPES = {t.name: t for t in (KType("Q2_K", 16, 3, True, 0, 15, 15, 0, 4),
                               KType("Q3_K", 16, 7, False, -32, 31, 0, 4, 6),
                               KType("Q4_K", 32, 15, True, 0, 63, 63, 0, 6),
                               KType("Q5_K", 32, 31, True, 0, 63, 63, 0, 6),
                               KType("Q6_K", 16, 63, False, -128, 127, 0, 32, 8))}  # fmt: skip


@dataclass
class KFit:
    q: torch.Tensor  # int64 [out, in]: the stored codes, 0 .. qmax
    sc: torch.Tensor  # int64 [out, in / sub]: integer sub-block scales
    m: torch.Tensor | None  # int64 [out, in / sub]: integer sub-block mins (types with a min)
    d: torch.Tensor  # fp16 [out, in / 256]
    dmin: torch.Tensor | None  # fp16 [out, in / 256]
    rerounded: int  # sub-blocks whose integers the type could not hold (re-rounded from the weights)
    subblocks: int


def _blocks(x: torch.Tensor, t: KType) -> torch.Tensor:
    """``[out, in]`` -> ``[out, in/256, nsub, sub]``."""
    return x.reshape(x.shape[0], -1, t.nsub, t.sub)


def fit(values: torch.Tensor, scales: torch.Tensor, weights: torch.Tensor, t: KType) -> KFit:
    """The k-quant of a layer whose weights are ``scales * values`` (``values = code - zero``, int64
    ``[out, in]``; ``scales`` one per sub-block ``[out, in / t.sub]``; ``weights`` the layer's float32
    weights, the target).  Sub-blocks whose integers the type cannot hold are re-rounded from
    ``weights``."""
    return _by_rows(lambda v, s, w: _fit(v, s, w, t), values, scales, weights)


def fit_weights(weights: torch.Tensor, t: KType, importance: torch.Tensor | None = None) -> KFit:
    """The k-quant of float weights ``[out, in]``, every sub-block re-rounded (no integers to keep).

    ``importance`` (``[in]``, e.g. ``diag(H)``, what llama.cpp's imatrix holds): each weight's squared
    error counts that much, in the sub-block search (llama.cpp's ``make_qkx3_quants`` for the types with a
    min, ``make_qx_quants`` for the symmetric ones) and in the least-squares fit of the integer scales,
    mins and fp16 ``d`` / ``dmin`` -- as ``quantize_row_q2_K_impl`` .. ``q6_K_impl`` use their
    ``quant_weights``.  Without it: plain min/max (max-abs) codes and unweighted least squares."""
    imp = None if importance is None else importance.double().reshape(1, -1).expand(weights.shape[0], -1)

    def one(weights, *imp_rows):
        w = _blocks(weights.double(), t)
        wt = _blocks(imp_rows[0], t) if imp_rows else None
        return _refit(_reround(w, t, wt), w, torch.zeros(w.shape[:-1], dtype=torch.bool), t, wt)

    return _by_rows(one, weights, *(() if imp is None else (imp,)))


def _by_rows(fn, *tensors: torch.Tensor) -> KFit:
    """``fn`` on blocks of rows (super-blocks are independent; the search holds about 100 bytes a
    weight), the fits joined."""
    step = max(1, _CHUNK // tensors[0].shape[1])
    parts = [fn(*(x[i : i + step] for x in tensors)) for i in range(0, tensors[0].shape[0], step)]
    if len(parts) == 1:
        return parts[0]

    def cat(name):
        return None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])

    return KFit(cat("q"), cat("sc"), cat("m"), cat("d"), cat("dmin"), sum(p.rerounded for p in parts),
                sum(p.subblocks for p in parts))  # fmt: skip


def _fit(values: torch.Tensor, scales: torch.Tensor, weights: torch.Tensor, t: KType) -> KFit:
    w = _blocks(weights.double(), t)
    v = _blocks(values.long(), t)
    s = scales.double().reshape(w.shape[:-1])
    vmin, vmax = v.amin(-1), v.amax(-1)
    if t.with_min:
        sign = torch.where(s < 0, -1, 1)
        lo, hi = torch.where(sign > 0, vmin, -vmax), torch.where(sign > 0, vmax, -vmin)
        shift = (-lo).clamp(min=0)  # lowest integer at 0 (a min >= 0: llama.cpp's ``dmin`` is shared)
        ok = hi + shift <= t.qmax
        q = sign[..., None] * v + shift[..., None]
    else:
        top = t.qmax - t.offset
        plain = (vmin >= -t.offset) & (vmax <= top)
        mirror = ~plain & (-vmax >= -t.offset) & (-vmin <= top)
        ok = plain | mirror
        q = torch.where(mirror[..., None], -v, v) + t.offset
    if not bool(ok.all()):
        q = torch.where(ok[..., None], q, _reround(w, t))
    return _refit(q, w, ok, t)


def _reround(w: torch.Tensor, t: KType, wt: torch.Tensor | None = None) -> torch.Tensor:
    """Codes of ``w`` (``[..., sub]``) on the type's grid, per sub-block: min/max (types with a min,
    the min clamped to <= 0) or signed max-abs mapped to ``-offset`` (symmetric types); with weights
    ``wt`` the weighted searches of :func:`fit_weights`."""
    if wt is not None:
        return _weighted_codes(w, wt, t)
    if t.with_min:
        lo = w.amin(-1, keepdim=True).clamp(max=0)
        a = (w.amax(-1, keepdim=True) - lo) / t.qmax
        q = torch.where(a > 0, (w - lo) / torch.where(a > 0, a, 1), 0)
        return q.round().clamp(0, t.qmax).long()
    idx = w.abs().argmax(-1, keepdim=True)
    a = w.gather(-1, idx) / -t.offset
    q = torch.where(a != 0, w / torch.where(a != 0, a, 1), 0)
    return (q.round().clamp(-t.offset, t.qmax - t.offset) + t.offset).long()


def _weighted_codes(w: torch.Tensor, wt: torch.Tensor, t: KType) -> torch.Tensor:
    """Per sub-block the codes of llama.cpp's weighted search: ``make_qkx3_quants`` (types with a min: 37
    inverse scales around ``qmax / (max - min)``, the min <= 0) or ``make_qx_quants`` (symmetric: 19
    inverse scales ``-(offset + 0.1 k) / max``, the one with the largest ``sum(wt q x)**2 / sum(wt q q)``)."""
    if t.with_min:
        from .gguf_legacy import qkx3

        return qkx3(w, wt, t.qmax)[2]
    idx = w.abs().argmax(-1, keepdim=True)
    top = w.gather(-1, idx)
    safe = torch.where(top != 0, top, 1)
    best_q, best = torch.zeros_like(w), torch.full_like(top[..., 0], -1.0)
    for k in range(-9, 10):
        q = (-(t.offset + 0.1 * k) / safe * w).round().clamp(-t.offset, t.qmax - t.offset)
        sxq, sqq = (wt * w * q).sum(-1), (wt * q * q).sum(-1)
        score = torch.where(sqq > 0, sxq * sxq / torch.where(sqq > 0, sqq, 1), 0)
        better = score > best
        best, best_q = torch.where(better, score, best), torch.where(better[..., None], q, best_q)
    return (torch.where(top != 0, best_q, 0) + t.offset).long()


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float64)


def _round_to(x: torch.Tensor, d: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``clamp(round(x / d))`` with ``d`` per super-block (0 where ``d`` is 0)."""
    dd = d[..., None]
    return torch.where(dd != 0, x / torch.where(dd != 0, dd, 1), 0).round().clamp(lo, hi)


def _search(x: torch.Tensor, wt: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d, k)``: per super-block an fp16 ``d`` and integers ``k`` in ``[lo, hi]`` minimizing
    ``sum(wt * (d * k - x)**2)`` over the last axis (``x``, ``wt``: float64 ``[out, nsb, n]``): a grid
    of candidates around ``largest / hi``, then twice the least-squares ``d`` for the chosen ``k``."""
    amax = x.abs().amax(-1)
    signed = x.gather(-1, x.abs().argmax(-1, keepdim=True))[..., 0]
    best_err = torch.full_like(amax, float("inf"))
    best_d = torch.zeros_like(amax)

    def consider(d):
        nonlocal best_err, best_d
        d = _fp16(d)
        d = torch.where(torch.isfinite(d), d, 0)
        err = (wt * (d[..., None] * _round_to(x, d, lo, hi) - x) ** 2).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_d = torch.where(better, d, best_d)

    sign = torch.where(signed < 0, -1.0, 1.0)
    for r in [*_RATIOS, *(hi / k for k in range(math.ceil(hi / 1.1), hi))]:  # k: d = largest / k exactly
        consider(sign * amax / hi * r)  # the largest value at ``hi`` (ratio 1)
        if lo < 0:
            consider(-sign * amax / -lo * r)  # or at ``lo``
    for _ in range(2):
        k = _round_to(x, best_d, lo, hi)
        den = (wt * k * k).sum(-1)
        consider(torch.where(den > 0, (wt * k * x).sum(-1) / torch.where(den > 0, den, 1), 0))
    return best_d, _round_to(x, best_d, lo, hi)


def _refit(
    q: torch.Tensor, w: torch.Tensor, kept: torch.Tensor, t: KType, wt: torch.Tensor | None = None
) -> KFit:
    """Integer scales (and mins) with fp16 ``d`` (``dmin``) per super-block for codes ``q`` reproducing
    ``w`` (``[out, nsb, nsub, sub]``) in least squares, each weight's error weighted by ``wt`` (same shape;
    none: equal); codes of sub-blocks not ``kept`` re-chosen."""
    out = w.shape[0]
    qf = q.double() if t.with_min else (q - t.offset).double()
    wt = torch.ones_like(w) if wt is None else wt
    n = wt.sum(-1)  # the sub-block's total weight (``sub`` when equal)
    s1, s2, sw, swq = (wt * qf).sum(-1), (wt * qf * qf).sum(-1), (wt * w).sum(-1), (wt * w * qf).sum(-1)
    if t.with_min:
        var = s2 - s1 * s1 / n  # n * variance of the codes: how much the error depends on the scale
        slope = torch.where(var > 0, (swq - s1 * sw / n) / torch.where(var > 0, var, 1), 0)

        def sse(d_, dmin_, sc_, m_):  # the squared error of each sub-block, less sum(w**2)
            a, b = d_[..., None] * sc_, dmin_[..., None] * m_
            return a * a * s2 + n * b * b - 2 * a * b * s1 - 2 * a * swq + 2 * b * sw

        def integers(d_, dmin_, sc_):  # per sub-block: the scale sc_ or one step either way, its best min
            best = None
            for step in (0, -1, 1):
                sc2 = (sc_ + step).clamp(t.sc_lo, t.sc_hi)
                m2 = _round_to((d_[..., None] * sc2 * s1 - sw) / n, dmin_, 0, t.m_hi)
                e2 = sse(d_, dmin_, sc2, m2)
                if best is None:
                    best = (sc2, m2, e2)
                else:
                    better = e2 < best[2]
                    best = tuple(torch.where(better, x, y) for x, y in zip((sc2, m2, e2), best, strict=True))
            return best

        d, sc = _search(slope, var, t.sc_lo, t.sc_hi)
        dmin, m = _search((d[..., None] * sc * s1 - sw) / n, n, 0, t.m_hi)
        sc, m, err = integers(d, dmin, sc)
        total = err.sum(-1)
        for _ in range(_ROUNDS):  # alternate: d and dmin by least squares for the integers, then integers
            a11, a12, a22 = (sc * sc * s2).sum(-1), -(sc * m * s1).sum(-1), (n * m * m).sum(-1)
            b1, b2 = (sc * swq).sum(-1), -(m * sw).sum(-1)
            det = a11 * a22 - a12 * a12
            ok = det.abs() > 1e-12 * (a11 * a22).abs().clamp(min=1e-300)
            safe = torch.where(ok, det, 1)
            d2 = _fp16(torch.where(ok, (b1 * a22 - a12 * b2) / safe, d))
            dmin2 = _fp16(torch.where(ok, (a11 * b2 - a12 * b1) / safe, dmin))
            d2 = torch.where(torch.isfinite(d2), d2, d)
            dmin2 = torch.where(torch.isfinite(dmin2), dmin2, dmin)
            sc2, m2, err2 = integers(d2, dmin2, _round_to(slope, d2, t.sc_lo, t.sc_hi))
            better = err2.sum(-1) < total
            if not bool(better.any()):
                break
            total = torch.where(better, err2.sum(-1), total)
            d, dmin = torch.where(better, d2, d), torch.where(better, dmin2, dmin)
            sc, m = torch.where(better[..., None], sc2, sc), torch.where(better[..., None], m2, m)
    else:
        slope = torch.where(s2 > 0, swq / torch.where(s2 > 0, s2, 1), 0)
        d, sc = _search(slope, s2, t.sc_lo, t.sc_hi)
        dmin = m = None
    f = KFit(q, sc.long(), None if m is None else m.long(), d.to(torch.float16),
             None if dmin is None else dmin.to(torch.float16), int((~kept).sum()), kept.numel())  # fmt: skip
    if f.rerounded:  # the re-rounded sub-blocks' codes: the nearest for the final scales
        a = (f.d.double()[..., None] * f.sc)[..., None]
        b = (f.dmin.double()[..., None] * f.m)[..., None] if t.with_min else torch.zeros_like(a)
        off = 0 if t.with_min else t.offset
        near = (torch.where(a != 0, (w + b) / torch.where(a != 0, a, 1), 0).round() + off).clamp(0, t.qmax)
        f.q = torch.where(kept[..., None], q, near.long())
    f.q = f.q.reshape(out, -1)
    f.sc = f.sc.reshape(out, -1)
    if f.m is not None:
        f.m = f.m.reshape(out, -1)
    return f


def dequantize(f: KFit, t: KType) -> torch.Tensor:
    """The float32 weights of ``f`` as ``gguf.quants`` computes them (``(d * sc) * q - dmin * m``)."""
    out = f.q.shape[0]
    q = _blocks(f.q, t).float()
    a = (f.d.float()[..., None] * f.sc.reshape(out, -1, t.nsub).float())[..., None]
    if t.with_min:
        b = (f.dmin.float()[..., None] * f.m.reshape(out, -1, t.nsub).float())[..., None]
        return (a * q - b).reshape(out, -1)
    return (a * (q - t.offset)).reshape(out, -1)


def _fp16_bytes(x: torch.Tensor) -> np.ndarray:
    return x.reshape(-1, 1).numpy().view(np.uint8)


def _crumbs(q: np.ndarray, bits: int) -> np.ndarray:
    """``[nb, 32 * k]`` small codes packed ``8 // bits`` per byte llama.cpp's way: byte ``i`` of each
    32-byte chunk holds element ``i`` of the chunk's consecutive 32-value groups, lowest bits first."""
    per = 8 // bits
    g = q.reshape(q.shape[0], -1, per, 32).astype(np.uint8)
    out = np.zeros((q.shape[0], g.shape[1], 32), np.uint8)
    for j in range(per):
        out |= g[:, :, j] << (bits * j)
    return out.reshape(q.shape[0], -1)


def pack(f: KFit, t: KType) -> np.ndarray:
    """The GGUF bytes of ``f``: uint8 ``[out, in / 256 * type size]`` (the layout ``gguf.quants`` reads)."""
    out, n = f.q.shape
    nb = out * n // QK_K
    q = f.q.reshape(nb, QK_K).numpy()
    sc = f.sc.reshape(nb, t.nsub).numpy()
    d = _fp16_bytes(f.d)
    if t.name in ("Q4_K", "Q5_K"):
        m = f.m.reshape(nb, t.nsub).numpy().astype(np.uint8)
        s = sc.astype(np.uint8)
        hi_s, hi_m = (s[:, 4:] >> 4) << 6, (m[:, 4:] >> 4) << 6  # the top 2 bits of scales / mins 4..7
        lows = (s[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
        scales = np.concatenate([(s[:, :4] & 63) | hi_s, (m[:, :4] & 63) | hi_m, lows], axis=-1)
        parts = [d, _fp16_bytes(f.dmin), scales]
        if t.name == "Q5_K":
            parts.append(_crumbs(q >> 4, 1))  # bit j of byte i: the high bit of sub-block j's element i
        parts.append(_crumbs(q & 15, 4))
    elif t.name == "Q2_K":
        m = f.m.reshape(nb, t.nsub).numpy().astype(np.uint8)
        parts = [sc.astype(np.uint8) | (m << 4), _crumbs(q, 2), d, _fp16_bytes(f.dmin)]
    elif t.name == "Q3_K":
        s6 = (sc + 32).astype(np.uint8)
        lo, hi = s6 & 15, s6 >> 4
        scales = np.concatenate([lo[:, :8] | (lo[:, 8:] << 4),
                                 hi[:, :4] | (hi[:, 4:8] << 2) | (hi[:, 8:12] << 4) | (hi[:, 12:] << 6)],
                                axis=-1)  # fmt: skip
        parts = [_crumbs(q >> 2, 1), _crumbs(q & 3, 2), scales, d]
    else:  # Q6_K: low nibbles two 32-value groups per 32 bytes (of each 128 values), high crumbs 4 groups
        low = (q & 15).reshape(nb, 2, 2, 2, 32)  # [half of 128, nibble, row of 32, element]
        ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128).astype(np.uint8)
        parts = [ql, _crumbs(q >> 4, 2), sc.astype(np.int8).view(np.uint8), d]
    return np.concatenate(parts, axis=-1).reshape(out, -1)
