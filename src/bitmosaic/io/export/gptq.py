"""Export to the GPTQ checkpoint format, as transformers/optimum, GPTQModel and vLLM load it.

Per quantized linear ``name`` (``in`` x ``out``, ``bits`` in 2/3/4/8, ``G`` groups):

- ``name.qweight`` int32 ``[in*bits/32, out]``: the codes of each output column packed along the input
  dimension as one little-endian bit stream (code ``j`` at stream bit ``j*bits``; 3-bit codes spill
  across words) -- :mod:`bitmosaic.formats.wordpack`;
- ``name.qzeros`` int32 ``[G, out*bits/32]``: the zero-points packed the same way along the output
  dimension.  The ``gptq`` (v1) convention stores ``zero - 1`` (AutoGPTQ's historical off-by-one, which
  every v1 loader adds back), so a zero of 0 cannot be stored; ``gptq_v2`` stores zeros as they are.
  Which one is written (``checkpoint_format``): by default v1 for symmetric checkpoints (every GPTQ
  loader reads it; vLLM's Marlin kernels take it) and v2 as soon as one layer is asymmetric --
  GPTQModel refuses asymmetric v1 checkpoints outright (measured: benchmarks/results/gptqmodel_check.md)
  and v1 cannot hold a zero of 0; transformers (through GPTQModel) and vLLM read v2.  ``--gptq-format
  v1`` forces v1 (an asymmetric zero of 0 is then refused, naming the fix);
- ``name.scales`` fp16 ``[G, out]``; ``name.g_idx`` int32 ``[in]`` (the group of each input column);
  ``name.bias`` when the layer has one.

The value of a weight is ``(code - zero) * scale`` with the group ``g_idx[j]`` -- exactly bitmosaic's
packed layout, so packed results export bit-identically.  Act-order results keep their permuted
``g_idx`` (``desc_act: true``); GAR and static-group results have contiguous groups (``desc_act:
false``, ``g_idx[j] = j // group_size``, which loaders also rebuild on their own).  A checkpoint has one
``bits`` / ``group_size`` / ``sym``: groups that do not divide ``in`` (SmolLM2's 576 columns at g128) and
layers with different group sizes are split into groups of the common divisor, repeating the scales, so
the weights stay bit-identical and no loader meets a partial group.

Serving: vLLM (0.33, measured by ``tests/io/test_vllm_config.py``) reads GPTQ checkpoints only when
they are symmetric 4- or 8-bit without act-order groups (``desc_act: false``: ``bitmosaic quantize
--sym``, whose 4/8-bit act-order groups are static by default); it refuses asymmetric, 2/3-bit and
``desc_act: true`` ones, which the export then says in a note (compressed-tensors is vLLM's route for
those).  transformers/GPTQModel load all of them.
GPTQ holds weights only: activation quantizers are refused (dropped with ``--lossy``).
"""

from __future__ import annotations

import math

import torch

from ..._version import __version__
from ...formats.wordpack import pack_words
from ...modules.actquant import input_quant_spec
from .common import Source, collect, record
from .layers import ExportError, IntLayer, Refusal, embed, int_layer, regroup

__all__ = ["GPTQ_BITS", "build_gptq", "gptq_layer_tensors"]

GPTQ_BITS = (2, 3, 4, 8)


def gptq_layer_tensors(layer: IntLayer, v2: bool) -> dict[str, torch.Tensor]:
    """``qweight``, ``qzeros``, ``scales`` and ``g_idx`` of one layer (see the module docstring)."""
    zeros = layer.zeros if v2 else layer.zeros - 1
    return {
        "qweight": pack_words(layer.codes.t(), layer.bits, dim=0),
        "qzeros": pack_words(zeros.t(), layer.bits, dim=1),
        "scales": layer.scales.t().to(torch.float16).contiguous(),
        "g_idx": layer.g_idx.to(torch.int32).contiguous(),
    }


def _convert(lossy: bool):
    def fn(name, m, changes):
        spec = input_quant_spec(m)
        act_refusal = None
        if spec is not None:
            act_refusal = f"activation quantization ({spec.label}): GPTQ checkpoints hold weights only"
            if lossy:
                changes.append(f"activation quantizer {spec.label} dropped")
        if m.in_features % 32 or m.out_features % 32:
            raise Refusal(
                "a layer size that is not a multiple of 32 (GPTQ's packing and kernels need both sizes "
                "to be multiples of 32)",
                fixable=False,
            )
        try:
            layer = int_layer(m, GPTQ_BITS, lossy, changes)
        except Refusal as r:
            raise r.adding(act_refusal) from None
        if act_refusal and not lossy:
            raise Refusal(act_refusal)
        return layer

    return fn


