"""Module kind ``mx``: a linear stored in a microscaling format (MXFP4, NVFP4, MXFP8, FP8 block; issue 75).

Buffers are the exact stored form of :class:`bitmosaic.formats.mx.MXTensor`:

* ``weight_packed``: E2M1 codes two a byte (``[out, in/2]``, even column in the low nibble) or FP8 bytes
  (``[out, in]``);
* ``weight_scale``: the block scales in their encoding (E8M0 bytes, E4M3 bytes or float32);
* ``weight_global_scale``: NVFP4's float32 tensor scale (``[1]``; other formats have none).

Inference on the CPU runs the kernel :func:`~bitmosaic.kernels.select.select_kernel` picks among
``KERNELS``: for MXFP4 and NVFP4 the FP4 LUT GEMV (:class:`~bitmosaic.kernels.fp4lut.FP4LutWeight`,
issue 75 item 5: tables of the 16 E2M1 values times each activation, the block divisor per block; tiles
above 32 rows of x), for the FP8 formats -- and FP4 without the compiled extension -- the reference
kernel (:class:`~bitmosaic.kernels.fp4lut.MXTiledWeight`: rows of the weight dequantized exactly, element
value times its block's divisor, float32, a tile at a time and multiplied in float32); never a resident
float weight.  The FP4 kernel's layout holds the stored bytes (codes transposed per tile of 16 rows, scale
bytes transposed, decoded inside the kernel), so ``weight_packed`` and ``weight_scale`` are released once
it is built and rebuilt from it on demand (``modules/base.py``): a loaded MXFP4/NVFP4 linear holds the
file's 4.25/4.5 bits per weight, no float copy of its scales.
"""

from __future__ import annotations

import torch

from ..formats.mx import MXTensor, get_mx_format, mx_dequantize
from ..kernels.fp4lut import FP4LutWeight
from ..kernels.select import select_kernel
from .base import NoIntForm, QuantModule
from .kernel import KernelWeight

__all__ = ["MXLinear", "MXKernel", "from_result"]


class MXKernel(KernelWeight):
    """The ``mx`` kind's kernel weight: ``.weight`` (an :class:`FP4LutWeight` or :class:`MXTiledWeight`)."""

    def __init__(self, weight) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.matmul(x)

    def nbytes(self) -> int:
        return self.weight.nbytes()


class MXLinear(QuantModule):
    """A linear in microscaling format ``fmt`` (a :data:`bitmosaic.formats.mx.MX_FORMATS` name)."""

    kind = "mx"
    CONFIG_KEYS = ("fmt",)
    KERNELS = ("fp4_lut", "mx_tiles")  # kernels/select.py names, preferred first

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

    def _dequantize(self, dtype) -> torch.Tensor:
        return mx_dequantize(self.tensor(), torch.float32).to(dtype)

    def dequantize_reference(self, dtype=torch.float32) -> torch.Tensor:
        return mx_dequantize(self.tensor(), torch.float32).to(dtype)

    def _build_kernel(self):
        if self.weight_packed.device.type != "cpu":
            return None
        f = self.format
        kind = select_kernel(self.KERNELS, f.elem_bits, device="cpu", group_size=f.block)
        return MXKernel(kind.from_tensor(self.tensor()))

    def _saved_from_kernel(self, kernel) -> dict:
        w = kernel.weight
        if not isinstance(w, FP4LutWeight):  # the reference tiles hold the buffers themselves
            return {}
        return {
            "weight_packed": lambda: w.packed_rows(0, w.N).contiguous(),
            "weight_scale": lambda: w.scale_rows(0, w.N),
        }

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
