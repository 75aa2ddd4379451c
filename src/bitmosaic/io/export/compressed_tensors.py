"""Export to compressed-tensors checkpoints (the format of llm-compressor, loaded by vLLM and transformers).

Each layer gets one scheme (weights + input activations) and a storage format:

- ``pack-quantized`` (INT weights, 16-bit activations): ``weight_packed`` int32 ``[out, ceil(in*b/32)]``
  holds the codes offset by ``2**(b-1)`` -- i.e. our unsigned codes -- as a little-endian bit stream
  along the input dimension (:mod:`bitmosaic.formats.wordpack`); ``weight_scale`` fp16 ``[out, G]``;
  ``weight_zero_point`` (asymmetric only) the zeros offset the same way, packed along the output
  dimension ``[ceil(out*b/32), G]``; ``weight_shape`` ``[out, in]``.
- ``int-quantized`` (INT weights with quantized activations, e.g. W8A8 INT8 with per-token dynamic
  scales): ``weight`` int8 ``code - 2**(b-1)``, ``weight_scale``, ``weight_zero_point`` int8 (asym).
- ``float-quantized`` (FP8 weights): ``weight`` float8_e4m3fn, ``weight_scale`` float32 ``[out, 1]``
  (per channel) or ``[1]`` (per tensor); a static activation scale is stored as ``input_scale``.

The value of an INT weight is ``(q - zp) * scale`` with signed ``q = code - 2**(b-1)`` and
``zp = zero - 2**(b-1)``: bit-identical to bitmosaic's ``(code - zero) * scale``.  A symmetric grid has
``zp = 0`` (bitmosaic's fixed zero ``2**(b-1)``), so no zero-point is stored.

What the format cannot hold, and why: compressed-tensors 0.20 removed act-order with a group index
(``actorder: "group"``/``weight_g_idx``), so act-order results are refused (``--format gptq`` keeps their
``g_idx``; ``--lossy`` re-rounds the weights on contiguous groups); its group dequantization needs
``in % group_size == 0``, so a partial last group is split exactly into groups of ``gcd(g, in)``.
Asymmetric zero-points are packed exactly as compressed-tensors' own compressor packs them; its
transformers loader trips on their shape (a library bug: :mod:`.ct_compat` has the work-around).
Activation quantizers map when compressed-tensors has the same scheme: INT/E4M3 per-token dynamic and
per-tensor static (``input_scale``) or dynamic; per-group, power-of-two dynamic, E5M2, E4M3-240 and FP4
activations are refused (dropped with ``--lossy``), except dynamic E4M3 per-group scales (FP8_BLOCK's).
Microscaling layers (MXFP4, NVFP4, MXFP8, FP8 block) and microscaled activations are written as
llm-compressor writes them (:mod:`.ct_mx`).  Note that a loader computes dynamic INT scales its
own way (compressed-tensors: ``amax / 127.5``; bitmosaic and vLLM: ``amax / 127``).
"""

from __future__ import annotations

import json
import math

import torch

from ...formats.wordpack import pack_words
from ...modules.actquant import input_quant_spec
from .common import Source, collect, record
from .ct_mx import mx_act_args, mx_layer
from .layers import IntLayer, Refusal, fp8_layer, int_layer, regroup, requantize_contiguous

__all__ = ["CT_BITS", "build_compressed_tensors", "act_args"]

CT_BITS = (2, 3, 4, 5, 6, 7, 8)


def act_args(m) -> tuple[dict | None, torch.Tensor | None]:
    """The ``input_activations`` arguments of ``m``'s activation quantizer and its static scale."""
    spec = input_quant_spec(m)
    if spec is None:
        return None, None
    if spec.mx is not None:
        return mx_act_args(spec, m.input_quant.scale)
    why = None
    if spec.fmt not in ("int", "e4m3"):
        why = f"{spec.fmt} activations (compressed-tensors has INT and E4M3)"
    elif spec.granularity == "group" and (spec.static or spec.fmt != "e4m3" or spec.pow2):
        why = "per-group activation scales (compressed-tensors has dynamic E4M3 ones: FP8_BLOCK's)"
    elif spec.pow2 and not spec.static:
        why = "dynamic power-of-two activation scales"
    elif spec.clip_ratio != 1 and not spec.static:
        why = f"a dynamic clip ratio of {spec.clip_ratio:g} (compressed-tensors scales by the full maximum)"
    if why:
        raise Refusal(f"activation quantization {spec.label}: {why}")
    args = {
        "num_bits": spec.bits,
        "type": "int" if spec.fmt == "int" else "float",
        "symmetric": True,
        "strategy": spec.granularity,
        "dynamic": not spec.static,
    }
    if spec.granularity == "group":  # FP8_BLOCK's inputs: one dynamic E4M3 scale per token and group
        args["group_size"] = spec.group_size
    return args, (m.input_quant.scale.detach().float().reshape(1).clone() if spec.static else None)


def _weight_args(bits: int, typ: str, symmetric: bool, group: int | None) -> dict:
    strategy = "group" if group else "channel"
    return {
        "num_bits": bits,
        "type": typ,
        "symmetric": symmetric,
        "strategy": strategy,
        "group_size": group,
        "dynamic": False,
    }


