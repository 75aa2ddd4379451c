"""``@triton.jit`` body of MosaicQuant's fused dense base + residual blocks (imported lazily: see the package
doc; MosaicQuant §4.2, ZipperEngine)."""

from __future__ import annotations

import triton
import triton.language as tl

from .intmm_jit import to_dtype, weight_tile


@triton.jit
def _product(acc, x, w, HALF: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + x @ w`` (``w`` float32): float32 IEEE products, or with half ``x`` the tile rounded to
    ``x``'s dtype (tensor cores, float32 accumulator; ``UPCAST``: the same products upcast, for the
    interpreter's bfloat16, as in intmm_jit.gemm_kernel)."""
    if UPCAST:
        acc = tl.dot(x.to(tl.float32), to_dtype(w, x.dtype).to(tl.float32), acc, input_precision="ieee")
    elif HALF:
        acc = tl.dot(x, to_dtype(w, x.dtype), acc)
    else:
        acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
    return acc


@triton.jit
def blockres_kernel(x_ptr, q_ptr, s_ptr, z_ptr, rc_ptr, rs_ptr, rb_ptr, cb_ptr, starts_ptr, cols_ptr, y_ptr,
                  M, N, K, KR, G, GS, NRB, bm, bk, stride_xm, stride_q, stride_ym,
                  BITS: tl.constexpr, HAS_COLS: tl.constexpr, HALF: tl.constexpr, UPCAST: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RK: tl.constexpr):  # fmt: skip
    """``y [M, N] = x [M, K] (base + M ⊙ Q(R))ᵀ`` for the output tile ``(BM rows of x, BN outputs)`` of this
    program: first the dense 4-bit base (``BITS``: its storage width), K-tile by K-tile (``tl.dot`` on
    dequantized ``[BK, BN]`` tiles), then -- into the same accumulator -- every selected residual block
    whose row block meets the tile (the list is sorted by row block: ``starts[rb] .. starts[rb + 1]`` are
    row block ``rb``'s blocks), each a ``[RK, BN]`` tile gathered from its ``[bm, bk]`` int8 codes (rows
    outside the block are zero, so any ``bm``/``bk`` works) times its per-row scales, against the
    activation columns of its column block (``HAS_COLS``: through ``cols``, the channel residual's
    gathered input columns; ``KR``: the residual grid's width).  One store per tile: no second pass over
    ``y``, no partial output."""
    om = tl.program_id(0) * BM + tl.arange(0, BM)
    n0 = tl.program_id(1) * BN
    on = n0 + tl.arange(0, BN)
    mmask = om < M
    nmask = on < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ok = k0 + tl.arange(0, BK)
        kmask = ok < K
        x = tl.load(x_ptr + om[:, None] * stride_xm + ok[None, :], mask=mmask[:, None] & kmask[None, :],
                    other=0.0)  # fmt: skip
        w = weight_tile(q_ptr, s_ptr, z_ptr, on[None, :], ok[:, None], G, GS, stride_q, BITS,
                    kmask[:, None] & nmask[None, :])  # fmt: skip
        acc = _product(acc, x, w, HALF, UPCAST)
    rb0 = n0 // bm
    rb1 = tl.minimum((n0 + BN + bm - 1) // bm, NRB)
    j0 = tl.load(starts_ptr + rb0)
    j1 = tl.load(starts_ptr + rb1)
    kk = tl.arange(0, RK)
    for j in range(j0, j1):
        r = tl.load(rb_ptr + j)
        c = tl.load(cb_ptr + j)
        row = on - r * bm  # the tile's outputs as rows of this block
        rmask = (row >= 0) & (row < bm) & nmask
        col = c * bk + kk
        cmask = (kk < bk) & (col < KR)
        xcol = col
        if HAS_COLS:
            xcol = tl.load(cols_ptr + col, mask=cmask, other=0)
        x = tl.load(x_ptr + om[:, None] * stride_xm + xcol[None, :], mask=mmask[:, None] & cmask[None, :],
                    other=0.0)  # fmt: skip
        wmask = cmask[:, None] & rmask[None, :]
        codes = tl.load(rc_ptr + (j * bm + row[None, :]) * bk + kk[:, None], mask=wmask, other=0)
        sc = tl.load(rs_ptr + j * bm + row, mask=rmask, other=0.0)
        acc = _product(acc, x, codes.to(tl.float32) * sc[None, :], HALF, UPCAST)
    ymask = mmask[:, None] & nmask[None, :]
    tl.store(y_ptr + om[:, None] * stride_ym + on[None, :], to_dtype(acc, y_ptr.dtype.element_ty), mask=ymask)
