"""GGUF's asymmetric legacy types ``Q4_1`` / ``Q5_1`` solved on their own stored grid (issue 72).

llama.cpp writes these where a preset's type does not fit: ``Q5_K`` falls back to ``Q5_1`` for an input width
that is not a multiple of 256 (``tensor_type_fallback`` in ``src/llama-quant.cpp``: Q5_K_M's and Q3_K_M's
576-wide layers of SmolLM2), and the ``Q4_0`` preset with an importance matrix writes the first eighth of
``ffn_down`` as ``Q4_1``.  A block of 32 weights stores fp16 ``d`` and ``m`` and codes ``q`` in
``0 .. 2**bits - 1``; the weight is ``d * q + m`` in float32 (what ``gguf.quants`` and ggml compute).

The grid is fixed before the solve, as llama.cpp's ``quantize_row_q5_1_impl`` chooses it with an imatrix:
per block the weighted min/max search :func:`qkx3` (``make_qkx3_quants``: 37 inverse scales around
``nmax / (max - min)``, the weighted least-squares scale and min for each one's codes, the min kept <= 0),
each weight's error weighted by its input's importance ``diag(H)`` (llama.cpp's imatrix holds the same
mean squared activations); ``d`` and ``m`` are rounded to fp16.  Then GPTQ (the Babai paper's
nearest-plane loop) rounds each column to ``d * q + m`` with error feedback, nothing refitted, so the
export is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["LType", "L_TYPES", "BLOCK", "qkx3", "fit", "qx", "fit_sym", "dequantize", "pack"]

BLOCK = 32


@dataclass(frozen=True)
class LType:
    name: str
    qmax: int  # codes 0 .. qmax
    with_min: bool = True  # the weight is ``scale * q - zero`` (``zero = -m``), as for the k-quants
    offset: int = 0

    @property
    def bits(self) -> int:
        return self.qmax.bit_length()


L_TYPES = {t.name: t for t in (LType("Q4_1", 15), LType("Q5_1", 31))}


def _sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(-1).double()  # float32 sums of a block (as ggml), the rest in float64


def qkx3(
    x: torch.Tensor, wt: torch.Tensor, nmax: int, rmin: float = -0.9, rdelta: float = 0.05, nstep: int = 36
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scale, min, codes)`` per row of ``x`` ``[..., n]`` minimizing ``sum(wt * (scale * q + min - x)**2)``
    with codes ``0 .. nmax`` and ``min <= 0``: llama.cpp's ``make_qkx3_quants`` (``ggml-quants.c``), for
    every row at once (codes and sums in float32 as ggml, the rest in float64; each candidate's error from
    the sums: ``s^2 Sqq + 2 s m Sq + m^2 Sw - 2 s Sqx - 2 m Sx + Sxx``)."""
    x, wt = x.float(), wt.float()
    lo = x.amin(-1).clamp(max=0)
    span = (x.amax(-1) - lo).double()
    ok = span > 0
    safe = torch.where(ok, span, 1)
    xs = x - lo[..., None]
    sw, sx, sxx = _sum(wt), _sum(wt * x), _sum(wt * x * x)

    def codes(iscale):
        return (iscale.float()[..., None] * xs).round_().clamp_(0, nmax)

    def sums(q):
        wq = wt * q
        return _sum(wq), _sum(wq * q), _sum(wq * x)

    def error(s, m, sl, sl2, sxl):
        return s * s * sl2 + 2 * s * m * sl + m * m * sw - 2 * s * sxl - 2 * m * sx + sxx

    best_inv = nmax / safe
    best_s, best_m = torch.where(ok, span / nmax, 0), lo.double()
    best = error(best_s, best_m, *sums(codes(best_inv)))
    for step in range(nstep + 1):
        inv = (rmin + rdelta * step + nmax) / safe
        sl, sl2, sxl = sums(codes(inv))
        det = sw * sl2 - sl * sl
        good = ok & (det > 0)
        sdet = torch.where(good, det, 1)
        s, m = (sw * sxl - sx * sl) / sdet, (sl2 * sx - sl * sxl) / sdet
        pos = m > 0
        s = torch.where(pos, sxl / torch.where(sl2 > 0, sl2, 1), s)
        m = torch.where(pos, 0, m)
        err = error(s, m, sl, sl2, sxl)
        better = good & (err < best)
        best = torch.where(better, err, best)
        best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
        best_inv = torch.where(better, inv, best_inv)
    q = torch.where(ok[..., None], codes(best_inv), 0)
    return best_s, best_m, q.long()


