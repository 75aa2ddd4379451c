"""The packed INT kinds on the GPU (issue 76): a Triton dequant GEMM (``tl.dot``, prefill) and GEMV (decode)
that read the codes in the saved byte layout of :mod:`bitmosaic.formats.packing` (W1-W8; 1-bit codes are
packed at 2 bits, as the packed kinds store them), any group size, asymmetric or symmetric (a scalar
zero-point), act-order groups made contiguous by an input gather inside the kernel (the ExLlama way, as
:class:`~bitmosaic.modules.kernel.LowBitKernel` does on the CPU).

Same interface and declared capabilities as the CPU kernels (:mod:`bitmosaic.kernels.select`), so a packed
kind's ``KERNELS`` lists it first and the selector picks it on CUDA.  Exactness (tests/kernels/triton/,
under ``TRITON_INTERPRET=1``): :meth:`TritonIntWeight.dequantize` is bitwise equal to
:func:`bitmosaic.formats.layout.dequantize`; the products equal ``F.linear(x, W)`` bitwise on inputs whose
sums are exact in float32 (any order), else within the float32 accumulation-order bound.
"""

from __future__ import annotations

import torch

from ...formats.packing import SUPPORTED_BITS, pack_codes
from . import TritonKernel, check_device, fp8_dot, interpreting, jit_module

__all__ = ["TritonIntWeight", "GEMV_MAX_ROWS"]

GEMV_MAX_ROWS = 8  # up to this many rows of x: the GEMV (the weight read once per row), above: the GEMM


def pow2_tile(n: int, lo: int, hi: int) -> int:
    p = lo
    while p < n and p < hi:
        p *= 2
    return p


