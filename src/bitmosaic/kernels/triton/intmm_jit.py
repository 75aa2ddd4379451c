"""``@triton.jit`` bodies of the packed INT kernels (imported lazily: see the package doc).

Codes are read straight from the byte layout of :mod:`bitmosaic.formats.packing` (the saved ``qweight``):
code ``k`` of a row lives in chunk ``k // 8`` (``BITS`` bytes), at bit ``(k % 8) * BITS`` of the chunk's
little-endian word, so it spans at most two bytes; the weight is ``(c - z) * s`` in float32 with the scale
and zero-point of group ``k // GS`` -- the one formula of :func:`bitmosaic.formats.grid.dequantize_codes`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def codes_tile(q_ptr, row_off, offs_k, BITS: tl.constexpr, mask):
    """The ``BITS``-bit codes at columns ``offs_k`` of the packed rows starting at ``q_ptr + row_off``."""
    pos = (offs_k % 8) * BITS
    byte = (offs_k // 8) * BITS + pos // 8
    sh = pos % 8
    p = q_ptr + row_off + byte
    b0 = tl.load(p, mask=mask, other=0).to(tl.int32)
    b1 = tl.load(p + 1, mask=mask & (sh + BITS > 8), other=0).to(tl.int32)
    return ((b0 | (b1 << 8)) >> sh) & ((1 << BITS) - 1)


@triton.jit
def bf16_rne(v):
    """float32 -> float32 on the bfloat16 grid, round to nearest even (finite values): the rounding a GPU's
    ``.to(tl.bfloat16)`` does, written out because Triton's interpreter truncates instead; the cast after
    it is exact on both."""
    u = v.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def to_dtype(v, dtype: tl.constexpr):
    """``v`` (float32) rounded to nearest even onto ``dtype`` (float32, float16 or bfloat16)."""
    if dtype == tl.bfloat16:
        v = bf16_rne(v)
    return v.to(dtype)


@triton.jit
def e4m3_rne(v):
    """float32 -> float32 on the FP8 E4M3 (``e4m3fn``) grid: saturate at +-448, round to nearest even
    (subnormals included), exactly :func:`bitmosaic.formats.fp.fp_round` ``(v, "e4m3")``.  Written out
    (exponent from the bits, then the ``+ 2**23`` rounding of ``|v| / step``) so that the interpreter and
    every GPU round the same way."""
    a = tl.minimum(tl.abs(v), 448.0)
    e = ((a.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
    e = tl.maximum(e, -6)  # below the smallest normal: the subnormal step 2**-9
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = ((a / step + 8388608.0) - 8388608.0) * step
    return tl.where(v < 0, -r, r)


@triton.jit
def weight_tile(q_ptr, s_ptr, z_ptr, n, k, G, GS, stride_q, BITS: tl.constexpr, mask,
            sw_ptr=None, sw_stride=0, FP8: tl.constexpr = False):  # fmt: skip
    """``(c - z) * s`` (float32) at rows ``n`` and columns ``k`` (broadcast), 0 where masked; ``FP8``
    (DPQ): rounded onto the E4M3 grid, times the FP8 weight scale ``sw[n * sw_stride]``."""
    c = codes_tile(q_ptr, n * stride_q, k, BITS, mask)
    g = n * G + k // GS
    s = tl.load(s_ptr + g, mask=mask, other=0.0)
    z = tl.load(z_ptr + g, mask=mask, other=0.0)
    w = (c.to(tl.float32) - z) * s
    if FP8:
        w = e4m3_rne(w) * tl.load(sw_ptr + n * sw_stride, mask=mask, other=0.0)
    return w


@triton.jit
def dequant_kernel(q_ptr, s_ptr, z_ptr, w_ptr, r0, R, K, G, GS, stride_q, sw_ptr, sw_stride,
                   BITS: tl.constexpr, FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """Rows ``r0 .. r0 + R`` of ``W`` in float32 into ``w_ptr`` ``[R, K]``."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rn[:, None] < R) & (k[None, :] < K)
    w = weight_tile(q_ptr, s_ptr, z_ptr, (r0 + rn)[:, None], k[None, :], G, GS, stride_q, BITS, mask,
                sw_ptr, sw_stride, FP8)  # fmt: skip
    tl.store(w_ptr + rn[:, None] * K + k[None, :], w, mask=mask)


