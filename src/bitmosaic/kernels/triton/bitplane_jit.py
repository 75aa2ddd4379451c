"""``@triton.jit`` bodies of SFMP's bit-plane kernels (imported lazily: see the package doc).

Both read the block-major bit planes of :mod:`bitmosaic.formats.bitplane` (as int32 words) the same way:
per group the block's width ``q`` and word offset, per 32-column chunk ``q`` plane words per row, each code
rebuilt as ``sum_i 2^i W_i`` and dequantized ``(c - z) * s`` with ``s``/``z`` stored transposed ``[G, N]``
(as :class:`~bitmosaic.kernels.lut.BitPlaneWeight` keeps them).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .intmm_jit import to_dtype


@triton.jit
def _tile(rb, t, N, RB):
    """Rows of 16-row tile ``t`` of row block ``rb``: their indices, mask and the tile's row count."""
    rows_in_block = tl.minimum(RB, N - rb * RB)
    rt = tl.minimum(16, rows_in_block - t * 16)  # rows of this tile (<= 0: nothing here)
    lr = tl.arange(0, 16)
    return rb * RB + t * 16 + lr, lr < rt, rt


@triton.jit
def _chunk(w_ptr, base, c, q, rt, rmask, j):
    """The integer codes ``[16, 32]`` of chunk ``c`` (32 columns) of a tile, from its ``q`` plane words."""
    lr = tl.arange(0, 16)
    code = tl.zeros((16, 32), dtype=tl.int32)
    for i in range(0, q):
        w = tl.load(w_ptr + base + (c * q + i) * rt + lr, mask=rmask, other=0)
        code += ((w[:, None] >> j[None, :]) & 1) << i
    return code


@triton.jit
def bitplane_gemv_kernel(x_ptr, w_ptr, off_ptr, bits_ptr, s_ptr, z_ptr, y_ptr, N, K, G, GS, RB,
                         stride_xm, stride_ym):  # fmt: skip
    """``y[m, rows] = x[m] Wᵀ`` for one 16-row tile (grid axis 1) of row block ``rb`` (axis 0), row ``m`` of
    ``x`` (axis 2): float32 multiply-adds."""
    rb = tl.program_id(0)
    t = tl.program_id(1)
    m = tl.program_id(2)
    row, rmask, rt = _tile(rb, t, N, RB)
    j = tl.arange(0, 32)
    acc = tl.zeros((16,), dtype=tl.float32)
    for g in range(0, G):
        q = tl.load(bits_ptr + rb * G + g).to(tl.int32)
        L = tl.minimum(GS, K - g * GS)
        nch = (L + 31) // 32
        base = tl.load(off_ptr + rb * G + g) // 4 + t * 16 * nch * q  # words; earlier tiles are full
        s = tl.load(s_ptr + g * N + row, mask=rmask, other=0.0)
        z = tl.load(z_ptr + g * N + row, mask=rmask, other=0.0)
        for c in range(0, nch):
            col = c * 32 + j
            x = tl.load(x_ptr + m * stride_xm + g * GS + col, mask=col < L, other=0.0).to(tl.float32)
            wd = (_chunk(w_ptr, base, c, q, rt, rmask, j).to(tl.float32) - z[:, None]) * s[:, None]
            acc += tl.sum(tl.where(rmask[:, None] & (col < L)[None, :], wd * x[None, :], 0.0), axis=1)
    tl.store(y_ptr + m * stride_ym + row, to_dtype(acc, y_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def bitplane_dequant_kernel(w_ptr, off_ptr, bits_ptr, s_ptr, z_ptr, out_ptr, rb0, r0, N, K, G, GS, RB):
    """Rows of ``W`` in float32, ``(c - z) * s``, into ``out_ptr`` ``[rows, K]`` (its row 0 is row ``r0``):
    one 16-row tile (grid axis 1) of row block ``rb0 + axis 0``, one group (axis 2)."""
    rb = rb0 + tl.program_id(0)
    t = tl.program_id(1)
    g = tl.program_id(2)
    row, rmask, rt = _tile(rb, t, N, RB)
    j = tl.arange(0, 32)
    q = tl.load(bits_ptr + rb * G + g).to(tl.int32)
    L = tl.minimum(GS, K - g * GS)
    nch = (L + 31) // 32
    base = tl.load(off_ptr + rb * G + g) // 4 + t * 16 * nch * q
    s = tl.load(s_ptr + g * N + row, mask=rmask, other=0.0)
    z = tl.load(z_ptr + g * N + row, mask=rmask, other=0.0)
    for c in range(0, nch):
        col = c * 32 + j
        wd = (_chunk(w_ptr, base, c, q, rt, rmask, j).to(tl.float32) - z[:, None]) * s[:, None]
        ptr = out_ptr + (row - r0)[:, None] * K + g * GS + col[None, :]
        tl.store(ptr, wd, mask=rmask[:, None] & (col < L)[None, :])