def fit(W: torch.Tensor, importance: torch.Tensor, t: LType) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d, m)``: fp16 ``[out, in / 32]`` of ``W`` ``[out, in]`` as type ``t``, each block's weighted
    :func:`qkx3` (module doc) with input weights ``importance`` ``[in]``."""
    out, n = W.shape
    x = W.double().reshape(out, n // BLOCK, BLOCK)
    wt = importance.double().reshape(1, n // BLOCK, BLOCK).expand_as(x)
    s, m, _ = qkx3(x, wt, t.qmax)
    return s.to(torch.float16), m.to(torch.float16)


def qx(x: torch.Tensor, wt: torch.Tensor, nmax: int, ntry: int = 9) -> torch.Tensor:
    """The float scale per row of ``x`` ``[..., n]`` of the symmetric legacy types (``Q4_0``: ``nmax`` 8,
    ``Q5_0``: 16), codes ``-nmax .. nmax - 1``: llama.cpp's ``make_qx_quants`` with importance weights
    (``rmse_type`` 1, ``ggml-quants.c``), for every row at once.  The signed extreme ``max`` maps to
    ``-nmax``; for the inverse scales ``-(nmax + 0.1 i) / max``, ``i`` in ``-ntry .. ntry``, each one's codes
    give the weighted least-squares scale ``sum(wt q x) / sum(wt q^2)``, and the one with the largest
    ``sum(wt q x)^2 / sum(wt q^2)`` (the least weighted error) is kept, ``i = 0`` first."""
    x, wt = x.float(), wt.float()
    idx = x.abs().argmax(-1, keepdim=True)
    mx = x.gather(-1, idx)[..., 0].double()
    ok = mx != 0
    safe = torch.where(ok, mx, 1)
    best_s = torch.zeros_like(mx)
    best = torch.full_like(mx, -1.0)
    for i in (0, *(j for j in range(-ntry, ntry + 1) if j)):
        inv = (-(nmax + 0.1 * i) / safe).float()
        q = (inv[..., None] * x).round_().clamp_(-nmax, nmax - 1)
        wq = wt * q
        sl2, slx = _sum(wq * q), _sum(wq * x)
        good = ok & (sl2 > 0)
        s = slx / torch.where(good, sl2, 1)
        gain = torch.where(good, s * slx, -1.0)
        better = gain > best
        best, best_s = torch.where(better, gain, best), torch.where(better, s, best_s)
    return torch.where(ok, best_s, 0)


def fit_sym(W: torch.Tensor, importance: torch.Tensor, nmax: int) -> torch.Tensor:
    """``d``: fp16 ``[out, in / 32]`` of ``W`` ``[out, in]`` as a symmetric legacy type (``Q4_0`` / ``Q5_0``),
    each block's weighted :func:`qx` with input weights ``importance`` ``[in]``."""
    out, n = W.shape
    x = W.double().reshape(out, n // BLOCK, BLOCK)
    wt = importance.double().reshape(1, n // BLOCK, BLOCK).expand_as(x)
    return qx(x, wt, nmax).to(torch.float16)


def dequantize(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The float32 weights ``d * q + m`` (``q`` ``[out, in]``, ``d``/``m`` fp16 ``[out, in / 32]``)."""
    out = q.shape[0]
    w = d.float()[..., None] * q.reshape(out, -1, BLOCK).float() + m.float()[..., None]
    return w.reshape(out, -1)


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, t: LType) -> np.ndarray:
    """The GGUF bytes uint8 ``[out, in / 32 * type size]``: per block ``d``, ``m`` (fp16), Q5_1 the 32 high
    bits (``qh``, bit ``j`` of element ``j``, little-endian), then 16 bytes of nibbles (byte ``j``: element
    ``j`` low, element ``j + 16`` high)."""
    out = q.shape[0]
    qb = q.reshape(-1, BLOCK).numpy().astype(np.uint32)
    parts = [d.reshape(-1, 1).numpy().view(np.uint8), m.reshape(-1, 1).numpy().view(np.uint8)]
    if t.bits == 5:
        qh = ((qb >> 4) & 1) << np.arange(BLOCK, dtype=np.uint32)
        parts.append(qh.sum(-1, dtype=np.uint32).astype("<u4").reshape(-1, 1).view(np.uint8))
    low = (qb & 15).astype(np.uint8)
    parts.append(low[:, :16] | (low[:, 16:] << 4))
    return np.concatenate(parts, axis=-1).reshape(out, -1)
