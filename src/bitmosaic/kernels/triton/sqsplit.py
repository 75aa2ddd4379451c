"""SQ-format's static split GEMM in one Triton kernel (issue 76; SQ-format §3.2.2, Algorithm 2 and
Fig. 2(b): "pre-computed activation masks divide the entire computation into two paths with different
precisions; since the PTQ process has already reordered the banks of weight matrices, we only need
selection and gathering operations for the activation tiles").

The W4 weight is the packed layout as :class:`~bitmosaic.modules.sq.SQActLinear` stores it: columns
reordered high-first by the static mask (``sq_perm``), so the high part is the first ``kh`` stored columns
and the low part the rest.  The activations are split by the same mask with the reference's own function
(:func:`~bitmosaic.algorithms.sq.static_split`: per token, bank or group scales, or the calibrated ones),
gathered into stored order as integer levels (int8 for the INT formats: ``h_high`` = 8 and ``h_low`` = 4
in the paper's 8/4 split; float32 grid values for the FP ones) plus each part's scales.  The kernel then
computes each output tile with two ``tl.dot`` loops -- the high part's columns, then the low part's --
into one float32 accumulator, stored once.

Exactness (tests/kernels/triton/test_triton_sq.py, ``TRITON_INTERPRET=1``): the kernel forms each
activation value as ``level * scale`` in float32 and each weight as ``(c - z) * s`` -- the reference's
values (:meth:`SQActLinear._linear`) bit for bit -- and multiplies in float32 (IEEE, no TF32), so the
result equals the reference's two matmuls bitwise where the sums are exact and lies within the float32
accumulation bound of the ``K`` terms otherwise (the reference sums the parts separately, then adds).
The products are float32 on the GPU too (the values ``level * scale`` are not exact in a half type):
this is the split as the reference computes it, not the paper's INT8/INT4 tensor-core datapath.
"""

from __future__ import annotations

import torch

from ...algorithms.sq import static_split
from ...formats.sq_act import act_scale_group
from . import TritonKernel, check_device, jit_module
from .intmm import pow2_tile

__all__ = ["TritonSQSplitWeight"]


class TritonSQSplitWeight(TritonKernel):
    """The packed high-first weight and the static split's settings; ``__call__(x)`` splits ``x`` and
    runs the kernel (the :class:`~bitmosaic.modules.kernel.KernelWeight` interface)."""

    KERNEL_NAME = "triton_sq"
    SUPPORTS_BITS = (2, 3, 4, 5, 6, 7, 8)  # the packed weight's storage width
    SUPPORTS_MIXED_BITS = False
    SUPPORTS_GROUP_SIZE_MULTIPLE = 1
    SUPPORTS_ROWS = (1, None)
    FAST_BITS = SUPPORTS_BITS

    def __init__(self, qweight, bits: int, scales, zeros, g_idx, split: dict) -> None:
        """``qweight`` ``[N, packed]`` (stored, high-first columns, ``bits`` per code), float32 ``scales`` and
        ``zeros`` ``[N, G]`` (offset folded in), ``g_idx`` ``[K]`` (stored order); ``split``: ``fmt``,
        ``mask`` (high channels, original order), ``perm`` (stored column -> channel), ``scale``,
        ``group``, ``scales`` (calibrated ``(low, high)`` or ``None``) -- :func:`static_split`'s arguments."""
        self.qweight, self.bits = qweight.contiguous(), int(bits)
        self.scales, self.zeros = scales.float().contiguous(), zeros.float().contiguous()
        self.g_idx = g_idx.to(torch.int32).contiguous()
        self.N, self.G = self.scales.shape
        self.K = self.g_idx.numel()
        self.split = split
        fmt = split["fmt"]
        self.kh = fmt.high_count(self.K)
        self.has_low = bool(fmt.h_low)
        self.level_dtype = torch.float32 if fmt.fp else torch.int8
        perm = split["perm"].long()
        self.perm_high, self.perm_low = perm[: self.kh].contiguous(), perm[self.kh :].contiguous()
        # the scale column of every stored column: its channel's scale group
        g = act_scale_group(fmt, self.K, split["scale"], split["group"])
        self.scale_col = (perm // g).to(torch.int32).contiguous()

    def nbytes(self) -> int:
        ts = (
            self.qweight,
            self.scales,
            self.zeros,
            self.g_idx,
            self.perm_high,
            self.perm_low,
            self.scale_col,
        )
        return sum(t.numel() * t.element_size() for t in ts)

    def levels(self, x2: torch.Tensor):
        """``(high levels [M, kh], low levels [M, K - kh], high scales, low scales [M, n_scales])``: the
        reference split of ``x2`` (float32), its levels gathered into stored order."""
        sp = self.split
        t = static_split(x2, sp["mask"], sp["fmt"], sp["scale"], sp["group"], sp["scales"])
        ah = t.high.index_select(1, self.perm_high).to(self.level_dtype).contiguous()
        al = t.low.index_select(1, self.perm_low).to(self.level_dtype).contiguous()
        return ah, al, t.high_scale.float().contiguous(), t.low_scale.float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` -> ``[..., N]`` in ``x``'s dtype (float32 sums, rounded once, as the reference)."""
        if x.shape[-1] != self.K:
            raise ValueError(f"x has {x.shape[-1]} features but the weight has {self.K} input columns")
        check_device(x)
        x2 = x.reshape(-1, self.K).float()
        M = x2.shape[0]
        y = torch.empty(M, self.N, dtype=torch.float32, device=x.device)
        if M and self.N:
            ah, al, sh, sl = self.levels(x2)
            if al.shape[1] == 0:
                al = ah  # any pointer: no low columns to read
            BM, BN, BK = pow2_tile(M, 16, 64), 64, 64
            grid = (-(-M // BM), -(-self.N // BN))
            jit_module("sqsplit_jit").sq_split_kernel[grid](
                ah, al, sh, sl, self.scale_col, self.qweight, self.scales, self.zeros, self.g_idx, y,
                M, self.N, self.K, self.kh, self.G, ah.stride(0), al.stride(0), sh.stride(0), sl.stride(0),
                self.qweight.stride(0), y.stride(0),
                BITS=self.bits, HAS_LOW=self.has_low and self.kh < self.K, BM=BM, BN=BN, BK=BK,
            )  # fmt: skip
        return y.reshape(*x.shape[:-1], self.N).to(x.dtype)
