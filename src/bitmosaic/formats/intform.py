"""The two weight forms an ecosystem checkpoint (GPTQ, compressed-tensors) can hold, as plain data:

- :class:`IntForm`: an affine INT grid, ``W[o, j] = (codes[o, j] - zeros[o, g]) * scales[o, g]`` with
  ``g = g_idx[j]`` -- exactly the packed layout (:mod:`bitmosaic.formats.grid`).
- :class:`FP8Form`: E4M3 values times a float32 scale per channel or tensor.

Each module kind says how its weight maps onto them (``QuantModule.int_form`` / ``fp8_form``);
:func:`embed` puts signed integers on a grid of a given width (exact when every group's range fits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .layout import default_g_idx, dequantize

__all__ = ["IntForm", "FP8Form", "embed", "bit_len", "widest_fit"]


@dataclass
class IntForm:
    codes: torch.Tensor  # int32 [out, in], 0 .. 2**bits - 1
    scales: torch.Tensor  # fp16 [out, G]
    zeros: torch.Tensor  # int32 [out, G], 0 .. 2**bits - 1 (symmetric: all 2**(bits-1))
    g_idx: torch.Tensor  # int32 [in]
    bits: int
    group_size: int  # columns per group (in_features = per-channel)
    symmetric: bool

    @property
    def contiguous(self) -> bool:
        return bool(torch.equal(self.g_idx.long(), default_g_idx(self.codes.shape[1], self.group_size)))

    def values(self) -> torch.Tensor:
        """The signed integers ``code - zero`` (int64 ``[out, in]``)."""
        return self.codes.long() - self.zeros.long().gather(1, self.g_idx.long().expand_as(self.codes))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.codes, self.scales, self.zeros, self.g_idx, dtype=dtype)


@dataclass
class FP8Form:
    values: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor  # float32 [out, 1] or [1, 1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.values.float() * self.scale).to(dtype)


def bit_len(span: int) -> int:
    """Bits an integer range of ``span + 1`` values needs."""
    return max(1, math.ceil(math.log2(span + 1)))


def widest_fit(need: int, allowed: tuple[int, ...]) -> int:
    """The narrowest of ``allowed`` holding ``need`` bits, else the widest."""
    fits = [b for b in allowed if b >= need]
    return fits[0] if fits else max(allowed)


def embed(values: torch.Tensor, scales, g_idx, group_size: int, bits: int, symmetric: bool) -> IntForm:
    """Signed integers ``values = code - zero`` (``[out, in]``) on a ``bits``-bit grid with the same scales:
    exact when every group's range fits (a wider grid holds a narrower one exactly), clamped otherwise.
    Asymmetric groups get the zero nearest the grid's middle that keeps their range on the grid."""
    maxq = (1 << bits) - 1
    v = values.to(torch.int64)
    gi = g_idx.long().expand_as(v)
    G = scales.shape[1]
    if symmetric:
        z = torch.full((v.shape[0], G), 1 << (bits - 1), dtype=torch.int64)
    else:
        lo = torch.full((v.shape[0], G), 1 << 40, dtype=torch.int64).scatter_reduce(1, gi, v, "amin")
        hi = torch.full((v.shape[0], G), -(1 << 40), dtype=torch.int64).scatter_reduce(1, gi, v, "amax")
        z = torch.maximum(torch.minimum(torch.full_like(lo, 1 << (bits - 1)), maxq - hi), -lo).clamp(0, maxq)
    codes = (v + z.gather(1, gi)).clamp(0, maxq)
    return IntForm(
        codes.to(torch.int32),
        scales.to(torch.float16),
        z.to(torch.int32),
        g_idx.to(torch.int32),
        bits,
        group_size,
        symmetric,
    )
