"""One base for every quantized module kind: features, optional bias, the dequantized-weight cache,
forward, bits-per-weight accounting and dtype-safe moves.

A kind implements ``_dequantize(dtype)`` (its fast path), ``dequantize_reference(dtype)`` (the
reference path, tested equal), ``storage_tensors()`` and ``layer_config()``.  The cache logic lives
here alone, so a kind can never bypass or duplicate it (issue #9: five copies of it had drifted).
"""

from __future__ import annotations

import torch
from torch import nn

from ..formats.accounting import bits_per_weight

__all__ = ["QuantModule"]


class QuantModule(nn.Module):
    kind = "base"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, cache_weight: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.cache_weight = cache_weight
        self._wcache: torch.Tensor | None = None

    # -- the hook each kind implements ---------------------------------------------------------
    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def storage_tensors(self) -> list[torch.Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- shared --------------------------------------------------------------------------------
    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The inference weight ``[out, in]`` (cached between calls when ``cache_weight``)."""
        if self._wcache is not None:
            return self._wcache.to(dtype)
        w = self._dequantize(dtype)
        if self.cache_weight:
            self._wcache = w
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.dequantize_weight(torch.float32).to(x.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, w, b)

    def bits_per_weight(self) -> float:
        return bits_per_weight(self.storage_tensors(), self.in_features * self.out_features)

    def _apply(self, fn, recurse=True):
        """``model.to(dtype)`` / ``.half()`` must not cast the stored format (fp16 scales, FP8 bytes,
        float32 FP8 scales): storage buffers only follow device moves; the bias follows ``fn``."""
        self._wcache = None
        ids = {id(t) for t in self.storage_tensors()}
        keep = {k: b for k, b in self._buffers.items() if b is not None and id(b) in ids}
        for k in keep:
            self._buffers[k] = None
        try:
            super()._apply(fn, recurse)
        finally:
            for k, b in keep.items():
                device = fn(torch.empty(0, dtype=b.dtype, device=b.device)).device
                self._buffers[k] = b.to(device)
        return self
