"""Checkpoints stored in FP8 with block scales, read as the float weights they stand for.

DeepSeek-V3/R1, Qwen3-*-FP8 (Qwen3-30B-A3B-FP8, Qwen3-235B-A22B-FP8) and other releases ship their linear
weights as ``float8_e4m3fn`` with one float32 scale per ``[128, 128]`` block, stored beside the weight as
``<name>_scale_inv`` ``[ceil(out/128), ceil(in/128)]`` (the name is historical: the stored value is the
*multiplier*, ``w = q * s``, as DeepSeek's own ``weight_dequant`` and transformers' FP8 integration
compute it), and say so in ``config.json``: ``quantization_config = {"quant_method": "fp8",
"weight_block_size": [128, 128], ...}``; embeddings, norms, routers and the head stay bf16.  These are
the checkpoints users quantize further (to 4 bits for llama.cpp or vLLM), and at half the bytes of bf16 they
are what fits on one disk (Qwen3-30B-A3B: 31 GB against 61 GB).

bitmosaic reads them as float: each FP8 value times its block's scale, computed in float32 (one rounding:
the 4-bit significand of an E4M3 value times a float32 scale needs up to 28 bits) and then cast to the
run's dtype -- the same float weights transformers' ``FineGrainedFP8Config(dequantize=True)`` gives, which
is what the in-memory load uses (:func:`bitmosaic.io.sources.loading._model_class`).  Streaming
(:class:`~bitmosaic.io.sources.checkpoint.Checkpoint`) dequantizes one tensor at a time
(:func:`dequantize`), so an FP8 checkpoint streams in its own size.  Other FP8 layouts (a per-tensor or
per-channel ``weight_scale``, compressed-tensors' ``float-quantized``) are refused in one line.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ...errors import CorruptModelError, ModelSpecError
from ...formats.mx import block_amax, expand_blocks, get_mx_format

__all__ = ["FP8_DTYPES", "block_size", "dequantize", "quantize"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"


def block_size(folder: Path) -> tuple[int, int] | None:
    """The ``[rows, cols]`` block of an FP8 block-scaled checkpoint folder (its ``config.json`` says
    ``quant_method: fp8``), else ``None``; a one-line refusal for an FP8 config without block scales."""
    cfg = Path(folder) / "config.json"
    try:
        qc = json.loads(cfg.read_text(encoding="utf-8")).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        return None
    block = qc.get("weight_block_size")
    ok = isinstance(block, list | tuple) and len(block) == 2
    if not (ok and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelSpecError(
            f"{cfg}: an FP8 checkpoint without weight_block_size [rows, cols] (per-tensor or per-channel "
            "FP8) is not read by bitmosaic; load it with transformers and save it in bf16 first"
        )
    return int(block[0]), int(block[1])


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype, name: str
) -> torch.Tensor:
    """``q * scale`` per ``block`` of a 2-D FP8 tensor ``q`` (``scale``: ``[ceil(rows/br), ceil(cols/bc)]``),
    in float32, cast to ``dtype`` (default float32).  ``name`` names the tensor in a one-line error."""
    if q.ndim != 2 or scale.ndim != 2:
        raise CorruptModelError(
            f"FP8 tensor {name} has shape {tuple(q.shape)} and scales {tuple(scale.shape)}: block scales "
            "are read for 2-D weights only; re-download the checkpoint"
        )
    br, bc = block
    rows, cols = q.shape
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale.shape) != want:
        raise CorruptModelError(
            f"FP8 tensor {name} of shape {(rows, cols)} has scales {tuple(scale.shape)} where blocks of "
            f"{block} need {want}; the checkpoint does not match its config's weight_block_size"
        )
    out = q.float().mul_(expand_blocks(scale.float(), _format(block), (rows, cols)))
    return out if dtype in (None, torch.float32) else out.to(dtype)


def quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse used to write such checkpoints (benchmarks, tests): per block ``s = amax / 448``
    (E4M3's largest finite value; 1 for an all-zero block) and ``q = e4m3(w / s)`` -> ``(q, s)``."""
    fmt = _format(block)
    s = block_amax(w, fmt) / torch.finfo(torch.float8_e4m3fn).max
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (w.float() / expand_blocks(s, fmt, tuple(w.shape))).to(torch.float8_e4m3fn)
    return q, s


def _format(block: tuple[int, int]):
    """formats/mx.py's FP8 block format with the checkpoint's ``[rows, cols]`` block."""
    return dataclasses.replace(get_mx_format("fp8-block"), block_rows=block[0], block=block[1])
