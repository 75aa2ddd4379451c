"""GPTQ on a GGUF type's own stored grid -- llama.cpp's non-linear IQ4 grid (``IQ4_NL`` / ``IQ4_XS``) and the
k-quants (``Q2_K`` .. ``Q6_K``) -- so the GGUF file holds the calibrated weights exactly (issue 72).

k-quants (:func:`kquant_gptq`): the super-block ``d`` / ``dmin`` and the small integer sub-block scales and
mins are fitted first on the original weights by the k-quant fit of
:mod:`bitmosaic.algorithms.gguf_kquants` (``fit_weights``: per sub-block llama.cpp's weighted code search,
then the stored integers and fp16 ``d``/``dmin`` by the weighted least-squares search), each weight's
error weighted by its input's importance ``diag(H)`` as llama.cpp weights it by the imatrix, then fixed;
GPTQ rounds each column to the sub-block's grid ``(d * sc) * q - dmin * m`` (``(d * sc) * (q - offset)``
for Q3_K / Q6_K) -- the float32 numbers ggml computes -- with error feedback.

IQ4:
The grid is fixed before the solve, as the type stores it (:mod:`bitmosaic.formats.gguf_iq`): per 32
weights a multiplier ``d * l`` (IQ4_NL: an fp16 ``d`` per block, ``l = 1``; IQ4_XS: one fp16 ``d`` per 256
weights and a 6-bit ``l`` in [-32, 31] per 32), chosen from the original weights by a search over that
encoding, each weight's error weighted by its input's importance ``diag(H)`` (what llama.cpp's importance
matrix holds: the mean squared activation of each input):

1. per 32 weights, the float scale of llama.cpp's ``quantize_row_iq4_nl_impl`` search: for 15 inverse
   scales around ``-127 / max`` the nearest grid indices, then the weighted least-squares scale for them;
2. IQ4_NL: each of those least-squares scales rounded to fp16, the one with the least weighted error of
   its nearest indices kept;  IQ4_XS: per super-block, fp16 ``d`` candidates ``amax_scale / k`` for
   ``k`` in [-32, -20] and [20, 31], each sub-block's ``l = round(scale / d)`` clamped, the ``d`` with the
   least weighted error of the super-block's nearest indices kept.

Then GPTQ (Frantar et al.; the Babai paper's nearest-plane loop, Algorithm 1) runs with these groups
static: each column to the nearest grid value ``(d * l) * KVALUES[q]`` -- in float32 the very number ggml
computes -- and its error onto the later columns.  Nothing is refitted afterwards, so the export is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..formats import gguf_iq as iq
from ..formats.grid import IntGrid
from . import gguf_kquants as kq
from . import gguf_legacy as gl
from .gptq import gptq_quantize
from .types import QuantResult

__all__ = [
    "GGUFGridResult",
    "IQColumnQuantizer",
    "KColumnQuantizer",
    "importance",
    "iq_scales",
    "iq_gptq",
    "kquant_gptq",
    "legacy_gptq",
    "legacy_sym_gptq",
    "SYM_NMAX",
]

_NTRY = 7  # llama.cpp's inverse-scale tries either side of -127 / max


def _nearest(y: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Index of the grid value nearest ``y`` (ties to the lower one)."""
    mids = (kv[1:] + kv[:-1]) / 2
    return torch.bucketize(y.contiguous(), mids)


