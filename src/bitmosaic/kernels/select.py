"""Which kernel a quantized module kind builds: one selector over the kernels' declared capabilities.

Every kernel class declares what it runs (the GPTQModel style)::

    KERNEL_NAME                   "lowbit" (LowBitWeight), "lut" (BitPlaneWeight), "int8act"
                                  (IntActWeight: integer activations, modules/intact.py), "triton_int"
                                  (TritonIntWeight: the GPU dequant GEMM/GEMV, kernels/triton/, issue 76),
                                  "triton_bitplane" (TritonBitPlaneWeight: SFMP's bit-plane GEMV),
                                  "triton_blockres" (MosaicQuant's fused base + residual blocks),
                                  "triton_sq" (SQ-format's static split GEMM), "fp4_lut" (FP4LutWeight:
                                  the MXFP4/NVFP4 LUT GEMV, issue 75) or "mx_tiles" (MXTiledWeight: the
                                  microscaling reference tiles)
    SUPPORTS_BITS                 code widths it runs (per block, any mix when SUPPORTS_MIXED_BITS)
    SUPPORTS_DEVICES              devices its weights live on (``supported_devices()``, when declared, says
                                  where it runs *here*: the Triton kernels need Triton, see kernel_devices)
    SUPPORTS_GROUP_SIZE_MULTIPLE  group sizes it takes are multiples of this (1: any; -1 = one per row)
    SUPPORTS_ROWS                 (lo, hi) rows of x it is fast for (hi None: any)
    FAST_BITS                     widths at which it is the measured choice
    FAST_GROUP_SIZE_MULTIPLE      group sizes it is fast for are multiples of this (optional, default 1;
                                  LowBitWeight 64: smaller groups slow its span loop)
    NEEDS_COMPILED                fast only with its compiled extension (``compiled()``)

and every module kind lists, in order of preference, the kernels that can run it (a ``KERNELS`` class
attribute: packed kinds ``("triton_int", "lut", "lowbit")``, mosaic ``("lowbit",)``, SFMP
``("triton_bitplane", "lut")``, microscaling ``("fp4_lut", "mx_tiles")``; off the CPU a kind's
``GPU_KERNELS``: mosaic ``("triton_blockres",)``, SQ activations ``("triton_sq",)``, SFMP
``("triton_bitplane",)``).
:func:`select_kernel` takes the first listed kernel that runs the request and is fast for it, else the
first that runs it.  A kind's integer-activation kernels are listed apart (``INT_ACT_KERNELS``:
``("int8act",)`` for the plain packed kind) and checked with :func:`runs` the same way.  So by
default the packed kinds run the Triton kernel on CUDA and, on the CPU, the bit-plane LUT at 1-3 bits
and at any width in groups smaller than 64 (or not a multiple of it), LowBitWeight from 4 bits in
groups of 64, 128, ... or one per row (and everywhere without the compiled LUT), mosaic LowBitWeight, SFMP the
Triton bit-plane GEMV on CUDA and the LUT on the CPU, and MXFP4/NVFP4 the FP4 LUT GEMV on the CPU (the
reference tiles without its extension, and for the FP8 formats).

One override, for benchmarking: ``$BITMOSAIC_KERNEL=lut|lowbit`` picks that kernel for every kind that
lists it and can run the request (``auto`` or unset: the selection above).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from .fp4lut import FP4LutWeight, MXTiledWeight
from .intmm import IntActWeight
from .lut import BitPlaneWeight
from .qmatmul import LowBitWeight
from .triton.bitplane import TritonBitPlaneWeight
from .triton.blockres import TritonBlockResidualWeight
from .triton.intmm import TritonIntWeight
from .triton.sqsplit import TritonSQSplitWeight

__all__ = ["KERNEL_ENV", "KERNELS", "select_kernel", "runs", "is_fast", "kernel_devices", "offers_device"]

KERNEL_ENV = "BITMOSAIC_KERNEL"
KERNELS: dict[str, type] = {
    k.KERNEL_NAME: k
    for k in (
        LowBitWeight,
        BitPlaneWeight,
        IntActWeight,
        TritonIntWeight,
        TritonBitPlaneWeight,
        TritonBlockResidualWeight,
        TritonSQSplitWeight,
        FP4LutWeight,
        MXTiledWeight,
    )
}


def kernel_devices(kernel: type) -> tuple[str, ...]:
    """The device types ``kernel`` runs on here: its ``supported_devices()`` when it has one (the Triton
    kernels: CUDA when Triton is importable, none without it), else its ``SUPPORTS_DEVICES``."""
    probe = getattr(kernel, "supported_devices", None)
    return tuple(probe()) if probe is not None else tuple(kernel.SUPPORTS_DEVICES)


def offers_device(candidates: Sequence[str], device: str) -> bool:
    """Whether any of ``candidates`` (``KERNELS`` names) runs on ``device`` here."""
    kind = torch.device(device).type
    return any(c in KERNELS and kind in kernel_devices(KERNELS[c]) for c in candidates)


def _widths(bits) -> set[int]:
    if torch.is_tensor(bits):
        return {int(b) for b in bits.unique().tolist()} if bits.numel() else set()
    return {int(bits)}


def runs(kernel: type, bits, device: str = "cpu", group_size: int | None = None) -> bool:
    """Whether ``kernel`` can run weights of these ``bits`` (an int, or a per-block map) on ``device``."""
    widths = _widths(bits)
    if len(widths) > 1 and not kernel.SUPPORTS_MIXED_BITS:
        return False
    if not widths <= set(kernel.SUPPORTS_BITS):
        return False
    if torch.device(device).type not in kernel_devices(kernel):
        return False
    mult = kernel.SUPPORTS_GROUP_SIZE_MULTIPLE
    return group_size is None or group_size < 0 or mult <= 1 or group_size % mult == 0


def is_fast(kernel: type, bits, rows: int = 1, group_size: int | None = None) -> bool:
    """Whether ``kernel`` is the measured choice for these ``bits`` at ``rows`` rows of x here (and this
    ``group_size``: ``None`` or ``< 0``, one group per row, passes)."""
    lo, hi = kernel.SUPPORTS_ROWS
    if rows < lo or (hi is not None and rows > hi):
        return False
    if not _widths(bits) <= set(kernel.FAST_BITS):
        return False
    mult = getattr(kernel, "FAST_GROUP_SIZE_MULTIPLE", 1)
    if group_size is not None and group_size > 0 and mult > 1 and group_size % mult:
        return False
    return not kernel.NEEDS_COMPILED or kernel.compiled()


def select_kernel(
    candidates: Sequence[str],
    bits,
    *,
    rows: int = 1,
    device: str = "cpu",
    group_size: int | None = None,
) -> type:
    """The kernel class a module kind with these ``candidates`` (``KERNELS`` names, preferred first)
    builds for ``bits`` (an int or a per-block map), ``rows`` rows of x (1: decode) on ``device``:
    ``$BITMOSAIC_KERNEL`` if set and among the runnable candidates, else the first runnable candidate
    that is fast for the request, else the first runnable one that has its compiled extension (where it
    needs one), else the first runnable one."""
    unknown = [c for c in candidates if c not in KERNELS]
    if unknown:
        raise ValueError(f"unknown kernel(s) {unknown}; the kernels are {', '.join(KERNELS)}")
    runnable = [KERNELS[c] for c in candidates if runs(KERNELS[c], bits, device, group_size)]
    if not runnable:
        raise ValueError(
            f"none of the kernels {list(candidates)} runs {sorted(_widths(bits))}-bit weights on {device} "
            f"(group size {group_size})"
        )
    forced = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if forced != "auto":
        if forced not in KERNELS:
            raise ValueError(f"${KERNEL_ENV}={forced!r} is not one of auto, {', '.join(KERNELS)}")
        for k in runnable:
            if k.KERNEL_NAME == forced:
                return k
    for k in runnable:
        if is_fast(k, bits, rows, group_size):
            return k
    # none is the measured choice: the first that does not need a missing compiled extension
    return next((k for k in runnable if not k.NEEDS_COMPILED or k.compiled()), runnable[0])
