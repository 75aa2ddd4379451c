"""``@triton.jit`` body of SFMP's bit-plane GEMV (imported lazily: see the package doc)."""

from __future__ import annotations

import triton
import triton.language as tl

from .intmm_jit import to_dtype


@triton.jit
def bitplane_gemv_kernel(x_ptr, w_ptr, off_ptr, bits_ptr, s_ptr, z_ptr, y_ptr, N, K, G, GS, RB,
                         stride_xm, stride_ym):  # fmt: skip
    """``y[m, rows] = x[m] Wᵀ`` for one 16-row tile (grid axis 1) of row block ``rb`` (axis 0), row ``m`` of
    ``x`` (axis 2), read from the block-major bit planes of :mod:`bitmosaic.formats.bitplane`: per group
    the block's width ``q`` and word offset, per 32-column chunk ``q`` plane words per row, each code
    rebuilt as ``sum_i 2^i W_i`` and dequantized ``(c - z) * s`` (float32 multiply-adds)."""
    rb = tl.program_id(0)
    t = tl.program_id(1)
    m = tl.program_id(2)
    rows_in_block = tl.minimum(RB, N - rb * RB)
    rt = tl.minimum(16, rows_in_block - t * 16)  # rows of this tile (<= 0: nothing here)
    lr = tl.arange(0, 16)
    rmask = lr < rt
    row = rb * RB + t * 16 + lr
    j = tl.arange(0, 32)
    acc = tl.zeros((16,), dtype=tl.float32)
    for g in range(0, G):
        q = tl.load(bits_ptr + rb * G + g).to(tl.int32)
        L = tl.minimum(GS, K - g * GS)
        nch = (L + 31) // 32
        base = tl.load(off_ptr + rb * G + g) // 4 + t * 16 * nch * q  # words; earlier tiles are full
        s = tl.load(s_ptr + row * G + g, mask=rmask, other=0.0)
        z = tl.load(z_ptr + row * G + g, mask=rmask, other=0.0)
        for c in range(0, nch):
            col = c * 32 + j
            x = tl.load(x_ptr + m * stride_xm + g * GS + col, mask=col < L, other=0.0).to(tl.float32)
            code = tl.zeros((16, 32), dtype=tl.int32)
            for i in range(0, q):
                w = tl.load(w_ptr + base + (c * q + i) * rt + lr, mask=rmask, other=0)
                code += ((w[:, None] >> j[None, :]) & 1) << i
            wd = (code.to(tl.float32) - z[:, None]) * s[:, None]
            acc += tl.sum(tl.where(rmask[:, None] & (col < L)[None, :], wd * x[None, :], 0.0), axis=1)
    tl.store(y_ptr + m * stride_ym + row, to_dtype(acc, y_ptr.dtype.element_ty), mask=rmask)