def _div(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.where(s != 0, x / torch.where(s != 0, s, 1), 0)


@dataclass(frozen=True)
class IQColumnQuantizer:
    """One column to the nearest value of the grid times ``scale * zero`` (``d`` and ``l`` of its group)."""

    def fit(self, cols: torch.Tensor):  # pragma: no cover - the groups are always given (static)
        raise RuntimeError("IQ4 groups are fixed before the solve (pass scales)")

    def quantize(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
        kv = iq.grid(w.device, w.dtype)
        dl = scale * zero
        q = _nearest(_div(w, dl), kv)
        return q.to(w.dtype), dl * kv[q]


@dataclass(frozen=True)
class KColumnQuantizer:
    """One column to the nearest code of its sub-block: ``scale * q - zero`` (types with a min: ``scale`` is
    ``d * sc``, ``zero`` is ``dmin * m``) or ``scale * (q - offset)``; codes clamped to ``0 .. qmax``."""

    t: kq.KType

    def fit(self, cols: torch.Tensor):  # pragma: no cover - the groups are always given (static)
        raise RuntimeError("k-quant groups are fixed before the solve (pass scales)")

    def quantize(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
        t = self.t
        if t.with_min:
            q = _div(w + zero, scale).round().clamp(0, t.qmax)
            return q, scale * q - zero
        q = (_div(w, scale).round() + t.offset).clamp(0, t.qmax)
        return q, scale * (q - t.offset)


def _block_scales(x: torch.Tensor, wt: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Float scale per row of ``x`` ``[m, 32]`` (weights ``wt``): llama.cpp's IQ4_NL search (module doc)."""
    idx = x.abs().argmax(-1, keepdim=True)
    amax = x.gather(-1, idx)[..., 0]
    best_s = _div(amax, torch.full_like(amax, kv[0].item()))
    best = torch.full_like(amax, -1.0)
    for itry in range(-_NTRY, _NTRY + 1):
        inv = _div(torch.full_like(amax, itry + kv[0].item()), amax)
        v = kv[_nearest(x * inv[:, None], kv)]
        sumqx, sumq2 = (wt * x * v).sum(-1), (wt * v * v).sum(-1)
        score = torch.where(sumq2 > 0, sumqx * sumqx / torch.where(sumq2 > 0, sumq2, 1), 0)
        better = score > best
        best = torch.where(better, score, best)
        best_s = torch.where(better, _div(sumqx, sumq2), best_s)
    return best_s


def _error(x: torch.Tensor, wt: torch.Tensor, dl: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Weighted squared error per row of ``x`` ``[m, 32]`` at its nearest indices for multipliers ``dl``."""
    v = kv[_nearest(_div(x, dl[:, None]), kv)] * dl[:, None]
    return (wt * (x - v) ** 2).sum(-1)


def iq_scales(W: torch.Tensor, importance: torch.Tensor, t: iq.IQType) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d, l)``: the stored scales of ``W`` ``[out, in]`` as type ``t`` (module doc) -- ``d`` fp16
    ``[out, in / t.block]``, ``l`` int8 ``[out, in / 32]`` -- for input weights ``importance`` ``[in]``."""
    out, n = W.shape
    kv = iq.grid(W.device, torch.float32)
    x = W.float().reshape(-1, iq.SUB)
    wt = importance.float().reshape(1, n // iq.SUB, iq.SUB).expand(out, -1, -1).reshape(-1, iq.SUB)
    s = _block_scales(x, wt, kv)
    if t.name == "IQ4_NL":
        d = s.half()
        return d.reshape(out, -1), torch.ones(out, n // iq.SUB, dtype=torch.int8, device=W.device)
    sb = s.reshape(-1, t.nsub)  # one row per super-block
    amax = sb.gather(-1, sb.abs().argmax(-1, keepdim=True))[..., 0]
    best_err = torch.full_like(amax, float("inf"))
    best_d, best_l = torch.zeros_like(amax), torch.zeros_like(sb)
    for k in [*range(-32, -19), *range(20, 32)]:
        d = (amax / k).half().float()
        d = torch.where(torch.isfinite(d), d, 0)
        l = _div(sb, d[:, None]).round().clamp(t.l_lo, t.l_hi)
        err = _error(x, wt, (d[:, None] * l).reshape(-1), kv).reshape(-1, t.nsub).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_d, best_l = torch.where(better, d, best_d), torch.where(better[:, None], l, best_l)
    return best_d.half().reshape(out, -1), best_l.to(torch.int8).reshape(out, -1)


def importance(H: torch.Tensor) -> torch.Tensor:
    """Each input's weight in the scale search: ``diag(H)`` (llama.cpp's importance matrix holds the same
    mean squared activations), floored at 1e-3 of its mean so dead inputs still count a little."""
    imp = torch.diagonal(H).float().clamp(min=0)
    return imp + 1e-3 * imp.mean().clamp(min=1e-12)


@dataclass
class GGUFGridResult(QuantResult):
    """Codes are grid indices 0..15; ``scales`` hold each 32-weight group's fp16 ``d`` (repeated over an
    IQ4_XS super-block), ``zeros`` its multiplier ``l``: the weight is ``(scale * zero) * KVALUES[code]``."""

    gguf_type: str = field(kw_only=True)
    # k-quants: the stored per-row integers and fp16 numbers (``sc``, ``m``, ``d``, ``dmin``; see KFit)
    aux: dict = field(default_factory=dict, kw_only=True)

    @property
    def iq_type(self) -> iq.IQType:
        return iq.IQ_TYPES[self.gguf_type]

    def stored(self):
        """IQ4: ``(codes uint8, d fp16 [out, in/block], l int8 [out, in/32])``; a k-quant: its
        :class:`~bitmosaic.algorithms.gguf_kquants.KFit`; Q4_1 / Q5_1: ``(codes, d, m)`` -- as the type
        stores them."""
        if self.gguf_type in kq.K_TYPES:
            a = self.aux
            return kq.KFit(self.codes.long(), a["sc"], a.get("m"), a["d"], a.get("dmin"), 0, a["sc"].numel())
        if self.gguf_type in gl.L_TYPES:  # Q4_1 / Q5_1: (codes, d, m)
            return self.codes.long(), self.aux["d"], self.aux["m"]
        t = self.iq_type
        return self.codes.to(torch.uint8), self.scales[:, :: t.nsub].half(), self.zeros.to(torch.int8)

    def lattice_scales(self) -> None:
        return None  # a non-uniform grid (or integer scales with mins): no Babai bound

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.gguf_type in kq.K_TYPES:
            return kq.dequantize(self.stored(), kq.K_TYPES[self.gguf_type]).to(dtype)
        if self.gguf_type in gl.L_TYPES:
            return gl.dequantize(*self.stored()).to(dtype)
        return iq.dequantize(*self.stored(), self.iq_type).to(dtype)

    def select_rows(self, start: int, stop: int) -> GGUFGridResult:
        base = super().select_rows(start, stop)
        aux = {k: v[start:stop] for k, v in self.aux.items()}
        return type(self)(
            **{f: getattr(base, f) for f in base.__dataclass_fields__}, gguf_type=self.gguf_type, aux=aux
        )

    @classmethod
    def cat_rows(cls, parts: list[QuantResult]) -> GGUFGridResult:
        base = QuantResult.cat_rows(parts)
        aux = {k: torch.cat([p.aux[k] for p in parts]) for k in parts[0].aux}
        return replace(parts[0], aux=aux, **{f: getattr(base, f) for f in base.__dataclass_fields__})


def iq_gptq(
    W: torch.Tensor,
    H: torch.Tensor,
    gguf_type: str,
    *,
    perm=None,
    block_size: int = 128,
    percdamp: float = 0.01,
    dtype=None,
    overwrite_hessian: bool = False,
) -> GGUFGridResult:
    """GPTQ of ``W`` ``[out, in]`` against ``H`` on the ``gguf_type`` grid, its scales fixed first
    (module doc)."""
    t = iq.IQ_TYPES[gguf_type]
    d, l = iq_scales(W, importance(H), t)
    scales = d.float().repeat_interleave(t.nsub, dim=1)
    res = gptq_quantize(
        W,
        H,
        None,
        iq.SUB,
        perm=perm,
        block_size=block_size,
        percdamp=percdamp,
        dtype=dtype,
        scales=scales,
        zeros=l.float(),
        quantizer=IQColumnQuantizer(),
        overwrite_hessian=overwrite_hessian,
    )
    return GGUFGridResult(**{f: getattr(res, f) for f in res.__dataclass_fields__}, gguf_type=gguf_type)


def kquant_gptq(
    W: torch.Tensor,
    H: torch.Tensor,
    gguf_type: str,
    *,
    perm=None,
    block_size: int = 128,
    percdamp: float = 0.01,
    dtype=None,
    overwrite_hessian: bool = False,
) -> GGUFGridResult:
    """GPTQ of ``W`` ``[out, in]`` against ``H`` on the k-quant ``gguf_type``'s stored grid, its scales and
    mins fitted first and fixed (module doc)."""
    t = kq.K_TYPES[gguf_type]
    f = kq.fit_weights(W.float(), t, importance(H))
    out = W.shape[0]
    d = f.d.float().repeat_interleave(t.nsub, dim=1)
    scale = d * f.sc.float()  # float32: ggml's ``d * sc``
    zero = (
        f.dmin.float().repeat_interleave(t.nsub, dim=1) * f.m.float()
        if t.with_min
        else torch.zeros_like(scale)
    )
    res = gptq_quantize(
        W,
        H,
        None,
        t.sub,
        perm=perm,
        block_size=block_size,
        percdamp=percdamp,
        dtype=dtype,
        scales=scale,
        zeros=zero,
        quantizer=KColumnQuantizer(t),
        overwrite_hessian=overwrite_hessian,
    )
    aux = {"sc": f.sc.reshape(out, -1), "d": f.d}
    if t.with_min:
        aux.update(m=f.m.reshape(out, -1), dmin=f.dmin)
    return GGUFGridResult(
        **{k: getattr(res, k) for k in res.__dataclass_fields__}, gguf_type=gguf_type, aux=aux
    )


def legacy_gptq(
    W: torch.Tensor,
    H: torch.Tensor,
    gguf_type: str,
    *,
    perm=None,
    block_size: int = 128,
    percdamp: float = 0.01,
    dtype=None,
    overwrite_hessian: bool = False,
) -> GGUFGridResult:
    """GPTQ of ``W`` ``[out, in]`` against ``H`` on the ``Q4_1`` / ``Q5_1`` grid, each block's fp16 ``d`` and
    ``m`` fitted first by the importance-weighted search (:mod:`.gguf_legacy`) and fixed."""
    t = gl.L_TYPES[gguf_type]
    d, m = gl.fit(W.float(), importance(H), t)
    res = gptq_quantize(
        W,
        H,
        None,
        gl.BLOCK,
        perm=perm,
        block_size=block_size,
        percdamp=percdamp,
        dtype=dtype,
        scales=d.float(),
        zeros=-m.float(),  # ``d * q - (-m)``: the float32 number ggml computes, ``d * q + m``
        quantizer=KColumnQuantizer(t),
        overwrite_hessian=overwrite_hessian,
    )
    return GGUFGridResult(
        **{k: getattr(res, k) for k in res.__dataclass_fields__}, gguf_type=gguf_type, aux={"d": d, "m": m}
    )


SYM_NMAX = {"Q4_0": 8, "Q5_0": 16}  # llama.cpp's ``nmax`` of the symmetric legacy types (codes -nmax..nmax-1)


def legacy_sym_gptq(
    W: torch.Tensor,
    H: torch.Tensor,
    gguf_type: str,
    *,
    perm=None,
    block_size: int = 128,
    percdamp: float = 0.01,
    dtype=None,
    overwrite_hessian: bool = False,
) -> QuantResult:
    """GPTQ of ``W`` ``[out, in]`` against ``H`` on the ``Q4_0`` / ``Q5_0`` grid ``d * (q - nmax)``, each
    block's fp16 ``d`` fitted first by llama.cpp's importance-weighted ``make_qx_quants``
    (:func:`.gguf_legacy.qx`; ``d`` is negative where the block's largest magnitude is positive, so that
    weight lands on the grid's longer side, ``-nmax``, as llama.cpp stores it) and fixed: an integer result
    (codes ``0 .. 2 nmax - 1``, zero ``nmax``) that a symmetric :class:`~.modules.qlinear.QuantLinear`
    holds and the GGUF export writes exactly.  On SmolLM2's linears this fit gives GPTQ 10-70% less
    Hessian-weighted error than the generic MSE search over ``2 max|w| / 15``
    (``benchmarks/gguf/legacy_layer.py``)."""
    nmax = SYM_NMAX[gguf_type]
    d = gl.fit_sym(W.float(), importance(H), nmax).float()
    return gptq_quantize(
        W,
        H,
        IntGrid(nmax.bit_length(), symmetric=True),
        gl.BLOCK,
        perm=perm,
        block_size=block_size,
        percdamp=percdamp,
        dtype=dtype,
        scales=d,
        zeros=torch.full_like(d, float(nmax)),
        overwrite_hessian=overwrite_hessian,
    )
