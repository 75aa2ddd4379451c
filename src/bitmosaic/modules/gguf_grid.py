"""``GGUFGridLinear`` (kind ``"gguf-grid"``): a linear layer stored as llama.cpp's GGUF blocks of a type
bitmosaic's integer layout cannot hold -- ``IQ4_NL``, ``IQ4_XS``, the k-quants ``Q2_K`` .. ``Q6_K`` (their
integer sub-block scales and mins), ``Q4_1`` / ``Q5_1`` (fp16 mins, no multiple of the scale) and the
lattice codebooks ``IQ3_S`` / ``IQ2_S`` / ``IQ2_XS`` / ``IQ3_XXS`` / ``IQ2_XXS`` -- calibrated on that
type's grid (issue 72).

The one buffer ``blocks`` (uint8 ``[out, row bytes]``) *is* the tensor's data in the GGUF file, so the GGUF
export writes it as it is and the accounting counts exactly its bits (IQ4_NL 4.5, IQ4_XS 4.25, Q4_K 4.5,
Q6_K 6.5625, IQ3_S 3.4375, IQ2_S 2.5625, IQ2_XS 2.3125, IQ3_XXS 3.0625, IQ2_XXS 2.0625 per weight...).
The weight: IQ4 and lattice types through
:func:`bitmosaic.formats.gguf_iq.dequantize` / :func:`bitmosaic.formats.gguf_lattice.dequantize` of the
unpacked blocks (float32, what ggml computes), k-quants and Q4_1 / Q5_1 through the ``gguf`` package's
dequantizer; the reference path reads every type with the ``gguf`` package (tested equal to the
solver's own float model).  No INT or FP8 form: other export formats refuse it in one line.
"""

from __future__ import annotations

import numpy as np
import torch

from ..algorithms import gguf_kquants as kq
from ..algorithms import gguf_legacy as gl
from ..formats import gguf_iq as iq
from ..formats import gguf_lattice as lat
from .base import NoIntForm, QuantModule

__all__ = ["GGUFGridLinear"]


class GGUFGridLinear(QuantModule):
    kind = "gguf-grid"
    CONFIG_KEYS = ("gguf_type",)

    def __init__(self, in_features: int, out_features: int, *, gguf_type: str, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        known = (*iq.IQ_TYPES, *kq.K_TYPES, *gl.L_TYPES, *lat.LATTICE_TYPES)
        if gguf_type not in known:
            raise ValueError(f"gguf_type {gguf_type!r} is not one of {', '.join(known)}")
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[gguf_type]]
        if in_features % block:
            raise ValueError(
                f"{gguf_type} needs an input width that is a multiple of {block}, got {in_features}"
            )
        self.gguf_type = gguf_type
        k = kq.K_TYPES.get(gguf_type) or gl.L_TYPES.get(gguf_type)
        # for reports: the code width and the weights per scale
        self.bits, self.group_size = (k.qmax.bit_length(), getattr(k, "sub", gl.BLOCK)) if k else (4, iq.SUB)
        lt = lat.LATTICE_TYPES.get(gguf_type)
        if lt:  # IQ2_S / IQ2_XS / IQ2_XXS ~2, IQ3_S / IQ3_XXS ~3 bits a weight; one 4-bit scale per sub-block
            self.bits, self.group_size = int(lt.bits), lt.sub
        self.symmetric = not (k and k.with_min)
        self.register_buffer(
            "blocks", torch.zeros(out_features, in_features // block * size, dtype=torch.uint8)
        )

    @property
    def iq_type(self) -> iq.IQType:
        return iq.IQ_TYPES[self.gguf_type]

    @classmethod
    def from_result(cls, res, bias=None) -> GGUFGridLinear:
        """The module of a :class:`~bitmosaic.algorithms.gguf_grid.GGUFGridResult`."""
        out, n = res.codes.shape
        m = cls(n, out, gguf_type=res.gguf_type, bias=bias is not None)
        if res.gguf_type in kq.K_TYPES:
            data = kq.pack(res.stored(), kq.K_TYPES[res.gguf_type])
        elif res.gguf_type in gl.L_TYPES:
            data = gl.pack(*(x.cpu() for x in res.stored()), gl.L_TYPES[res.gguf_type])
        elif res.gguf_type in lat.LATTICE_TYPES:
            data = lat.pack(*res.stored(), lat.LATTICE_TYPES[res.gguf_type])
        else:
            data = iq.pack(*(x.cpu() for x in res.stored()), res.iq_type)
        m.blocks.copy_(torch.from_numpy(data))
        m._set_bias(bias)
        return m

    def gguf_data(self) -> tuple[np.ndarray, str]:
        """``(bytes, type name)``: the tensor as the GGUF file stores it."""
        return self.blocks.cpu().numpy(), self.gguf_type

    def _dequantize(self, dtype):
        if self.gguf_type in (*kq.K_TYPES, *gl.L_TYPES):
            return self.dequantize_reference(dtype)
        if self.gguf_type in lat.LATTICE_TYPES:
            t = lat.LATTICE_TYPES[self.gguf_type]
            w = lat.dequantize(*lat.unpack(self.blocks.cpu().numpy(), t, self.in_features), t)
            return w.to(device=self.blocks.device, dtype=dtype)
        codes, d, l = iq.unpack(self.blocks.cpu().numpy(), self.iq_type, self.in_features)
        return iq.dequantize(codes, d, l, self.iq_type).to(device=self.blocks.device, dtype=dtype)

    def dequantize_reference(self, dtype=torch.float32):
        import gguf

        w = gguf.quants.dequantize(self.blocks.cpu().numpy(), gguf.GGMLQuantizationType[self.gguf_type])
        w = np.ascontiguousarray(w, dtype=np.float32).reshape(self.out_features, self.in_features)
        return torch.from_numpy(w).to(device=self.blocks.device, dtype=dtype)

    def storage_tensors(self):
        return [self.blocks]

    def layer_config(self) -> dict:
        return self._config(gguf_type=self.gguf_type, bits=self.bits, group_size=self.group_size)

    def int_form(self, allowed_bits, lossy, changes):
        raise NoIntForm(
            f"a {self.gguf_type} layer is on that GGUF type's own grid, not bitmosaic's integer one "
            "(export it with --format gguf)",
            fixable=False,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.gguf_type}"
