"""``@triton.jit`` body of SQ-format's static split GEMM (imported lazily: see the package doc; SQ-format
§3.2.2, Algorithm 2, Fig. 2(b))."""

from __future__ import annotations

import triton
import triton.language as tl

from .intmm_jit import codes_tile, to_dtype


@triton.jit
def _weight_g(q_ptr, s_ptr, z_ptr, gidx_ptr, n, k, G, stride_q, BITS: tl.constexpr, mask):
    """``(c - z) * s`` (float32) at rows ``n`` and stored columns ``k``, the group of column ``k`` read
    from ``g_idx`` (the static split stores its columns high-first: groups are not contiguous)."""
    c = codes_tile(q_ptr, n * stride_q, k, BITS, mask)
    g = n * G + tl.load(gidx_ptr + k, mask=mask, other=0)
    s = tl.load(s_ptr + g, mask=mask, other=0.0)
    z = tl.load(z_ptr + g, mask=mask, other=0.0)
    return (c.to(tl.float32) - z) * s


@triton.jit
def _part(acc, a_ptr, sa_ptr, scol_ptr, q_ptr, s_ptr, z_ptr, gidx_ptr, om, on, k_lo, k_hi, M, N, G,
          stride_am, stride_sm, stride_q, BITS: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """``acc +`` one part: its levels (stored columns ``k_lo .. k_hi``, ``a`` holds them from column 0)
    times their scales, a float32 ``tl.dot`` per K-tile with the dequantized weight of those columns."""
    mmask = om < M
    for k0 in range(k_lo, k_hi, BK):
        ok = k0 + tl.arange(0, BK)
        kmask = ok < k_hi
        amask = mmask[:, None] & kmask[None, :]
        lv = tl.load(a_ptr + om[:, None] * stride_am + (ok - k_lo)[None, :], mask=amask, other=0)
        sc = tl.load(scol_ptr + ok, mask=kmask, other=0)
        sa = tl.load(sa_ptr + om[:, None] * stride_sm + sc[None, :], mask=amask, other=0.0)
        w = _weight_g(q_ptr, s_ptr, z_ptr, gidx_ptr, on[None, :], ok[:, None], G, stride_q, BITS,
                      kmask[:, None] & (on[None, :] < N))  # fmt: skip
        acc = tl.dot(lv.to(tl.float32) * sa, w, acc, input_precision="ieee")
    return acc


@triton.jit
def sq_split_kernel(ah_ptr, al_ptr, sh_ptr, sl_ptr, scol_ptr, q_ptr, s_ptr, z_ptr, gidx_ptr, y_ptr,
                    M, N, K, KH, G, stride_ah, stride_al, stride_sh, stride_sl, stride_q, stride_ym,
                    BITS: tl.constexpr, HAS_LOW: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """``y [M, N] = a_high W[:, :KH]ᵀ + a_low W[:, KH:]ᵀ`` (stored, high-first columns) for one output
    tile: the high part's ``tl.dot``s over the first ``KH`` stored columns, then the low part's over the
    rest, into one float32 accumulator; each part's value is its level times the scale of its token and
    scale group (``scol``: the scale column of each stored column), exactly the reference's float32
    product.  ``HAS_LOW`` off: a format without a low part (``h_low = 0``)."""
    om = tl.program_id(0) * BM + tl.arange(0, BM)
    on = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc = _part(acc, ah_ptr, sh_ptr, scol_ptr, q_ptr, s_ptr, z_ptr, gidx_ptr, om, on, 0, KH, M, N, G,
                stride_ah, stride_sh, stride_q, BITS, BK)  # fmt: skip
    if HAS_LOW:
        acc = _part(acc, al_ptr, sl_ptr, scol_ptr, q_ptr, s_ptr, z_ptr, gidx_ptr, om, on, KH, K, M, N, G,
                    stride_al, stride_sl, stride_q, BITS, BK)  # fmt: skip
    ymask = (om[:, None] < M) & (on[None, :] < N)
    tl.store(y_ptr + om[:, None] * stride_ym + on[None, :], to_dtype(acc, y_ptr.dtype.element_ty), mask=ymask)