@triton.jit
def gemm_kernel(x_ptr, perm_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, G, GS, stride_xm, stride_q, stride_ym,
                sw_ptr, sw_stride, xs_ptr, BITS: tl.constexpr, FP8: tl.constexpr, DOT_FP8: tl.constexpr,
                HAS_PERM: tl.constexpr, HALF: tl.constexpr, UPCAST: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """Prefill: ``y [M, N] = x [M, K] Wᵀ`` with ``tl.dot`` on dequantized ``[BK, BN]`` weight tiles (float32
    products, IEEE; with half-precision ``x`` the tile is rounded to ``x``'s dtype, as ``F.linear`` on a
    half weight, and the dot accumulates in float32; ``UPCAST``, set only under the interpreter for
    bfloat16, multiplies the same rounded values in float32, since a bf16 x bf16 product is exact there).
    ``HAS_PERM``: ``x`` is read at ``perm[k]`` (act-order groups made contiguous).

    ``DOT_FP8`` (DPQ §3, Fig. 3: INT4 weights dequantized to FP8, activations quantized to FP8, an FP8
    GEMM with a high-precision output): both operands go to ``tl.dot`` as ``float8e4nv`` -- ``x8 =
    nearest_E4M3(x / s_x)`` with the per-tensor activation scale ``xs_ptr[0]`` (on an ``x`` its quantizer
    already put on that grid this gives back its FP8 values exactly), ``w8 = nearest_E4M3((c - z) s)``
    -- accumulated in float32 (``max_num_imprecise_acc=0``: Hopper adds each FP8 MMA into the float32
    accumulator), and the tile is scaled once at the end, ``acc * s_x * s_w``: exactly
    :func:`bitmosaic.kernels.fp8.fp8_gemm_reference` up to the summation order."""
    om = tl.program_id(0) * BM + tl.arange(0, BM)
    on = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ok = k0 + tl.arange(0, BK)
        kmask = ok < K
        cols = ok
        if HAS_PERM:
            cols = tl.load(perm_ptr + ok, mask=kmask, other=0)
        x = tl.load(x_ptr + om[:, None] * stride_xm + cols[None, :], mask=(om[:, None] < M) & kmask[None, :],
                    other=0.0)  # fmt: skip
        wmask = kmask[:, None] & (on[None, :] < N)
        if DOT_FP8:  # the unscaled E4M3 operands (s_x and s_w after the loop)
            x8 = e4m3_rne(tl.math.div_rn(x.to(tl.float32), tl.load(xs_ptr))).to(tl.float8e4nv)
            w = weight_tile(q_ptr, s_ptr, z_ptr, on[None, :], ok[:, None], G, GS, stride_q, BITS, wmask)
            w8 = e4m3_rne(w).to(tl.float8e4nv)
            acc = tl.dot(x8, w8, acc, out_dtype=tl.float32, max_num_imprecise_acc=0)
        else:
            w = weight_tile(q_ptr, s_ptr, z_ptr, on[None, :], ok[:, None], G, GS, stride_q, BITS, wmask,
                        sw_ptr, sw_stride, FP8)  # fmt: skip
            if UPCAST:  # the interpreter's dot misreads bfloat16: the same products (exact in float32)
                wu = to_dtype(w, x.dtype).to(tl.float32)
                acc = tl.dot(x.to(tl.float32), wu, acc, input_precision="ieee")
            elif HALF:
                acc = tl.dot(x, to_dtype(w, x.dtype), acc)
            else:
                acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
    if DOT_FP8:
        sw = tl.load(sw_ptr + on * sw_stride, mask=on < N, other=0.0)
        acc = acc * tl.load(xs_ptr) * sw[None, :]
    ymask = (om[:, None] < M) & (on[None, :] < N)
    tl.store(y_ptr + om[:, None] * stride_ym + on[None, :], to_dtype(acc, y_ptr.dtype.element_ty), mask=ymask)


@triton.jit
def gemv_kernel(x_ptr, perm_ptr, q_ptr, s_ptr, z_ptr, y_ptr, N, K, G, GS, stride_xm, stride_q, stride_ym,
                sw_ptr, sw_stride, BITS: tl.constexpr, FP8: tl.constexpr, HAS_PERM: tl.constexpr,
                HALF: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """Decode: one row ``m`` of ``x`` (grid axis 1) times ``BN`` weight rows, float32 multiply-adds (a half
    ``x`` sees the weight rounded to its dtype, as in the GEMM)."""
    on = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.program_id(1)
    acc = tl.zeros((BN,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ok = k0 + tl.arange(0, BK)
        kmask = ok < K
        cols = ok
        if HAS_PERM:
            cols = tl.load(perm_ptr + ok, mask=kmask, other=0)
        x = tl.load(x_ptr + m * stride_xm + cols, mask=kmask, other=0.0)
        w = weight_tile(q_ptr, s_ptr, z_ptr, on[:, None], ok[None, :], G, GS, stride_q, BITS,
                    (on[:, None] < N) & kmask[None, :], sw_ptr, sw_stride, FP8)  # fmt: skip
        if HALF:
            w = to_dtype(w, x.dtype).to(tl.float32)
        acc += tl.sum(w * x.to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + m * stride_ym + on, to_dtype(acc, y_ptr.dtype.element_ty), mask=on < N)
