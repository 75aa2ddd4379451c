"""``@triton.jit`` body of SSQR's CSR outlier pass (imported lazily: see the package doc)."""

from __future__ import annotations

import triton
import triton.language as tl

from .intmm_jit import to_dtype


@triton.jit
def csr_add_kernel(x_ptr, rp_ptr, col_ptr, val_ptr, y_ptr, M, stride_xm, stride_ym,
                   BM: tl.constexpr, BJ: tl.constexpr):  # fmt: skip
    """``y[m, n] = round(y[m, n] + sum_j val[j] x[m, col[j]])`` over row ``n``'s CSR entries (grid axis 0:
    ``n``; axis 1: blocks of ``BM`` rows of ``x``), float32 sums; each ``(m, n)`` belongs to one program."""
    n = tl.program_id(0)
    om = tl.program_id(1) * BM + tl.arange(0, BM)
    mmask = om < M
    j0 = tl.load(rp_ptr + n)
    j1 = tl.load(rp_ptr + n + 1)
    acc = tl.zeros((BM,), dtype=tl.float32)
    for j in range(j0, j1, BJ):
        oj = j + tl.arange(0, BJ)
        jmask = oj < j1
        c = tl.load(col_ptr + oj, mask=jmask, other=0)
        v = tl.load(val_ptr + oj, mask=jmask, other=0.0).to(tl.float32)
        xmask = mmask[:, None] & jmask[None, :]
        x = tl.load(x_ptr + om[:, None] * stride_xm + c[None, :], mask=xmask, other=0.0)
        acc += tl.sum(x.to(tl.float32) * v[None, :], axis=1)
    yp = y_ptr + om * stride_ym + n
    y = tl.load(yp, mask=mmask, other=0.0).to(tl.float32)
    tl.store(yp, to_dtype(y + acc, y_ptr.dtype.element_ty), mask=mmask)
