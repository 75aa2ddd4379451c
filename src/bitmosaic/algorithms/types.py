"""Shared result types of the quantization algorithms (the bottom of the dependency graph above
:mod:`bitmosaic.formats`: algorithms produce them, methods return them, modules pack them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..formats.layout import dequantize

__all__ = ["QuantResult"]


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
    # or, when the algorithm kept no such copy (GPTQ at 14336 inputs: 0.8 GB), its diagonal only:
    # the damped Hessian is the undamped one with this diagonal
    hessian_diag: torch.Tensor | None = None
    step_errors: torch.Tensor | None = None  # per-row sum of (w'-q)^2/d^2 (GPTQ's loss)
    # LDL pivots D_kk of the damped Hessian in *processing* order (GPTQ: 1 / U_kk^2), so the
    # Babai bound needs no second factorisation: bound_row = 1/4 sum_k D_k s_{perm[k]}^2
    pivots: torch.Tensor | None = None
    sparse: torch.Tensor | None = None  # dense [out, in] view of sparse outliers added on top (SSQR)
    info: dict = field(default_factory=dict)  # method-specific facts for the report

    def lattice_scales(self) -> torch.Tensor | None:
        """Per-column step sizes of the integer lattice the codes live on (``[out, in]``), for the
        Babai bound; ``None`` when the weight is not on such a lattice (e.g. FP8-rounded DPQ)."""
        return self.scales[:, self.g_idx.long()]

    def damped_hessian(self, H: torch.Tensor) -> torch.Tensor | None:
        """The damped Hessian the algorithm used: ``hessian``, or ``H`` (the undamped one) with
        ``hessian_diag`` on its diagonal (a copy, in that diagonal's dtype)."""
        if self.hessian is not None or self.hessian_diag is None:
            return self.hessian
        d = self.hessian_diag
        Hd = H.to(device=d.device, dtype=d.dtype, copy=True)
        torch.diagonal(Hd).copy_(d)
        return Hd

    def select_rows(self, start: int, stop: int) -> QuantResult:
        """The result for output rows ``start:stop`` (linears that shared one Hessian were stacked
        row-wise and quantized as one matrix; every per-row field is sliced, shared ones kept)."""

        def rows(t):
            return None if t is None else t[start:stop]

        return QuantResult(
            codes=self.codes[start:stop],
            scales=self.scales[start:stop],
            zeros=self.zeros[start:stop],
            g_idx=self.g_idx,
            perm=self.perm,
            hessian=self.hessian,
            hessian_diag=self.hessian_diag,
            step_errors=rows(self.step_errors),
            pivots=self.pivots,
            sparse=rows(self.sparse),
            info=dict(self.info),
        )

    @classmethod
    def cat_rows(cls, parts: list[QuantResult]) -> QuantResult:
        """The inverse of :meth:`select_rows`: the results of consecutive row blocks of one matrix,
        quantized apart against one Hessian (a row-separable method split over processes), as one
        result; every per-row field concatenated, shared ones (and ``info``) from the first."""

        def rows(name):
            vals = [getattr(p, name) for p in parts]
            return None if vals[0] is None else torch.cat(vals)

        first = parts[0]
        return QuantResult(
            codes=rows("codes"),
            scales=rows("scales"),
            zeros=rows("zeros"),
            g_idx=first.g_idx,
            perm=first.perm,
            hessian=first.hessian,
            step_errors=rows("step_errors"),
            pivots=first.pivots,
            sparse=rows("sparse"),
            info=dict(first.info),
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        W = dequantize(self.codes, self.scales, self.zeros, self.g_idx, dtype=dtype)
        return W if self.sparse is None else W + self.sparse.to(dtype)