def _harmonize(layers: dict[str, IntLayer], changes: dict, lossy: bool) -> tuple[int, int]:
    """One ``bits`` and one group size for all layers (exact splits; widening only with ``lossy``)."""
    widths = {lay.bits for lay in layers.values()}
    bits = max(widths)
    if len(widths) > 1:
        if not lossy:
            raise ExportError(
                f"cannot export as gptq: the layers have different bit widths {sorted(widths)} and a GPTQ "
                f"checkpoint has one; pass --lossy to widen them all to {bits} bits (exact values, more "
                "storage), or use --format compressed-tensors (one scheme per layer)"
            )
        for name, lay in layers.items():
            if lay.bits != bits:
                values = lay.codes.long() - lay.zeros.long().gather(1, lay.g_idx.long().expand_as(lay.codes))
                changes[name].append(f"{lay.bits}-bit codes widened to {bits} bits (mixed widths)")
                layers[name] = embed(values, lay.scales, lay.g_idx, lay.group_size, bits, lay.symmetric)
    per_channel = all(lay.group_size == lay.codes.shape[1] for lay in layers.values())
    if per_channel:
        return bits, -1
    g = 0
    for lay in layers.values():
        g = math.gcd(g, math.gcd(lay.group_size, lay.codes.shape[1]))
    for name in layers:
        layers[name] = regroup(layers[name], g)
    return bits, g


def build_gptq(src: Source, lossy: bool, v2: bool | None = None) -> tuple[dict, dict, list, list]:
    """``(tensors, quantization_config, layer records, notes)`` of the GPTQ export of ``src``;
    ``v2``: write ``checkpoint_format: gptq_v2`` (``None``: when any layer is asymmetric, see above)."""
    layers, changes = collect(src.qmods, _convert(lossy), "gptq", lossy)
    bits, group = _harmonize(layers, changes, lossy)
    if v2 is None:
        v2 = not all(lay.symmetric for lay in layers.values())
    if not v2:
        zero0 = [n for n, lay in layers.items() if bool((lay.zeros == 0).any())]
        if zero0:
            raise ExportError(
                f"cannot export as gptq (v1): {len(zero0)} layer(s) (e.g. {zero0[0]}) have asymmetric groups "
                "with zero-point 0, which the v1 convention (it stores zero - 1) cannot hold; use "
                "--gptq-format v2 (or auto, the default)"
            )
    tensors, records = {}, []
    for name, lay in layers.items():
        m = src.qmods[name]
        for k, v in gptq_layer_tensors(lay, v2).items():
            tensors[f"{name}.{k}"] = v
        if m.bias is not None:
            tensors[f"{name}.bias"] = m.bias.detach().clone()
        records.append(record(name, m, lay.dequantize(torch.float32), changes[name]))
    desc_act = any(not lay.contiguous for lay in layers.values())
    qconfig = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "desc_act": desc_act,
        "sym": all(lay.symmetric for lay in layers.values()),
        "static_groups": False,
        "true_sequential": True,
        "lm_head": False,
        "checkpoint_format": "gptq_v2" if v2 else "gptq",
        "meta": {
            "quantizer": [f"bitmosaic:{__version__}"],
            "bitmosaic_method": src.qc.get("method"),
        },
    }
    notes = []
    if group != -1 and any(getattr(m, "group_size", group) != group for m in src.qmods.values()):
        notes.append(f"groups split into groups of {group} columns (same weights): one full group size")
    why = [w for w, bad in (("asymmetric", not qconfig["sym"]), (f"{bits}-bit", bits not in (4, 8)),
                            ("act-order groups (desc_act)", desc_act)) if bad]  # fmt: skip
    if why:
        notes.append(
            f"vLLM (0.33) does not serve this GPTQ checkpoint ({', '.join(why)}; it takes symmetric 4/8-bit "
            "without act-order groups: quantize 4 or 8 bits with --sym and static groups, the default "
            "there); transformers and GPTQModel load it, and vLLM reads the compressed-tensors export of a "
            "static-groups result"
        )
    return tensors, qconfig, records, notes
