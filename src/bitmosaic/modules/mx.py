"""Module kind ``mx``: a linear stored in a microscaling format (MXFP4, NVFP4, MXFP8, FP8 block; issue 75).

Buffers are the exact stored form of :class:`bitmosaic.formats.mx.MXTensor`:

* ``weight_packed``: E2M1 codes two a byte (``[out, in/2]``, even column in the low nibble) or FP8 bytes
  (``[out, in]``);
* ``weight_scale``: the block scales in their encoding (E8M0 bytes, E4M3 bytes or float32);
* ``weight_global_scale``: NVFP4's float32 tensor scale (``[1]``; other formats have none).

Inference runs the reference kernel: rows of the weight dequantized exactly (element value times its
block's divisor, float32) a tile at a time and multiplied in float32
(:class:`~bitmosaic.modules.kernel.TiledKernel`), never a resident float weight.
"""

from __future__ import annotations

import torch

from ..formats.mx import MXTensor, get_mx_format, mx_dequantize
from .base import NoIntForm, QuantModule
from .kernel import TiledKernel

__all__ = ["MXLinear", "from_result"]


class MXLinear(QuantModule):
    """A linear in microscaling format ``fmt`` (a :data:`bitmosaic.formats.mx.MX_FORMATS` name)."""

    kind = "mx"
    CONFIG_KEYS = ("fmt",)

    def __init__(self, in_features, out_features, *, fmt: str = "mxfp4", bias=False):
        super().__init__(in_features, out_features, bias, cache_weight=False)
        f = get_mx_format(fmt)
        self.fmt = f.name
        cols = in_features // 2 if f.elem == "e2m1" else in_features
        if f.elem == "e2m1" and in_features % 2:
            raise ValueError(f"{f.name} packs two values a byte; in_features={in_features} is odd")
        self.register_buffer("weight_packed", torch.zeros(out_features, cols, dtype=torch.uint8))
        self.register_buffer(
            "weight_scale", torch.zeros(f.scale_shape(out_features, in_features), dtype=f.scale_dtype)
        )
        if f.global_scale:
            self.register_buffer("weight_global_scale", torch.ones(1, dtype=torch.float32))
        else:
            self.weight_global_scale = None

    @property
    def format(self):
        return get_mx_format(self.fmt)

    @classmethod
    def from_tensor(cls, t: MXTensor, bias=None) -> MXLinear:
        out, n = t.shape
        m = cls(n, out, fmt=t.fmt.name, bias=bias is not None)
        m.weight_packed.copy_(t.elements)
        m.weight_scale.copy_(t.scales)
        if t.global_scale is not None:
            m.weight_global_scale.copy_(t.global_scale)
        m._set_bias(bias)
        return m

    def tensor(self) -> MXTensor:
        """The stored matrix as an :class:`MXTensor` (sharing the buffers)."""
        return MXTensor(self.format, (self.out_features, self.in_features), self.weight_packed,
                        self.weight_scale, self.weight_global_scale)  # fmt: skip

    def _rows(self, rows: slice) -> torch.Tensor:
        """Rows ``rows`` of the weight, dequantized exactly (float32): the reference kernel's tile."""
        f, t = self.format, self.tensor()
        sa, sb = rows.start // f.block_rows, -(-rows.stop // f.block_rows)
        r0, r1 = sa * f.block_rows, min(sb * f.block_rows, self.out_features)
        part = MXTensor(f, (r1 - r0, self.in_features), t.elements[r0:r1], t.scales[sa:sb], t.global_scale)
        return mx_dequantize(part)[rows.start - r0 : rows.stop - r0]

    def _dequantize(self, dtype) -> torch.Tensor:
        return mx_dequantize(self.tensor(), torch.float32).to(dtype)

    def dequantize_reference(self, dtype=torch.float32) -> torch.Tensor:
        return mx_dequantize(self.tensor(), torch.float32).to(dtype)

    def _build_kernel(self):
        if self.weight_packed.device.type != "cpu":
            return None
        held = sum(t.numel() * t.element_size() for t in self.storage_tensors())
        return TiledKernel(self._rows, self.out_features, self.in_features, held)

    def storage_tensors(self):
        return self.tensor().tensors()

    def layer_config(self) -> dict:
        return self._config(fmt=self.fmt)

    def int_form(self, allowed_bits, lossy, changes):
        raise NoIntForm(f"{self.fmt} weights are floats with block scales, not an INT grid", fixable=False)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.fmt}"


def from_result(result, bias=None) -> MXLinear:
    """The module of a microscaling quantization result (anything with ``to_tensor() -> MXTensor``)."""
    return MXLinear.from_tensor(result.to_tensor(), bias)
