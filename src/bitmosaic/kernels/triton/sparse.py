"""SSQR's dense product plus its CSR outliers on the GPU (issue 76; SSQR's decode kernel, paper §4): the
dense part is the packed INT kernel (:mod:`bitmosaic.kernels.triton.intmm`), then one Triton pass adds each
output row's CSR outliers, read from the row pointers / columns / values as stored.

Reference: :class:`bitmosaic.modules.kernel.SparseAddKernel` -- the dense result, plus ``sparse @ x`` in
float32, rounded once to ``x``'s dtype; the Triton pass does the same additions in that order, its
outlier sum in its own order (float32).
"""

from __future__ import annotations

import torch

from . import check_device, jit_module

__all__ = ["TritonSparseAddKernel"]


class TritonSparseAddKernel:
    """A Triton dense kernel plus a CSR ``[out, in]`` matrix added by a Triton pass (the interface of
    :class:`~bitmosaic.modules.kernel.SparseAddKernel`: ``.dense``, ``.sparse``, ``nbytes``)."""

    def __init__(self, dense, sparse: torch.Tensor) -> None:
        self.dense = dense
        self.sparse = s = sparse.to_sparse_csr() if sparse.layout != torch.sparse_csr else sparse
        self._rp = s.crow_indices().to(torch.int32).contiguous()
        self._cols = s.col_indices().to(torch.int32).contiguous()
        self._vals = s.values().float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dense(x)
        if self._vals.numel() == 0 or y.numel() == 0:
            return y
        check_device(x)
        K = x.shape[-1]
        x2 = x.reshape(-1, K)
        if x2.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            x2 = x2.float()
        x2 = x2.contiguous()
        y2 = y.reshape(-1, y.shape[-1]).contiguous()
        M, N = y2.shape
        BM = 16 if M > 1 else 1
        grid = (N, -(-M // BM))
        jit_module("sparse_jit").csr_add_kernel[grid](
            x2, self._rp, self._cols, self._vals, y2, M, x2.stride(0), y2.stride(0), BM=BM, BJ=32
        )
        return y2.reshape(y.shape)

    def nbytes(self) -> int:
        parts = (self._rp, self._cols, self._vals)
        return self.dense.nbytes() + sum(t.numel() * t.element_size() for t in parts)
