"""GGUF ``MXFP4`` blocks (ggml type 39, gguf 0.19) of an ``mx`` layer in MXFP4 (issue 75), exactly.

A block is 32 consecutive columns of one row in 17 bytes: the E8M0 scale byte, then 16 bytes whose
byte ``j`` holds element ``j`` in its low nibble and element ``j + 16`` in its high nibble (ggml's
``block_mxfp4``; the nibbles are the same E2M1 codes ``sign<<3 | index`` bitmosaic stores, and ggml's
``kvalues_mxfp4`` are the doubled E2M1 values over a halved scale: the same products).  Only MXFP4
maps exactly; the other microscaling formats have no GGUF block type here.
"""

from __future__ import annotations

import numpy as np

from ...formats.mx import unpack_fp4
from .layers import Refusal

__all__ = ["MXFP4_TYPE", "mxfp4_blocks"]

MXFP4_TYPE = "MXFP4"
_BLOCK = 32


def mxfp4_blocks(m) -> np.ndarray:
    """``uint8 [out, in/32 * 17]``: the layer's MXFP4 blocks; :class:`Refusal` for other formats."""
    t = m.tensor()
    if t.fmt.name != "mxfp4":
        raise Refusal(f"{t.fmt.name} weights: GGUF's microscaling block type is MXFP4 (use --gguf-type F32)")
    out, n = t.shape
    if n % _BLOCK:
        raise Refusal(f"an input width that is not a multiple of {_BLOCK} (GGUF blocks)", fixable=False)
    codes = unpack_fp4(t.elements).numpy().reshape(out, n // _BLOCK, _BLOCK)
    qs = codes[..., : _BLOCK // 2] | (codes[..., _BLOCK // 2 :] << 4)
    e = t.scales.numpy().reshape(out, n // _BLOCK, 1)
    return np.concatenate([e, qs], axis=-1).astype(np.uint8).reshape(out, -1)
