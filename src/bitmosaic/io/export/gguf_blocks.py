"""GGUF's block types as bitmosaic integer grids: which of our layers a type holds exactly, and its blocks.

The legacy GGML types quantize each row in blocks of 32 consecutive weights, one or two fp16 numbers per
block (what ``gguf.quants.dequantize`` and llama.cpp compute):

=======  ====================  ==========================  ==========================================
type     stored per block      weight                      holds a bitmosaic layer exactly when
=======  ====================  ==========================  ==========================================
Q4_0     d, 32 x 4-bit q       ``d * (q - 8)``             every ``code - zero`` is in [-8, 7]
Q5_0     d, 32 x 5-bit q       ``d * (q - 16)``            every ``code - zero`` is in [-16, 15]
Q8_0     d, 32 x int8 q        ``d * q``                   every ``code - zero`` is in [-128, 127]
Q4_1     d, m, 32 x 4-bit q    ``d * q + m``               a block's codes span at most 16 values and
Q5_1     d, m, 32 x 5-bit q    ``d * q + m``               ``m = -k * d`` is an fp16 number (32 values)
=======  ====================  ==========================  ==========================================

with ``d`` our fp16 scale: the groups must be contiguous (no act-order ``g_idx``) and a multiple of 32
columns (a group of 128 is four blocks with the same scale).  Our asymmetric value
``(code - zero) * scale`` is ``d * q + m`` with ``q = code - zero + k`` and ``m = -k * d`` for any
shift ``k`` that keeps ``q`` on the grid (or, mirrored, ``d = -scale``, ``q = k - code + zero``,
``m = k * d``); :func:`fit` takes, per block, one whose ``m`` fp16 holds exactly (``k`` a power of two
always does).  A block whose codes span the whole grid has one shift per direction, so whether its
``m`` is exact depends on its scale's low bits: such blocks are refused (``--lossy``: ``m`` rounded to
fp16, an error below 2**-11 of ``m``).

The exporter packs the blocks (:func:`pack`) and checks them by dequantizing them with ``gguf.quants``
against the layer's own dequantization, bit for bit.  Float tensors take the first float type that holds
them exactly (:func:`float_tensor`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["BLOCK", "BlockType", "BLOCK_TYPES", "Fit", "fit", "float_tensor", "pack"]

BLOCK = 32


@dataclass(frozen=True)
class BlockType:
    name: str
    bits: int
    with_min: bool  # ``d * q + m`` (``_1``) rather than ``d * (q - offset)``

    @property
    def offset(self) -> int:
        return 0 if self.with_min or self.bits == 8 else 1 << (self.bits - 1)

    @property
    def value_range(self) -> tuple[int, int]:
        """The integers ``q - offset`` a symmetric block holds."""
        if self.bits == 8:
            return -128, 127
        return -self.offset, (1 << self.bits) - 1 - self.offset

    @property
    def qtype(self):
        import gguf

        return gguf.GGMLQuantizationType[self.name]


BLOCK_TYPES = {t.name: t for t in (BlockType("Q4_0", 4, False), BlockType("Q4_1", 4, True),
                                   BlockType("Q5_0", 5, False), BlockType("Q5_1", 5, True),
                                   BlockType("Q8_0", 8, False))}  # fmt: skip


@dataclass
class Fit:
    q: torch.Tensor  # int64 [out, in]: the stored integers (Q8_0: signed)
    d: torch.Tensor  # fp16 [out, in/32]
    m: torch.Tensor | None  # fp16 [out, in/32] (``_1`` types)
    wide: int  # blocks whose integers span more than the type holds (no exact form; clamped)
    inexact_m: int  # blocks whose ``m`` fp16 cannot hold exactly (rounded)


def fit(values: torch.Tensor, scales: torch.Tensor, t: BlockType) -> Fit:
    """Blocks of type ``t`` for signed integers ``values`` (``code - zero``, int64 ``[out, in]``) with
    one fp16 scale per block ``scales`` (``[out, in/32]``).  Exact when ``wide == inexact_m == 0``;
    otherwise the integers are clamped to the type's range and ``m`` rounded to fp16 (what ``--lossy``
    takes when only ``m`` is inexact)."""
    out, n = values.shape
    v = values.reshape(out, n // BLOCK, BLOCK)
    vmin, vmax = v.amin(-1), v.amax(-1)
    maxq = (1 << t.bits) - 1
    if not t.with_min:
        lo, hi = t.value_range
        wide = int(((vmin < lo) | (vmax > hi)).sum())
        q = v.clamp(lo, hi) + t.offset
        return Fit(q.reshape(out, n), scales.to(torch.float16), None, wide, 0)
    s = scales.float()
    none = 1 << 40
    k, sign = torch.full_like(vmin, none), torch.ones_like(vmin)
    for cand in sorted(range(-maxq, maxq + 1), key=abs):  # small shifts first
        for sg in (1, -1):  # d = -scale stores the block mirrored: q = k - v, m = k * scale
            lo, hi = (vmin, vmax) if sg == 1 else (-vmax, -vmin)
            m = -sg * cand * s  # exact in float32 (11-bit scale times a 5-bit integer)
            ok = (k == none) & (lo + cand >= 0) & (hi + cand <= maxq) & (m.to(torch.float16).float() == m)
            k = torch.where(ok, torch.full_like(k, cand), k)
            sign = torch.where(ok, torch.full_like(sign, sg), sign)
    missing = k == none
    wide = int((vmax - vmin > maxq).sum())
    inexact = int(missing.sum()) - wide
    k = torch.where(missing, (-vmin).clamp(max=maxq), k)  # lowest code at 0: m rounded, range clamped
    q = (sign[..., None] * v + k[..., None]).clamp(0, maxq)
    d = (sign * s).to(torch.float16)
    m = (-sign * k * s).to(torch.float16)
    return Fit(q.reshape(out, n), d, m, wide, inexact)


def pack(f: Fit, t: BlockType) -> np.ndarray:
    """The GGUF bytes of ``f``: uint8 ``[out, in/32 * type size]`` (the layout ``gguf.quants`` reads)."""
    out, n = f.q.shape
    nb = n // BLOCK
    q = f.q.reshape(out * nb, BLOCK)
    parts = [f.d.reshape(-1, 1).numpy().view(np.uint8)]
    if f.m is not None:
        parts.append(f.m.reshape(-1, 1).numpy().view(np.uint8))
    if t.bits == 8:
        parts.append(q.to(torch.int8).numpy().view(np.uint8))
    else:
        qn = q.to(torch.uint8).numpy()
        if t.bits == 5:
            parts.append(np.packbits(qn >> 4, axis=-1, bitorder="little"))  # the 32 high bits
        low = qn & 0x0F
        parts.append(low[:, : BLOCK // 2] | (low[:, BLOCK // 2 :] << 4))
    return np.concatenate(parts, axis=-1).reshape(out, -1)


def float_tensor(w: torch.Tensor, forced: str | None, file_type, lossy: bool) -> tuple[np.ndarray, str, bool]:
    """``(data, type name, exact)``: ``w`` in the first type of the candidates that holds it exactly
    (``forced``; else the source file's block type, F16, BF16, F32); 1-D tensors in F32."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    x = w.detach().float().contiguous().numpy()
    if x.ndim < 2:
        return x, "F32", True
    if forced:
        cands = [forced]
    else:
        src = getattr(file_type, "name", None)
        cands = [src] if src in BLOCK_TYPES and x.shape[-1] % BLOCK == 0 else []
        cands += ["F16", "BF16", "F32"]
    for c in cands:
        data = quants.quantize(x, Q[c])
        if np.array_equal(np.asarray(quants.dequantize(data, Q[c])).reshape(x.shape), x):
            return data, c, True
    if forced and lossy:
        return data, forced, False
    return None, forced, False
