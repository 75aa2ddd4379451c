"""The pure-torch paths of the packed kernels (no compiled extension, ``$BITMOSAIC_NO_EXT=1``): the span
order and unpacking of :mod:`.qmatmul`'s layout, the row dequantization of :mod:`.qmatmul` and :mod:`.lut`,
and the tiled product.  Plain functions of the layout's tensors, so that :mod:`.ops` runs them inside its
operators and the kernel classes call the same code."""

from __future__ import annotations

import torch

from ..formats import bitplane as bp
from ..formats.grid import dequantize_codes

__all__ = [
    "SPAN",
    "span_order",
    "unpack_any",
    "tiled_matmul_torch",
    "lowbit_dequantize",
    "bitplane_dequantize",
]

SPAN = 64  # codes per span (qmatmul's module doc)


def span_order(length: int) -> torch.Tensor:
    """Stored position ``p`` of a group padded to whole spans holds code ``order[p]``: within a span,
    lane ``i = p // 4`` holds codes ``i, 16 + i, 32 + i, 48 + i`` (``t = p % 4``)."""
    n = -(-length // SPAN) * SPAN
    p = torch.arange(n)
    return (p // SPAN) * SPAN + 16 * (p % 4) + (p % SPAN) // 4


def unpack_any(seg: torch.Tensor, b: int, cols: int) -> torch.Tensor:
    """Inverse of qmatmul's ``_pack_any``: ``seg [rows, spans * 8 * b]`` -> codes ``[rows, cols]``."""
    rows = seg.shape[0]
    words = torch.zeros(rows, seg.shape[1] // b, 8, dtype=torch.uint8)
    words[..., :b] = seg.reshape(rows, -1, b)
    w = words.view(torch.int64)  # little-endian hosts (x86, arm64)
    shifts = torch.arange(8, dtype=torch.int64) * b
    stored = ((w >> shifts) & ((1 << b) - 1)).reshape(rows, -1)
    out = torch.empty_like(stored)
    out[:, span_order(cols)] = stored
    return out[:, :cols]


def tiled_matmul_torch(x2: torch.Tensor, n_rows: int, tile: int, dequantize_rows) -> torch.Tensor:
    """The pure-torch prefill/fallback: ``x2 [M, K]`` times the weight, ``tile`` rows of it dequantized
    at a time by ``dequantize_rows(r0, r1)`` (float32 ``[r1 - r0, K]``); never the whole float weight."""
    y = torch.empty(x2.shape[0], n_rows, dtype=torch.float32)
    for r0 in range(0, n_rows, tile):
        r1 = min(n_rows, r0 + tile)
        torch.mm(x2, dequantize_rows(r0, r1).T, out=y[:, r0:r1])
    return y


def lowbit_dequantize(data, base, rowlen, goff, bits, scales, zeros, K, group_size, row_block, r0, r1):
    """Rows ``r0:r1`` of a :class:`~bitmosaic.kernels.qmatmul.LowBitWeight` (its ``_args()``) in float32:
    unpack the rows' groups at their widths, then ``(c - z) * s``."""
    out = torch.empty(r1 - r0, K, dtype=torch.float32)
    gs, G, rb = group_size, scales.shape[1], row_block
    for b0 in range(r0 - r0 % rb if rb else 0, r1, rb):
        lo, hi = max(b0, r0), min(b0 + rb, r1)
        if lo >= hi:
            continue
        r = b0 // rb
        L = int(rowlen[r])
        start = int(base[r]) + (lo - b0) * L
        rows = data[start : start + (hi - lo) * L].reshape(hi - lo, L)
        shared = gs < SPAN and G > 1 and int(goff[r, 1]) == int(goff[r, 0])  # qmatmul.py: shared spans
        for g in range(G):
            b = int(bits[r, g])
            c0, c1 = g * gs, min(K, (g + 1) * gs)
            skip = c0 % SPAN if shared else 0  # the group's first code in its span
            nbytes = -(-(skip + c1 - c0) // SPAN) * SPAN // 8 * b
            seg = rows[:, int(goff[r, g]) : int(goff[r, g]) + nbytes]
            codes = unpack_any(seg, b, skip + c1 - c0)[:, skip:]
            out[lo - r0 : hi - r0, c0:c1] = dequantize_codes(
                codes.float(), scales[lo:hi, g : g + 1], zeros[lo:hi, g : g + 1]
            )
    return out


def bitplane_dequantize(planes: bp.BitPlanes, scales_t, zeros_t, r0: int, r1: int) -> torch.Tensor:
    """Rows ``r0:r1`` of a :class:`~bitmosaic.kernels.lut.BitPlaneWeight` in float32 (scales and
    zero-points transposed ``[G, N]``)."""
    codes = bp.unpack(planes, slice(r0, r1))
    gi = torch.arange(planes.K) // planes.group_size
    return dequantize_codes(codes.float(), scales_t.T[r0:r1, gi], zeros_t.T[r0:r1, gi])
