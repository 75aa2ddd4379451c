"""A work-around for compressed-tensors' loader of asymmetric ``pack-quantized`` checkpoints.

compressed-tensors packs an asymmetric group/channel zero-point along the output dimension when it
writes a checkpoint (``PackedQuantizationCompressor.compress``: int32 ``[ceil(out*bits/32), G]``,
which our writer reproduces bit for bit), and unpacks it that way in ``decompress``.  But the
same ``compress`` called on a *meta* weight -- the path transformers' ``from_pretrained`` uses to
build the empty compressed model the checkpoint is loaded into -- leaves ``weight_zero_point`` at
its unpacked shape ``[out, G]``, so every asymmetric pack-quantized checkpoint (llm-compressor's own
included) fails transformers' size check.  Found in compressed-tensors 0.20.0 and still on its main
branch (2026-08); the smallest reproduction is in ``docs/compressed_tensors_zero_point.md``.

:func:`fix_compressed_tensors_loading` makes the meta path give the packed shape (what the real
path writes and what ``decompress`` reads).  It changes nothing when the installed version already
does so (checked on a probe), so it stays harmless after an upstream fix; it is idempotent.
"""

from __future__ import annotations

import math

import torch

__all__ = ["fix_compressed_tensors_loading", "meta_zero_point_is_packed"]

_PATCHED = "_bitmosaic_packed_zero_point"


def _probe_scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w = QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=32)
    return QuantizationScheme(targets=["Linear"], weights=w)


def meta_zero_point_is_packed() -> bool:
    """Whether compressed-tensors' meta ``compress`` gives an asymmetric zero-point its packed shape."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    sd = {
        "weight": torch.empty(64, 64, device="meta"),
        "weight_scale": torch.empty(64, 2, device="meta"),
        "weight_zero_point": torch.empty(64, 2, dtype=torch.int8, device="meta"),
    }
    zp = PackedQuantizationCompressor.compress(sd, _probe_scheme())["weight_zero_point"]
    return tuple(zp.shape) == (8, 2) and zp.dtype == torch.int32


def fix_compressed_tensors_loading() -> bool:
    """Let transformers load asymmetric pack-quantized checkpoints; returns whether a patch was needed.

    Call it before ``AutoModelForCausalLM.from_pretrained`` of such a checkpoint (symmetric ones and
    vLLM need nothing)."""
    from compressed_tensors.compressors.pack_quantized import base

    cls = base.PackedQuantizationCompressor
    if getattr(cls.compress, _PATCHED, False):
        return True
    if meta_zero_point_is_packed():
        return False
    original = cls.compress.__func__

    def compress(klass, state_dict, scheme):
        out = original(klass, state_dict, scheme)
        zp, w = out.get("weight_zero_point"), scheme.weights
        if (
            zp is not None
            and zp.device.type == "meta"
            and w is not None
            and not w.symmetric
            and w.strategy in base.PACK_ZP_STRATS
        ):
            rows = math.ceil(zp.shape[0] * w.num_bits / 32)
            out["weight_zero_point"] = torch.empty((rows, *zp.shape[1:]), dtype=torch.int32, device="meta")
        return out

    setattr(compress, _PATCHED, True)
    cls.compress = classmethod(compress)
    return True
