"""llama.cpp's lattice GGUF types ``IQ3_S`` and ``IQ2_XS`` as data: codebooks, byte layouts and the float32
weights llama.cpp (and ``gguf.quants.dequantize``) compute from them (issue 72).

Both split a row into super-blocks of 256 weights with one fp16 ``d``; each run of ``dim`` weights is one
point of a fixed codebook of 512 non-negative vectors (``iq2xs_grid``: 8 values from {8, 25, 43};
``iq3s_grid``: 4 values from {1, 3, .., 15}; E8-lattice-like shells), times a per-weight sign and a
4-bit sub-block scale ``s``:

=======  ====  =========  =======================================  ====================================
type     dim   sub-block  weight                                   bytes per 256 weights
=======  ====  =========  =======================================  ====================================
IQ2_XS   8     16         ``((d * (0.5 + s)) * 0.25 * g) * sign``  2 ``d`` + 32 x uint16 (9-bit index,
                                                                   7-bit sign index) + 8 scales: 74
                                                                   (2.3125 bits)
IQ3_S    4     32         ``((d * (1 + 2 s)) * g) * sign``         2 ``d`` + 64 index bytes + 8 (9th
                                                                   bits) + 32 signs + 4 scales: 110
                                                                   (3.4375 bits)
=======  ====  =========  =======================================  ====================================

IQ2_XS stores 7 of the 8 signs of a point; the eighth is their parity (``ksigns``: the number of negative
weights of every 8 is even).  IQ3_S stores every sign.  ``s`` packs two per byte, low nibble first.

Here a layer is four tensors: ``idx`` (codebook indices 0..511, int16 ``[out, in / dim]``), ``neg``
(1 where a weight is negative, uint8 ``[out, in]``), ``d`` (fp16 ``[out, in / 256]``) and ``s`` (uint8
``[out, in / sub]``).  The codebooks are the ``gguf`` package's (``gguf.quants.IQ2_XS.grid``,
``IQ3_S.grid``), the tables of llama.cpp's ``ggml-common.h``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["QK", "LatticeType", "LATTICE_TYPES", "codebook", "dequantize", "pack", "unpack", "scale_of"]

QK = 256


@dataclass(frozen=True)
class LatticeType:
    name: str
    dim: int  # weights per codebook point
    sub: int  # weights per 4-bit scale
    bytes_per_block: int  # per 256 weights
    parity: bool  # the signs of each point have even parity (only 7 stored)

    @property
    def bits(self) -> float:
        return 8 * self.bytes_per_block / QK

    @property
    def qtype(self):
        import gguf

        return gguf.GGMLQuantizationType[self.name]


LATTICE_TYPES = {
    t.name: t for t in (LatticeType("IQ2_XS", 8, 16, 74, True), LatticeType("IQ3_S", 4, 32, 110, False))
}


@functools.cache
def _codebook_np(name: str) -> np.ndarray:
    from gguf import quants

    cls = getattr(quants, name)
    cls.init_grid()
    return np.ascontiguousarray(cls.grid.reshape(512, -1), dtype=np.float32)


def codebook(t: LatticeType, device=None, dtype=torch.float32) -> torch.Tensor:
    """The 512 points ``[512, dim]`` (non-negative integers as floats)."""
    return torch.from_numpy(_codebook_np(t.name)).to(device=device, dtype=dtype)


def scale_of(d: torch.Tensor, s: torch.Tensor, t: LatticeType) -> torch.Tensor:
    """float32 per sub-block multiplier ``[out, in / sub]`` from ``d`` fp16 ``[out, in / 256]`` and ``s``
    ``[out, in / sub]``, in ggml's order of operations."""
    df = d.float().repeat_interleave(QK // t.sub, dim=1)
    sf = s.float()
    if t.name == "IQ2_XS":
        return (df * (0.5 + sf)) * 0.25
    return df * (1 + 2 * sf)


def dequantize(
    idx: torch.Tensor, neg: torch.Tensor, d: torch.Tensor, s: torch.Tensor, t: LatticeType
) -> torch.Tensor:
    """float32 ``[out, in]``: ``(scale * g) * sign`` as ggml computes it (module doc)."""
    out = idx.shape[0]
    g = codebook(t, idx.device)[idx.long()].reshape(out, -1)  # [out, in]
    db = scale_of(d, s, t).repeat_interleave(t.sub, dim=1)
    sign = 1.0 - 2.0 * neg.float()
    return (db * g) * sign


def _bits(x: np.ndarray) -> np.ndarray:
    """``[..., 8k]`` of 0/1 -> ``[..., k]`` bytes, element ``j`` of 8 in bit ``j``."""
    b = x.reshape(*x.shape[:-1], -1, 8).astype(np.uint8)
    return (b << np.arange(8, dtype=np.uint8)).sum(-1, dtype=np.uint8)


def _unbits(x: np.ndarray) -> np.ndarray:
    return ((x[..., None] >> np.arange(8, dtype=np.uint8)) & 1).reshape(*x.shape[:-1], -1)


def _nibbles(s: np.ndarray) -> np.ndarray:
    s = s.astype(np.uint8)
    return s[..., 0::2] | (s[..., 1::2] << 4)


def pack(
    idx: torch.Tensor, neg: torch.Tensor, d: torch.Tensor, s: torch.Tensor, t: LatticeType
) -> np.ndarray:
    """uint8 ``[out, in / 256 * bytes_per_block]``: the GGUF blocks.  IQ2_XS: every point's signs must have
    even parity (ValueError otherwise)."""
    out, n = neg.shape
    nb = n // QK
    idx = idx.cpu().numpy().astype(np.uint16).reshape(out, nb, -1)
    ng = neg.cpu().numpy().astype(np.uint8).reshape(out, nb, -1, t.dim)
    dd = d.cpu().to(torch.float16).numpy().reshape(out, nb, 1).view(np.uint8)
    sc = _nibbles(s.cpu().numpy().reshape(out, nb, -1))
    if t.name == "IQ2_XS":
        if bool((ng.sum(-1) % 2).any()):
            raise ValueError(
                "IQ2_XS: a point with an odd number of negative signs (the type stores even parity)"
            )
        sign7 = (ng[..., :7] << np.arange(7, dtype=np.uint8)).sum(-1, dtype=np.uint16)
        qs = (idx | (sign7 << 9)).astype("<u2").view(np.uint8)
        return np.concatenate([dd, qs, sc], axis=-1).reshape(out, -1)
    qs = (idx & 255).astype(np.uint8)
    qh = _bits((idx >> 8).astype(np.uint8))
    signs = _bits(ng.reshape(out, nb, QK))
    return np.concatenate([dd, qs, qh, signs, sc], axis=-1).reshape(out, -1)


def unpack(data: np.ndarray, t: LatticeType, n: int):
    """The inverse of :func:`pack`: ``(idx int16, neg uint8, d fp16, s uint8)`` (module doc)."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    out = data.shape[0]
    nb = n // QK
    b = data.reshape(out, nb, t.bytes_per_block)
    d = torch.from_numpy(b[..., :2].copy().view(np.float16).reshape(out, nb))
    sc = b[..., -QK // t.sub // 2 :]
    s = np.stack([sc & 15, sc >> 4], axis=-1).reshape(out, -1)
    if t.name == "IQ2_XS":
        qs = b[..., 2:66].copy().view("<u2").astype(np.uint16)  # [out, nb, 32]
        idx = qs & 511
        sign7 = (qs >> 9).astype(np.uint8)
        low = _unbits(sign7[..., None]).reshape(out, nb, 32, 8)[..., :7]
        neg = np.concatenate([low, low.sum(-1, keepdims=True) % 2], axis=-1)
    else:
        idx = b[..., 2:66].astype(np.uint16) | (_unbits(b[..., 66:74]).astype(np.uint16) << 8)
        neg = _unbits(b[..., 74:106])
    idx = torch.from_numpy(idx.reshape(out, -1).astype(np.int16))
    return (
        idx,
        torch.from_numpy(neg.reshape(out, n).astype(np.uint8)),
        d,
        torch.from_numpy(s.astype(np.uint8)),
    )
