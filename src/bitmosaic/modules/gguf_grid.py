"""``GGUFGridLinear`` (kind ``"gguf-grid"``): a linear layer stored as llama.cpp's GGUF blocks of a type
bitmosaic has no integer grid for (``IQ4_NL``, ``IQ4_XS``; issue 72).

The one buffer ``blocks`` (uint8 ``[out, row bytes]``) *is* the tensor's data in the GGUF file, so the GGUF
export writes it as it is and the accounting counts exactly its bits (4.5 / 4.25 per weight).  The weight
is :func:`bitmosaic.formats.gguf_iq.dequantize` of the unpacked blocks (float32, what ggml computes);
the reference path reads the same bytes with the ``gguf`` package's own dequantizer where it is
installed (tested equal).  No INT or FP8 form: other export formats refuse it in one line.
"""

from __future__ import annotations

import numpy as np
import torch

from ..formats import gguf_iq as iq
from .base import NoIntForm, QuantModule

__all__ = ["GGUFGridLinear"]


class GGUFGridLinear(QuantModule):
    kind = "gguf-grid"
    CONFIG_KEYS = ("gguf_type",)

    def __init__(self, in_features: int, out_features: int, *, gguf_type: str, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        if gguf_type not in iq.IQ_TYPES:
            raise ValueError(f"gguf_type {gguf_type!r} is not one of {', '.join(iq.IQ_TYPES)}")
        t = iq.IQ_TYPES[gguf_type]
        if in_features % t.block:
            raise ValueError(f"{gguf_type} needs an input width that is a multiple of {t.block}, got {in_features}")
        self.gguf_type = gguf_type
        self.bits, self.group_size, self.symmetric = 4, iq.SUB, True  # for reports: a 4-bit grid per 32
        self.register_buffer("blocks", torch.zeros(out_features, iq.row_bytes(t, in_features), dtype=torch.uint8))

    @property
    def iq_type(self) -> iq.IQType:
        return iq.IQ_TYPES[self.gguf_type]

    @classmethod
    def from_result(cls, res, bias=None) -> GGUFGridLinear:
        """The module of a :class:`~bitmosaic.algorithms.gguf_grid.GGUFGridResult`."""
        out, n = res.codes.shape
        m = cls(n, out, gguf_type=res.gguf_type, bias=bias is not None)
        m.blocks.copy_(torch.from_numpy(iq.pack(*(x.cpu() for x in res.stored()), res.iq_type)))
        m._set_bias(bias)
        return m

    def gguf_data(self) -> tuple[np.ndarray, str]:
        """``(bytes, type name)``: the tensor as the GGUF file stores it."""
        return self.blocks.cpu().numpy(), self.gguf_type

    def _dequantize(self, dtype):
        codes, d, l = iq.unpack(self.blocks.cpu().numpy(), self.iq_type, self.in_features)
        return iq.dequantize(codes, d, l, self.iq_type).to(device=self.blocks.device, dtype=dtype)

    def dequantize_reference(self, dtype=torch.float32):
        try:
            from gguf import quants
        except ImportError:  # the gguf package is optional: the same bytes through our own reader
            return self._dequantize(dtype)
        w = quants.dequantize(self.blocks.cpu().numpy(), self.iq_type.qtype)
        w = np.ascontiguousarray(w, dtype=np.float32).reshape(self.out_features, self.in_features)
        return torch.from_numpy(w).to(device=self.blocks.device, dtype=dtype)

    def storage_tensors(self):
        return [self.blocks]

    def layer_config(self) -> dict:
        return self._config(gguf_type=self.gguf_type, bits=4, group_size=iq.SUB)

    def int_form(self, allowed_bits, lossy, changes):
        raise NoIntForm(
            f"a {self.gguf_type} layer is on llama.cpp's non-linear grid, not an integer one "
            "(export it with --format gguf)",
            fixable=False,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.gguf_type}"
