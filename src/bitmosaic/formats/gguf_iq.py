"""llama.cpp's non-linear 4-bit GGUF types ``IQ4_NL`` and ``IQ4_XS`` as data: the grid, the byte layout and
the float32 weights llama.cpp (and ``gguf.quants.dequantize``) compute from them (issue 72).

Both store 4-bit indices ``q`` into one fixed 16-value grid (``kvalues_iq4nl`` in ggml)::

    KVALUES = -127 -104 -83 -65 -49 -35 -22 -10 1 13 25 38 53 69 89 113

=======  ============  ====================================================  ==================
type     block         stored per block                                      weight
=======  ============  ====================================================  ==================
IQ4_NL   32 weights    fp16 ``d``, 16 bytes of indices                       ``d * KVALUES[q]``
IQ4_XS   256 weights   fp16 ``d``, 8 x 6-bit ``ls`` (one per 32 weights),    ``(d * (ls - 32))
                       128 bytes of indices                                  * KVALUES[q]``
=======  ============  ====================================================  ==================

(18 bytes per 32 weights: 4.5 bits; 136 bytes per 256: 4.25 bits.)  Indices of 32 weights are packed in
16 bytes, byte ``j`` holding weight ``j`` in its low and weight ``j + 16`` in its high nibble.

Here a layer of either type is three tensors: ``codes`` (indices 0..15, ``[out, in]``), ``d`` (fp16
``[out, in / block]``) and ``l`` (the signed sub-block multiplier ``ls - 32`` in [-32, 31], ``[out, in/32]``;
IQ4_NL: all 1).  :func:`dequantize` forms ``(float32(d) * l) * KVALUES[q]`` in float32, which is exactly
what ggml computes (``d * (ls - 32)`` first, then times the grid value; for IQ4_NL ``d * 1`` is ``d``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["KVALUES", "IQType", "IQ_TYPES", "SUB", "dequantize", "pack", "unpack", "row_bytes"]

KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
SUB = 32  # weights per scale multiplier (IQ4_NL: per block; IQ4_XS: per sub-block)


@dataclass(frozen=True)
class IQType:
    name: str
    block: int  # weights per fp16 ``d``
    l_lo: int  # the sub-block multipliers ``l`` it stores
    l_hi: int

    @property
    def nsub(self) -> int:
        return self.block // SUB

    @property
    def bytes_per_block(self) -> int:
        return 2 + (0 if self.block == SUB else 2 + self.nsub // 2) + self.block // 2

    @property
    def bits(self) -> float:
        return 8 * self.bytes_per_block / self.block

    @property
    def qtype(self):
        import gguf

        return gguf.GGMLQuantizationType[self.name]


IQ_TYPES = {t.name: t for t in (IQType("IQ4_NL", 32, 1, 1), IQType("IQ4_XS", 256, -32, 31))}


def grid(device=None, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(KVALUES, dtype=dtype, device=device)


def row_bytes(t: IQType, n: int) -> int:
    return n // t.block * t.bytes_per_block


def dequantize(codes: torch.Tensor, d: torch.Tensor, l: torch.Tensor, t: IQType) -> torch.Tensor:
    """float32 ``[out, in]``: ``(d * l) * KVALUES[codes]`` as ggml computes it (module doc)."""
    out, n = codes.shape
    dl = d.float().repeat_interleave(t.nsub, dim=1) * l.float()  # [out, in/32]
    v = grid(codes.device)[codes.long()].reshape(out, n // SUB, SUB)
    return (dl[..., None] * v).reshape(out, n)


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """``[..., 32]`` indices -> ``[..., 16]`` bytes (weight ``j`` low, ``j + 16`` high)."""
    c = codes.astype(np.uint8)
    return c[..., :16] | (c[..., 16:] << 4)


def pack(codes: torch.Tensor, d: torch.Tensor, l: torch.Tensor, t: IQType) -> np.ndarray:
    """uint8 ``[out, row_bytes]``: the GGUF blocks (the layout ``gguf.quants`` and ggml read)."""
    out, n = codes.shape
    nb = n // t.block
    q = _nibbles(codes.reshape(out, nb, t.nsub, SUB).numpy()).reshape(out, nb, t.block // 2)
    dd = d.to(torch.float16).reshape(out, nb, 1).numpy().view(np.uint8)
    if t.name == "IQ4_NL":
        return np.concatenate([dd, q], axis=-1).reshape(out, -1)
    ls = (l.reshape(out, nb, t.nsub) + 32).numpy().astype(np.uint16)
    hi = np.zeros((out, nb), np.uint16)
    for ib in range(t.nsub):
        hi |= (ls[..., ib] >> 4) << (2 * ib)
    lo = (ls & 15).astype(np.uint8)
    scales_l = lo[..., 0::2] | (lo[..., 1::2] << 4)
    parts = [dd, hi[..., None].view(np.uint8), scales_l, q]
    return np.concatenate(parts, axis=-1).reshape(out, -1)


def unpack(data: np.ndarray, t: IQType, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack`: ``(codes uint8 [out, n], d fp16 [out, n/block], l int8 [out, n/32])``."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    out = data.shape[0]
    nb = n // t.block
    b = data.reshape(out, nb, t.bytes_per_block)
    d = torch.from_numpy(b[..., :2].copy().view(np.float16).reshape(out, nb))
    if t.name == "IQ4_NL":
        qb, l = b[..., 2:], np.ones((out, nb, 1), np.int8)
    else:
        hi = b[..., 2:4].copy().view(np.uint16).reshape(out, nb)
        sl = b[..., 4 : 4 + t.nsub // 2]
        lo = np.stack([sl & 15, sl >> 4], axis=-1).reshape(out, nb, t.nsub)
        h = np.stack([(hi >> (2 * ib)) & 3 for ib in range(t.nsub)], axis=-1).astype(np.uint8)
        l = (lo | (h << 4)).astype(np.int16) - 32
        qb = b[..., 4 + t.nsub // 2 :]
    qb = qb.reshape(out, nb, t.nsub, 16)
    codes = np.concatenate([qb & 15, qb >> 4], axis=-1).reshape(out, n)
    return torch.from_numpy(codes.copy()), d, torch.from_numpy(l.reshape(out, -1).astype(np.int8))