def _int_tensors(layer: IntLayer, packed: bool) -> dict[str, torch.Tensor]:
    out, n = layer.codes.shape
    half = 1 << (layer.bits - 1)
    t = {"weight_scale": layer.scales.to(torch.float16).contiguous()}
    if packed:
        t["weight_packed"] = pack_words(layer.codes, layer.bits, dim=1)
        t["weight_shape"] = torch.tensor([out, n], dtype=torch.int64)
        if not layer.symmetric:
            t["weight_zero_point"] = pack_words(layer.zeros, layer.bits, dim=0)
    else:
        t["weight"] = (layer.codes - half).to(torch.int8)
        if not layer.symmetric:
            t["weight_zero_point"] = (layer.zeros - half).to(torch.int8)
    return t


def _convert(lossy: bool):
    def fn(name, m, changes):
        act_refusal = None
        try:
            act, input_scale = act_args(m)
        except Refusal as r:
            act_refusal, act, input_scale = r.reason, None, None
            if lossy:
                changes.append(f"{r.reason}: dropped")
        try:
            return _layer(m, act, input_scale, lossy, changes, act_refusal)
        except Refusal as r:
            raise r.adding(act_refusal) from None

    return fn


def _layer(m, act, input_scale, lossy: bool, changes: list[str], act_refusal: str | None):
    """``(exported layer, tensors, scheme)`` of one module (``act``: its mapped activation scheme)."""
    if getattr(m, "kind", None) == "mx":  # microscaling formats: their own bytes (ct_mx.py)
        lay, t, w, fmt = mx_layer(m)
    elif m.exports_as_fp8(lossy):
        lay = fp8_layer(m, lossy, changes)
        per_tensor = lay.scale.shape[0] == 1
        w = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": "tensor" if per_tensor else "channel",
            "dynamic": False,
        }
        t = {"weight": lay.values, "weight_scale": lay.scale.reshape(1) if per_tensor else lay.scale}
        fmt = "float-quantized"
    else:
        lay = int_layer(m, CT_BITS, lossy, changes)
        if not lay.contiguous:
            reason = (
                "act-order groups (g_idx): compressed-tensors (>= 0.19) removed actorder 'group' and "
                "weight_g_idx (use --format gptq, which keeps g_idx)"
            )
            if not lossy:
                raise Refusal(reason)
            changes.append(reason + ": re-rounded (RTN) on contiguous groups")
            lay = requantize_contiguous(m, lay)
        n = lay.codes.shape[1]
        if n % lay.group_size:
            lay = regroup(lay, math.gcd(lay.group_size, n))
        group = None if lay.group_size == n else lay.group_size
        w = _weight_args(lay.bits, "int", lay.symmetric, group)
        fmt = "pack-quantized" if act is None else "int-quantized"
        t = _int_tensors(lay, fmt == "pack-quantized")
    if input_scale is not None:  # NVFP4 inputs ("local" dynamic): the calibrated tensor scale
        t["input_global_scale" if act.get("dynamic") == "local" else "input_scale"] = input_scale
    if act_refusal and not lossy:
        raise Refusal(act_refusal)
    scheme = {"weights": w, "input_activations": act, "output_activations": None, "format": fmt}
    return lay, t, scheme


def build_compressed_tensors(src: Source, lossy: bool) -> tuple[dict, dict, list, list]:
    """``(tensors, quantization_config, layer records, notes)`` of the compressed-tensors export."""
    done, changes = collect(src.qmods, _convert(lossy), "compressed-tensors", lossy)
    tensors, records, groups = {}, [], {}
    for name, (lay, t, scheme) in done.items():
        m = src.qmods[name]
        tensors.update({f"{name}.{k}": v for k, v in t.items()})
        if m.bias is not None:
            tensors[f"{name}.bias"] = m.bias.detach().clone()
        groups.setdefault(json.dumps(scheme, sort_keys=True), []).append(name)
        w = lay.dequantize(torch.float32)
        records.append(record(name, m, w, changes[name]))
    ignore = src.unquantized_linears()
    config_groups = {}
    for i, (key, names) in enumerate(groups.items()):
        scheme = json.loads(key)
        scheme["targets"] = ["Linear"] if len(groups) == 1 else names
        config_groups[f"group_{i}"] = scheme
    formats = {json.loads(k)["format"] for k in groups}
    qconfig = {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
    }
    notes = []
    split = sorted(
        {
            n
            for n, (lay, _, _) in done.items()
            if isinstance(lay, IntLayer)
            and lay.group_size != getattr(src.qmods[n], "group_size", lay.group_size)
            and not changes[n]
        }
    )
    if split:
        notes.append(f"{len(split)} layer(s) with a partial last group split into full groups (same weights)")
    schemes = [json.loads(k) for k in groups]
    if any(s["format"] == "pack-quantized" and not s["weights"]["symmetric"] for s in schemes):
        notes.append(
            "asymmetric pack-quantized layers: vLLM loads them as written; transformers' from_pretrained "
            "needs bitmosaic.io.export.fix_compressed_tensors_loading() first (a compressed-tensors "
            "<= 0.20 zero-point shape bug, docs/compressed_tensors_zero_point.md)"
        )
    return tensors, qconfig, records, notes
