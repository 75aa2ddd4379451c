"""Round-to-nearest (RTN): the baseline every second-order method is measured against."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..formats.grid import IntGrid, quantize_codes
from ..formats.layout import default_g_idx, dequantize
from .scales import ScaleMethod, group_scale_zero

__all__ = ["QuantResult", "rtn_quantize"]


@dataclass
class QuantResult:
    """Integer codes in original column order plus what is needed to dequantize them.

    ``codes``: ``[out, in]`` int32 (unbounded when quantized with ``clip=False``);
    ``scales``/``zeros``: ``[out, G]`` (fp16-exact values, kept in float32/64);
    ``g_idx``: ``[in]`` group of each column; ``perm``: the processing order used (or None).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    perm: torch.Tensor | None = None
    hessian: torch.Tensor | None = None  # the damped Hessian an algorithm used (original order)
    step_errors: torch.Tensor | None = None  # per-row sum of (w'-q)^2/d^2 (GPTQ's loss)
    sparse: torch.Tensor | None = None  # dense [out, in] view of sparse outliers added on top (SSQR)
    info: dict = field(default_factory=dict)  # method-specific facts for the report

    def lattice_scales(self) -> torch.Tensor | None:
        """Per-column step sizes of the integer lattice the codes live on (``[out, in]``), for the
        Babai bound; ``None`` when the weight is not on such a lattice (e.g. FP8-rounded DPQ)."""
        return self.scales[:, self.g_idx.long()]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        W = dequantize(self.codes, self.scales, self.zeros, self.g_idx, dtype=dtype)
        return W if self.sparse is None else W + self.sparse.to(dtype)


def rtn_quantize(
    W: torch.Tensor,
    grid: IntGrid,
    group_size: int | None = None,
    scale_method: ScaleMethod = "minmax",
    clip: bool = True,
) -> QuantResult:
    """Quantize each weight to its nearest grid point with per-group scales."""
    W = W.float() if W.dtype not in (torch.float32, torch.float64) else W
    scales, zeros = group_scale_zero(W, grid, group_size, scale_method)
    g_idx = default_g_idx(W.shape[1], group_size, device=W.device)
    codes = quantize_codes(W, scales[:, g_idx], zeros[:, g_idx], grid.maxq, clip=clip)
    return QuantResult(codes.to(torch.int32), scales, zeros, g_idx)
