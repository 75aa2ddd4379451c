"""MosaicQuant's dense 4-bit base plus its block-sparse 4-bit residual in one Triton kernel (issue 76;
MosaicQuant §4.2, ZipperEngine: "the sparse branch reuses the same quantized activation tiles and
accumulates into the same output tiles as the dense GEMM", Fig. 3(b)).

Each program owns one output tile: it runs the dense base's dequant GEMM over K (the packed codes in the
saved layout, read as :mod:`bitmosaic.kernels.triton.intmm` reads them), then the selected residual blocks
whose row block meets the tile -- the block list is sorted by row block, so they are one contiguous run
``starts[rb0] .. starts[rb1]`` -- into the same float32 accumulator, and stores the tile once: no sparse
kernel, no partial output, no reduce-add (the three-step path the paper measures at ~1/3 of the latency).
The paper's overlapped sub-block pipeline (Fig. 3(c)) is left to Triton's software pipelining.

Activations: the kernel multiplies the activations it is given.  With an activation quantizer (W4A8,
W4A4) a forward off the CPU runs the quantizer's float ``Q(X)`` (the input pre-hook's fake quantization,
``$BITMOSAIC_ACT_COMPUTE=sim`` on the CPU) and this kernel multiplies it: the same float activations the
reference ``F.linear(Q(X), dequantize_reference())`` sees; the CPU's integer path
(:class:`~bitmosaic.kernels.mosaic.MosaicIntActWeight`) has no Triton counterpart.

Exactness (tests/kernels/triton/test_triton_mosaic.py, ``TRITON_INTERPRET=1``): on float32 ``x`` every
product is the reference's float32 product of the same values (base ``(c - 8) s``, residual ``c s_r``), so
the result equals ``F.linear(x, base + residual)`` bitwise where the sums are exact (integer ``x``,
power-of-two scales) and otherwise lies within the float32 accumulation bound of the ``K + k`` terms (the
reference adds base and residual per weight first: one more rounding, inside that bound).  Half ``x``
(bfloat16/float16): each tile is rounded to ``x``'s dtype (tensor cores), base and residual separately.
"""

from __future__ import annotations

import torch

from . import TritonKernel, check_device, interpreting, jit_module
from .intmm import TritonIntWeight, pow2_tile

__all__ = ["TritonBlockResidualWeight"]


class TritonBlockResidualWeight(TritonKernel):
    """The dense base (a :class:`TritonIntWeight`, ``.dense``) plus the residual blocks, one kernel per call
    (``__call__(x)``: the :class:`~bitmosaic.kernels.mosaic.MosaicWeight` interface)."""

    KERNEL_NAME = "triton_blockres"
    SUPPORTS_BITS = (2, 3, 4, 5, 6, 7, 8)  # the base's storage width (4, wider for a no-clip base)
    SUPPORTS_MIXED_BITS = False
    SUPPORTS_GROUP_SIZE_MULTIPLE = 1
    SUPPORTS_ROWS = (1, None)
    FAST_BITS = SUPPORTS_BITS

    def __init__(self, dense: TritonIntWeight, index, codes, scales, shape, block, columns=None) -> None:
        """As :class:`~bitmosaic.kernels.mosaic.MosaicWeight`: ``index`` ``[n_sel]`` flat block indices
        ``rb * n_col_blocks + cb``, strictly ascending; ``codes`` ``[n_sel, bm, bk]`` signed; ``scales``
        ``[n_sel, bm]``; ``shape`` the residual grid ``(N, K or k)``; ``columns``: the channel residual's
        ``k`` gathered input columns (``None``: the blocks tile ``W`` itself)."""
        self.dense = dense
        self.N, self.KR = shape
        self.K = dense.K
        self.bm, self.bk = block
        ncb = -(-self.KR // self.bk)
        self.nrb = -(-self.N // self.bm)
        idx = index.to(torch.int64)
        if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise ValueError("residual block indices must be strictly ascending")
        dev = dense.qweight.device
        rb = idx // ncb
        self.rb = rb.to(torch.int32).to(dev).contiguous()
        self.cb = (idx % ncb).to(torch.int32).to(dev).contiguous()
        self.starts = torch.searchsorted(rb, torch.arange(self.nrb + 1)).to(torch.int32).to(dev).contiguous()
        self.codes = codes.to(torch.int8).to(dev).contiguous()
        self.scales = scales.float().to(dev).contiguous()
        self.columns = None if columns is None else columns.to(torch.int32).to(dev).contiguous()

    def nbytes(self) -> int:
        ts = [self.rb, self.cb, self.starts, self.codes, self.scales]
        ts += [] if self.columns is None else [self.columns]
        return self.dense.nbytes() + sum(t.numel() * t.element_size() for t in ts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` -> ``[..., N]`` in ``x``'s dtype."""
        if x.shape[-1] != self.K:
            raise ValueError(f"x has {x.shape[-1]} features but the weight has {self.K} input columns")
        check_device(x)
        x2 = x.reshape(-1, self.K)
        if x2.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            x2 = x2.float()
        x2 = x2.contiguous()
        M = x2.shape[0]
        y = torch.empty(M, self.N, dtype=x2.dtype, device=x.device)
        if M and self.N:
            d = self.dense
            q, s, z, G = d._args()
            # pointers never read stand in for empty tensors (no columns; no selected block: j0 == j1)
            cols = self.columns if self.columns is not None else self.starts
            rc, rs, rb, cb = (
                (self.codes, self.scales, self.rb, self.cb) if self.rb.numel() else (self.starts,) * 4
            )
            BM, BN, BK = pow2_tile(M, 16, 64), 64, 64
            RK = pow2_tile(self.bk, 16, 1 << 30)
            half = x2.dtype != torch.float32
            up = interpreting() and x2.dtype == torch.bfloat16
            grid = (-(-M // BM), -(-self.N // BN))
            jit_module("blockres_jit").blockres_kernel[grid](
                x2, q, s, z, rc, rs, rb, cb, self.starts, cols, y,
                M, self.N, self.K, self.KR, G, d.group_size, self.nrb, self.bm, self.bk,
                x2.stride(0), q.stride(0), y.stride(0), BITS=d.bits, HAS_COLS=self.columns is not None,
                HALF=half, UPCAST=up, BM=BM, BN=BN, BK=BK, RK=RK,
            )  # fmt: skip
        return y.reshape(*x.shape[:-1], self.N).to(x.dtype)
