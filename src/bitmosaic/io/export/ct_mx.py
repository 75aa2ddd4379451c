"""Microscaling layers (module kind ``mx``, issue 75) in compressed-tensors, as llm-compressor writes them:

==============  =========================  ===================================================================
bitmosaic       compressed-tensors format  tensors (weights args as the preset's)
==============  =========================  ===================================================================
``nvfp4``       ``nvfp4-pack-quantized``   ``weight_packed`` uint8 ``[out, in/2]`` (even column low nibble),
                                           ``weight_scale`` float8_e4m3fn ``[out, in/16]``,
                                           ``weight_global_scale`` float32 ``[1]`` (``NVFP4A16``)
``mxfp4``       ``mxfp4-pack-quantized``   ``weight_packed``, ``weight_scale`` uint8 E8M0 ``[out, in/32]``
``mxfp8``       ``mxfp8-quantized``        ``weight`` float8_e4m3fn, ``weight_scale`` uint8 E8M0
``fp8-block``   ``float-quantized``        ``weight`` float8_e4m3fn, ``weight_scale`` float32 ``[⌈out/128⌉,
                                           ⌈in/128⌉]``, strategy ``block`` ``[128, 128]`` (``FP8_BLOCK``)
==============  =========================  ===================================================================

Microscaled activations (``--scheme NVFP4 | MXFP4 | MXFP8``) get the ``input_activations`` of
llm-compressor's presets (:func:`mx_act_args`): dynamic E8M0 block scales for MXFP4/MXFP8, and for NVFP4
dynamic E4M3 block scales over the calibrated tensor scale (``dynamic: "local"``, stored as
``input_global_scale``).  Not held: a dynamic NVFP4 tensor scale and the OCP ``floor`` exponent rule
(compressed-tensors computes activation scales with its own ``round`` rule).

The bytes are bitmosaic's own stored bytes (the same packing and scale encodings), so the export is
exact; compressed-tensors' decompressor reads them back to the same weights (``tests/io``).  Not held:
MXFP8 with E5M2 elements (compressed-tensors' MXFP8 is E4M3), and FP4 blocks over a partial last group
(its group dequantization needs ``in % group == 0``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...formats.mx import MXTensor, mx_dequantize
from .layers import Refusal

__all__ = ["mx_layer", "mx_act_args"]


@dataclass
class MXLayer:
    """What the export writes of one ``mx`` layer (``dequantize``: the weights it stands for)."""

    tensor: MXTensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return mx_dequantize(self.tensor, dtype)


def _args(bits: int, strategy: str, group: int | None, scale_dtype: str | None = None, block=None) -> dict:
    d = {"num_bits": bits, "type": "float", "symmetric": True, "group_size": group, "strategy": strategy,
         "dynamic": False}  # fmt: skip
    if block is not None:
        d["block_structure"] = list(block)
    if scale_dtype is not None:
        d["scale_dtype"] = scale_dtype
    return d


def mx_layer(m) -> tuple[MXLayer, dict[str, torch.Tensor], dict, str]:
    """``(layer, tensors, weights args, format)`` of an ``mx`` module; :class:`Refusal` where the
    format cannot hold it."""
    t = m.tensor()
    f = t.fmt
    out, n = t.shape
    if f.elem == "e2m1" and n % f.block:
        raise Refusal(f"{f.name} with in_features={n} (compressed-tensors needs whole groups of {f.block})")
    tensors = {"weight_scale": t.scales.clone()}
    if f.name == "nvfp4":
        tensors["weight_packed"] = t.elements.clone()
        tensors["weight_global_scale"] = t.global_scale.clone()
        args, fmt = _args(4, "tensor_group", 16, "torch.float8_e4m3fn"), "nvfp4-pack-quantized"
    elif f.name == "mxfp4":
        tensors["weight_packed"] = t.elements.clone()
        args, fmt = _args(4, "group", 32, "torch.uint8"), "mxfp4-pack-quantized"
    elif f.name == "mxfp8":
        tensors["weight"] = t.elements.view(torch.float8_e4m3fn).clone()
        args, fmt = _args(8, "group", 32, "torch.uint8"), "mxfp8-quantized"
    elif f.name == "fp8-block":
        tensors["weight"] = t.elements.view(torch.float8_e4m3fn).clone()
        args, fmt = _args(8, "block", None, block=(f.block_rows, f.block)), "float-quantized"
    else:
        raise Refusal(f"{f.name} weights (compressed-tensors' MXFP8 has E4M3 elements)")
    return MXLayer(t), tensors, args, fmt


def mx_act_args(spec, scale: torch.Tensor | None) -> tuple[dict, torch.Tensor | None]:
    """``(input_activations args, input_global_scale or None)`` of a microscaled activation quantizer
    (:class:`~bitmosaic.formats.act.ActQuantSpec` with ``mx``), as llm-compressor's NVFP4 / MXFP4 / MXFP8
    presets write them; :class:`Refusal` where compressed-tensors computes something else."""
    if spec.mx_rule != "round":
        raise Refusal(
            f"activation quantization {spec.label}: compressed-tensors rounds E8M0 scales its own way"
        )
    args = {"num_bits": spec.bits, "type": "float", "symmetric": True, "group_size": spec.group_size}
    if spec.mx == "nvfp4":
        if not spec.static:
            raise Refusal(
                f"activation quantization {spec.label}: compressed-tensors' NVFP4 inputs have a calibrated "
                "tensor scale (use the static one: --scheme NVFP4)"
            )
        args.update(strategy="tensor_group", dynamic="local", scale_dtype="torch.float8_e4m3fn",
                    observer="static_minmax")  # fmt: skip
        return args, scale.detach().float().reshape(1).clone()
    args.update(strategy="group", dynamic=True, scale_dtype="torch.uint8")
    return args, None
