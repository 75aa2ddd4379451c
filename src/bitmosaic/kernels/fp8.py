"""FP8 x FP8 GEMM: the W4A8-FP8 compute of DPQ (paper Fig. 3) and the W8A8-FP8 baseline.

``y = (x8 @ w8ᵀ) * s_x * s_w`` with ``x8``, ``w8`` on an FP8 grid and float32 accumulation.

- :func:`fp8_gemm_reference`: CPU/GPU reference in float32.  Every product of two FP8 values is
  exact in float32, so this *is* an FP8 GEMM with float32 accumulation (up to summation order).
- :func:`fp8_gemm_scaled_mm`: the real FP8 tensor-core GEMM via ``torch._scaled_mm`` (CUDA,
  compute capability >= 8.9: Ada / Hopper), per-tensor float32 scales, bf16 output.  It is checked
  against the reference by ``benchmarks/gpu/fp8_gemm.py`` on the device that runs it.
"""

from __future__ import annotations

import torch

__all__ = ["fp8_gemm_reference", "fp8_gemm_scaled_mm", "scaled_mm_available"]


def fp8_gemm_reference(
    x8: torch.Tensor, w8: torch.Tensor, s_x: torch.Tensor, s_w: torch.Tensor
) -> torch.Tensor:
    """``(x8 @ w8ᵀ) * s_x * s_wᵀ`` in float32; ``x8 [m, k]``, ``w8 [n, k]`` FP8 values (any float dtype),
    ``s_x`` scalar or ``[m, 1]``, ``s_w`` scalar or ``[n, 1]``."""
    acc = x8.float() @ w8.float().T
    return acc * s_x.float().reshape(-1, 1) * s_w.float().reshape(1, -1)


def scaled_mm_available(device: torch.device | str | None = None) -> bool:
    """True when ``torch._scaled_mm`` can run FP8 on ``device`` (CUDA, capability >= 8.9)."""
    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_gemm_scaled_mm(
    x8: torch.Tensor, w8: torch.Tensor, s_x: torch.Tensor, s_w: torch.Tensor, out_dtype=torch.bfloat16
) -> torch.Tensor:
    """Real FP8 GEMM on CUDA: ``x8 [m, k]`` and ``w8 [n, k]`` in ``torch.float8_e4m3fn``, per-tensor
    float32 scales; ``k`` and ``n`` must be multiples of 16 (a cuBLASLt requirement)."""
    if not scaled_mm_available(x8.device):
        raise RuntimeError("torch._scaled_mm needs a CUDA GPU with compute capability >= 8.9 (Ada/Hopper)")
    if x8.dtype != torch.float8_e4m3fn or w8.dtype != torch.float8_e4m3fn:
        raise TypeError("fp8_gemm_scaled_mm takes float8_e4m3fn operands")
    sx = s_x.float().reshape(()).to(x8.device)
    sw = s_w.float().reshape(()).to(x8.device)
    return torch._scaled_mm(x8, w8.T, scale_a=sx, scale_b=sw, out_dtype=out_dtype)
