"""Run-time 8-bit output head: the logits of a decoded token from an INT8 copy of the head, as llama.cpp does.

At decode, a model's output head (``lm_head``, often tied to the embeddings) is the largest matrix it
reads per token: SmolLM2-135M's is ``49152 x 576`` float32, 113 MB, about a third of bitmosaic's
per-token time before this (``benchmarks/decode/decode.py``).  llama.cpp reads it at 8 bits (SmolLM2's GGUF
stores ``token_embd`` as ``Q8_0``: symmetric int8 in blocks of 32 with one scale each).

Two run-time heads (:func:`set_runtime_head`), both with the weight in that format -- per row, blocks of
``HEAD_GROUP = 32`` input columns, ``s = max|w| / 127``, ``q = round(w / s)`` in ``[-127, 127]``
(llama.cpp's ``quantize_row_q8_0``, with a float32 scale):

* ``int8``: weight-only; the low-bit kernel (:class:`~bitmosaic.kernels.qmatmul.LowBitWeight` at 8
  bits, codes ``q + 128`` with zero-point 128) multiplies the float activations (from
  ``HEAD_GEMM_ROWS`` rows on, prefill and evaluation windows, torch's GEMM over the same weights
  dequantized a chunk of rows at a time: faster there).  Its error per weight
  is at most ``s / 2 = max|w| / 254`` of its block; on a model whose head came from a ``Q8_0`` block
  (SmolLM2's GGUF) the codes are the file's own and the logits equal the float head's up to float32
  rounding.
* ``q8_0``: what llama.cpp computes (``ggml_vec_dot_q8_0_q8_0``): the activations too are quantized to
  int8 per block of 32 (dynamic, symmetric, ``max|x| / 127``) and the integer kernel
  (:class:`~bitmosaic.kernels.intmm.IntActWeight`, AVX-512 VNNI / AVX2) multiplies integers: about 3x
  faster than ``int8`` on one thread here, with the activations' rounding added.

Like run-time activations (:mod:`.intact`) they are approximations chosen at run time for speed: off by
default, not saved (the head's float weight, its tie to the embeddings and the state dict are
unchanged; off the CPU, or when the head's weight needs a gradient, the float head runs),
``bitmosaic eval --runtime-head int8|q8_0`` or ``$BITMOSAIC_RUNTIME_HEAD`` at load.  One exception, where
``int8`` is no approximation: a head whose float weights *are* their int8 copy bit for bit (stored as
``Q8_0`` and dequantized, as SmolLM2's) gets ``int8`` at load by default (:func:`default_runtime_head`;
``$BITMOSAIC_RUNTIME_HEAD=none`` keeps the float head): the same weights, a quarter of the bytes.
Their KL and top-1 agreement against the float head are measured on SmolLM2 (README, "An 8-bit output
head").
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from ..formats.act import ActQuantSpec
from ..formats.grid import dequantize_codes, quantize_codes
from ..kernels.intmm import IntActWeight
from .intact import runtime_choice
from .kernel import lowbit_from_codes

__all__ = [
    "HEAD_GEMM_ROWS",
    "HEAD_GROUP",
    "RUNTIME_HEAD_ENV",
    "default_runtime_head",
    "int8_head_is_exact",
    "RUNTIME_HEADS",
    "int8_head_codes",
    "runtime_head",
    "runtime_head_mode",
    "set_runtime_head",
]

RUNTIME_HEAD_ENV = "BITMOSAIC_RUNTIME_HEAD"
RUNTIME_HEADS = ("none", "int8", "q8_0")
HEAD_GROUP = 32  # llama.cpp's Q8_0 block
_QMAX = 127


def runtime_head_mode(mode: str | None = None) -> str:
    """``mode`` (``none``/``int8``/``q8_0``), or ``$BITMOSAIC_RUNTIME_HEAD`` when ``mode`` is ``None``
    (unset: ``none``); anything else raises :class:`~bitmosaic.errors.OptionError` naming the choices."""
    return runtime_choice(mode, RUNTIME_HEAD_ENV, "--runtime-head", RUNTIME_HEADS)


def int8_head_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes uint8 [N, K] = q + 128, scales float32 [N, ceil(K / 32)])`` of ``weight [N, K]``
    (module doc: symmetric int8 per block of 32 columns; an all-zero block gets scale 1)."""
    w = weight.detach().float()
    N, K = w.shape
    G = -(-K // HEAD_GROUP)
    padded = F.pad(w.abs(), (0, G * HEAD_GROUP - K)).view(N, G, HEAD_GROUP)
    s = padded.amax(-1) / _QMAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    full = s.repeat_interleave(HEAD_GROUP, dim=1)[:, :K]
    q = quantize_codes(w, full, torch.tensor(128.0), 2 * _QMAX + 1)
    return q.to(torch.uint8), s


_EXACT_ROWS = 4096  # rows of the head checked at a time by int8_head_is_exact (bounds its memory)


def _linear_head(model: nn.Module) -> nn.Linear | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if isinstance(head, nn.Linear) else None


def _exact_int8_codes(head: nn.Linear) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`int8_head_codes` of ``head.weight`` when they give back its weights bit for bit, else
    ``None``: ``_EXACT_ROWS`` rows at a time, stopping at the first chunk that differs."""
    if head.weight.device.type != "cpu" or head.weight.numel() == 0:
        return None
    codes, scales = [], []
    with torch.no_grad():
        for r in range(0, head.out_features, _EXACT_ROWS):
            w = head.weight[r : r + _EXACT_ROWS].float()
            c, s = int8_head_codes(w)
            full = s.repeat_interleave(HEAD_GROUP, dim=1)[:, : w.shape[1]]
            if not torch.equal(dequantize_codes(c.float(), full, 128.0), w):
                return None
            codes.append(c)
            scales.append(s)
    return torch.cat(codes), torch.cat(scales)


def int8_head_is_exact(model: nn.Module) -> bool:
    """Whether ``model``'s output head (a CPU ``nn.Linear``) equals its ``int8`` copy
    (:func:`int8_head_codes`) bit for bit: a head that was stored as ``Q8_0`` (SmolLM2's GGUF) and
    dequantized.  Then the ``int8`` head holds the very same weights in a quarter of the bytes and
    changes no weight, only the float32 order of the sums -- what every load path turns on by default
    (:func:`default_runtime_head`).  Checked ``_EXACT_ROWS`` rows at a time, stopping at the first chunk
    that differs (a head of float weights differs in its first rows)."""
    head = _linear_head(model)
    return head is not None and _exact_int8_codes(head) is not None


def default_runtime_head(model: nn.Module) -> str:
    """What a load path gives ``model``'s head: ``$BITMOSAIC_RUNTIME_HEAD`` when set (``none``, ``int8``,
    ``q8_0``), else ``int8`` where :func:`int8_head_is_exact` (the same weights in a quarter of the bytes:
    on SmolLM2 the head's GEMV takes half the time of the float one, ``docs/cpu-inference.md``), else
    ``none``; applied with :func:`set_runtime_head`.  Returns the mode now on."""
    if os.environ.get(RUNTIME_HEAD_ENV, "").strip():
        set_runtime_head(model)
        return runtime_head(model)
    head = _linear_head(model)
    exact = None if head is None else _exact_int8_codes(head)
    if exact is not None:
        set_runtime_head(model, "int8", _codes=exact)
    return runtime_head(model)


_ACT = ActQuantSpec("int", 8, granularity="group", group_size=HEAD_GROUP)  # q8_0's activation blocks

# From this many rows of ``x`` on, the ``int8`` head multiplies with torch's GEMM over float32 rows of its
# weight dequantized ``_EXACT_ROWS`` at a time (the same int8 weights, a 9 MB buffer at SmolLM2's width):
# the low-bit kernel is made for decode.  On SmolLM2's 49152 x 576 head (Intel Xeon, 2 vCPUs, quiet,
# 2026-12-08, ``benchmarks/results/head_rows.md``; two earlier runs agree at 512 rows): the kernel takes 283
# ms at 2 threads and 385 ms at 1, the head now 212 and 334 ms (the float head 191 and 328 ms); at 256
# rows the two are within the runs' noise; at 128 the kernel is ahead (50 vs 52 ms at 2 threads).
HEAD_GEMM_ROWS = 256


class _Int8HeadForward:
    """The head's ``forward`` while an 8-bit head (``mode``, module doc) is on: an instance attribute of
    the head module."""

    def __init__(self, head: nn.Linear, mode: str, codes=None) -> None:
        codes, scales = int8_head_codes(head.weight) if codes is None else codes
        self.head, self.mode = head, mode
        if mode == "q8_0":
            self.kernel = IntActWeight.from_codes(codes, 8, scales, 128.0, HEAD_GROUP)
        else:
            self.kernel = lowbit_from_codes(codes, 8, scales, 128.0, HEAD_GROUP, None, ("lowbit",))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        head = self.head
        if x.device.type != "cpu" or (torch.is_grad_enabled() and head.weight.requires_grad):
            # the kernels are CPU-only and have no backward: elsewhere, and when training, the float head
            return F.linear(x, head.weight, head.bias)
        x2 = x.reshape(-1, x.shape[-1]).float()
        if self.mode == "q8_0":
            y = self.kernel.matmul(x2, None, HEAD_GROUP, _ACT.qmax)  # per-32 scales: the kernel's own
        elif x2.shape[0] >= HEAD_GEMM_ROWS and not torch.compiler.is_compiling():
            # (a traced forward keeps the kernel: an operator, so a whole graph; the chunked
            # dequantization is not one)
            y = self.gemm(x2)
        else:
            y = self.kernel(x2)
        if head.bias is not None:
            y = y + head.bias.float()
        return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)

    def gemm(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [M, K]`` times the int8 weight (``[N, K]``, ``(q - 128) s``) by torch's GEMM, the weight
        dequantized ``_EXACT_ROWS`` rows at a time: the kernel's product up to float32 order (prefill,
        evaluation windows; ``HEAD_GEMM_ROWS``)."""
        n = self.head.out_features
        y = x2.new_empty(x2.shape[0], n)
        for r in range(0, n, _EXACT_ROWS):
            rows = slice(r, min(n, r + _EXACT_ROWS))
            y[:, rows] = F.linear(x2, self.kernel.dequantize_rows(rows))
        return y


def set_runtime_head(model: nn.Module, mode: str | None = None, *, _codes=None) -> bool:
    """Run ``model``'s output head (``get_output_embeddings()``) at 8 bits on the CPU (``"int8"`` or
    ``"q8_0"``, module doc), or in float again (``"none"``; ``None``: ``$BITMOSAIC_RUNTIME_HEAD``).
    Returns whether an 8-bit head is now on (False too for a model without a linear head).
    ``_codes``: its :func:`int8_head_codes`, when already computed."""
    mode = runtime_head_mode(mode)
    head = _linear_head(model)
    if head is None:
        return False
    from .changes import mark_changed

    head.__dict__.pop("forward", None)  # back to nn.Linear.forward
    mark_changed(model)
    if mode == "none":
        return False
    if mode == "q8_0" and head.in_features % HEAD_GROUP:
        from ..errors import OptionError

        raise OptionError(
            f"--runtime-head q8_0 needs a head width that is a multiple of {HEAD_GROUP}, not "
            f"{head.in_features}; use --runtime-head int8"
        )
    head.forward = _Int8HeadForward(head, mode, _codes)
    return True


def runtime_head(model: nn.Module) -> str:
    """The run-time head ``model``'s output head runs (:func:`set_runtime_head`): ``"none"``, ``"int8"``
    or ``"q8_0"``."""
    fwd = getattr(_linear_head(model), "__dict__", {}).get("forward")
    return fwd.mode if isinstance(fwd, _Int8HeadForward) else "none"