class TritonIntWeight(TritonKernel):
    """Packed integer codes + float32 scales/zero-points ``[N, G]``; ``matmul`` never builds a float ``W``."""

    KERNEL_NAME = "triton_int"
    SUPPORTS_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
    SUPPORTS_MIXED_BITS = False
    SUPPORTS_GROUP_SIZE_MULTIPLE = 1
    SUPPORTS_ROWS = (1, None)
    FAST_BITS = SUPPORTS_BITS
    GATHERS_INPUT = True  # matmul(x, in_index=perm) gathers x inside the kernel

    def __init__(self, qweight, scales, zeros, K: int, group_size: int, bits: int) -> None:
        self.qweight, self.scales, self.zeros = qweight, scales, zeros
        self.K, self.group_size, self.bits = K, group_size, bits
        self.N = scales.shape[0]
        self.fp8_scale: torch.Tensor | None = None  # DPQ: see with_fp8

    def with_fp8(self, fp8_scale: torch.Tensor) -> TritonIntWeight:
        """DPQ's weight operand (algorithms/dpq.py): the same codes, each ``(c - z) s`` rounded onto the FP8
        E4M3 grid in the kernel and multiplied by ``fp8_scale`` (``[1, 1]`` per tensor or ``[out, 1]``)."""
        if fp8_scale.numel() not in (1, self.N):
            raise ValueError(f"fp8_scale must have 1 or {self.N} values, got {fp8_scale.numel()}")
        w = TritonIntWeight(self.qweight, self.scales, self.zeros, self.K, self.group_size, self.bits)
        w.fp8_scale = fp8_scale.float().reshape(-1).contiguous()
        return w

    def _fp8_args(self, fallback: torch.Tensor):
        sw = self.fp8_scale
        if sw is None:
            return (fallback, 0), False
        return (sw, 0 if sw.numel() == 1 else 1), True

    @classmethod
    def from_codes(cls, codes: torch.Tensor, bits: int, scales: torch.Tensor, zeros, group_size: int):
        """From integer ``codes [N, K]`` in ``[0, 2**bits)``, ``scales [N, G]``, ``zeros [N, G]`` or a number,
        ``group_size`` (``-1`` or ``>= K``: one group per row)."""
        if not torch.is_tensor(codes) or codes.dim() != 2 or codes.is_floating_point():
            raise ValueError("codes must be a 2-D integer tensor [out, in]")
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise ValueError(f"the Triton INT kernel takes one width in 1..8, got {bits!r}")
        N, K = codes.shape
        gs = K if group_size is None or group_size < 0 or group_size >= K else max(int(group_size), 1)
        G = -(-K // gs) if K else 0
        if tuple(scales.shape) != (N, G):
            got = tuple(scales.shape)
            raise ValueError(f"scales must be [out={N}, groups={G}] for group size {gs}, got {got}")
        z = zeros.float() if torch.is_tensor(zeros) else torch.full((N, G), float(zeros), device=codes.device)
        if tuple(z.shape) != (N, G):
            raise ValueError(f"zeros must be a number or [out={N}, groups={G}], got {tuple(z.shape)}")
        storage = max(bits, min(SUPPORTED_BITS))
        q = pack_codes(codes, storage)  # ValueError for codes outside the width
        return cls(q.contiguous(), scales.float().contiguous(), z.contiguous(), K, gs, storage)

    def nbytes(self) -> int:
        ts = [t for t in (self.qweight, self.scales, self.zeros, self.fp8_scale) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    def _args(self):
        G = self.scales.shape[1]
        return self.qweight, self.scales.contiguous(), self.zeros.contiguous(), G

    def fp8_operands(self, x: torch.Tensor, x_scale: torch.Tensor | None) -> bool:
        """Whether :meth:`matmul` feeds FP8 operands to ``tl.dot`` (DPQ §3, Fig. 3; §4.3: the FP8 GEMM
        engines): a DPQ weight (:meth:`with_fp8`), a per-tensor activation scale, and a device whose
        ``tl.dot`` runs FP8 (:func:`~bitmosaic.kernels.triton.fp8_dot`: capability >= 8.9); else the
        float path (the same E4M3 weight values, scaled, multiplied in float32)."""
        return self.fp8_scale is not None and x_scale is not None and fp8_dot(x.device)

    def matmul(self, x: torch.Tensor, in_index: torch.Tensor | None = None,
               x_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """``x [..., K]`` (float32/bfloat16/float16) -> ``[..., N]`` in ``x``'s dtype; ``in_index``: read
        ``x`` at these columns (act-order); ``x_scale`` (DPQ, one value): the FP8 activation scale ``s_x``
        -- where :meth:`fp8_operands` holds, ``x`` is quantized in the kernel to ``nearest_E4M3(x / s_x)``
        and the product is the FP8 x FP8 GEMM ``(x8 @ w8ᵀ) s_x s_w`` on every row count (a GEMV tile
        of 16 rows at decode)."""
        if x.shape[-1] != self.K:
            raise ValueError(f"x has {x.shape[-1]} features but the weight has {self.K} input columns")
        if x_scale is not None and x_scale.numel() != 1:
            raise ValueError(f"x_scale must be one per-tensor activation scale, got {x_scale.numel()} values")
        check_device(x)
        jit = jit_module("intmm_jit")
        x2 = x.reshape(-1, self.K)
        if x2.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            x2 = x2.float()
        x2 = x2.contiguous()
        M = x2.shape[0]
        y = torch.empty(M, self.N, dtype=x2.dtype, device=x.device)
        if M == 0 or self.N == 0:
            return y.reshape(*x.shape[:-1], self.N).to(x.dtype)
        q, s, z, G = self._args()
        perm = in_index if in_index is not None else q  # any pointer when HAS_PERM is off
        half = x2.dtype != torch.float32
        sw, fp8 = self._fp8_args(s)
        dot_fp8 = self.fp8_operands(x2, x_scale)
        common = (G, self.group_size, x2.stride(0), q.stride(0), y.stride(0), *sw)
        flags = {"BITS": self.bits, "FP8": fp8, "HAS_PERM": in_index is not None, "HALF": half}
        if M <= GEMV_MAX_ROWS and not dot_fp8:
            BN, BK = 32, 128
            grid = (-(-self.N // BN), M)
            jit.gemv_kernel[grid](x2, perm, q, s, z, y, self.N, self.K, *common, **flags, BN=BN, BK=BK)
        else:
            BM, BN, BK = pow2_tile(M, 16, 64), (32 if M <= GEMV_MAX_ROWS else 64), 64
            grid = (-(-M // BM), -(-self.N // BN))
            up = interpreting() and x2.dtype == torch.bfloat16
            xs = x_scale.float().reshape(-1)[:1].to(x.device) if dot_fp8 else s  # any pointer when off
            jit.gemm_kernel[grid](x2, perm, q, s, z, y, M, self.N, self.K, *common, xs, **flags,
                                  DOT_FP8=dot_fp8, UPCAST=up, BM=BM, BN=BN, BK=BK)  # fmt: skip
        return y.reshape(*x.shape[:-1], self.N).to(x.dtype)

    def dequantize(self, rows: slice | None = None) -> torch.Tensor:
        """Rows of ``W`` in float32, exactly ``(c - z) * s`` (kernel column order; DPQ: E4M3, scaled)."""
        r0, r1, _ = (rows or slice(None)).indices(self.N)
        R = max(0, r1 - r0)
        w = torch.empty(R, self.K, dtype=torch.float32, device=self.qweight.device)
        if R == 0 or self.K == 0:
            return w
        check_device(w)
        q, s, z, G = self._args()
        BN, BK = 16, 128
        grid = (-(-R // BN), -(-self.K // BK))
        sw, fp8 = self._fp8_args(s)
        args = (q, s, z, w, r0, R, self.K, G, self.group_size, q.stride(0), *sw)
        jit_module("intmm_jit").dequant_kernel[grid](*args, BITS=self.bits, FP8=fp8, BN=BN, BK=BK)
        return w
