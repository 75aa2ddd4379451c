"""One base for every quantized module kind: features, optional bias, the dequantized-weight cache,
forward, bits-per-weight accounting, the common saved-config keys and dtype-safe moves.

A kind implements ``_dequantize(dtype)`` (its fast path), ``dequantize_reference(dtype)`` (the
reference path, tested equal), ``storage_tensors()`` and ``layer_config()`` (built on
:meth:`QuantModule._config`).  The cache logic lives here alone, so a kind can never bypass or
duplicate it (issue #9: five copies of it had drifted).

Nothing here assumes a device: every weight is computed from the buffers, on their device.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ..formats.accounting import bits_per_weight

__all__ = ["QuantModule", "set_weight_cache", "prepare_kernels"]


class QuantModule(nn.Module):
    kind = "base"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, cache_weight: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.cache_weight = cache_weight
        self._wcache: torch.Tensor | None = None
        self._kernel = None  # the kernel weight built from the buffers (see modules/kernel.py)

    # -- what each kind implements -------------------------------------------------------------
    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[out, in]`` in ``dtype`` via the kind's fast path (a new tensor)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _dequantize(dtype)")

    def dequantize_reference(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight via the reference path of the kind's format (tested equal to ``_dequantize``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement dequantize_reference(dtype)")

    def storage_tensors(self) -> list[torch.Tensor]:
        """The buffers that *are* the stored format (counted in bits per weight, never cast)."""
        raise NotImplementedError(f"{type(self).__name__} must implement storage_tensors()")

    def layer_config(self) -> dict:
        """What a loader needs to rebuild this module (saved per layer in quantization_config)."""
        raise NotImplementedError(f"{type(self).__name__} must implement layer_config()")

    def _build_kernel(self):
        """The kind's :class:`~bitmosaic.modules.kernel.KernelWeight` (CPU inference without a
        float weight), or ``None`` when the kind has none (forward then dequantizes per call)."""
        return None

    # -- shared --------------------------------------------------------------------------------
    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The inference weight ``[out, in]`` in ``dtype``; with ``cache_weight`` the last one computed
        is kept and served again for the same dtype (never converted from another dtype)."""
        w = self._wcache
        if w is None or w.dtype != dtype:
            w = self._dequantize(dtype)
            if self.cache_weight:
                self._wcache = w
        return w

    def set_weight_cache(self, enabled: bool) -> None:
        self.cache_weight = enabled
        if not enabled:
            self._wcache = None

    def kernel(self):
        """The kernel weight, built once from the buffers (``None``: this kind has none)."""
        if self._kernel is None:
            self._kernel = self._build_kernel() or False
        return self._kernel or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.to(x.dtype)
        if self._wcache is None and not self.cache_weight and x.device.type == "cpu":
            k = self.kernel()
            if k is not None:
                y = k(x)
                return y if b is None else y + b
        w = self.dequantize_weight(torch.float32).to(x.dtype)
        return nn.functional.linear(x, w, b)

    def bits_per_weight(self) -> float:
        return bits_per_weight(self.storage_tensors(), self.in_features * self.out_features)

    # constructor keywords a kind stores in its saved per-layer config, besides the shared ones
    CONFIG_KEYS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def _shared_kwargs(cls, cfg: dict) -> dict:
        return {"bias": cfg.get("bias", False)}

    @classmethod
    def from_layer_config(cls, cfg: dict):
        """Rebuild an empty module of this kind from its saved per-layer config."""
        own = {k: cfg[k] for k in cls.CONFIG_KEYS}
        return cls(cfg["in_features"], cfg["out_features"], **own, **cls._shared_kwargs(cfg))

    def _config(self, **fields) -> dict:
        """The saved keys every kind has, followed by the kind's own ``fields``."""
        return {
            "kind": self.kind,
            "in_features": self.in_features,
            "out_features": self.out_features,
            "bias": self.bias is not None,
            **fields,
        }

    def _set_bias(self, bias: torch.Tensor | None) -> None:
        if bias is not None:
            self.bias.data.copy_(bias.detach().float())

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}"

    def _load_from_state_dict(self, *args, **kwargs):
        self._wcache = None  # new buffers: a weight (or kernel) built from the old ones is stale
        self._kernel = None
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        """``model.to(dtype)`` / ``.half()`` must not cast the stored format (fp16 scales, FP8 bytes,
        float32 FP8 scales): storage buffers only follow device moves; the bias follows ``fn``."""
        self._wcache = None
        self._kernel = None
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


def prepare_kernels(model: nn.Module) -> None:
    """Build every quantized module's kernel weight now (at load) rather than at its first forward."""
    for m in model.modules():
        if isinstance(m, QuantModule):
            m.kernel()


def set_weight_cache(model: nn.Module, enabled: bool = True) -> None:
    """Keep (or drop) every quantized module's dequantized weight between forwards (faster eval,
    more RAM), whatever its kind.  Huffman-coded modules start with theirs on (decoding is slow)."""
    for m in model.modules():
        if isinstance(m, QuantModule):
            m.set_weight_cache(enabled)
