"""Integer activation compute: which layers run ``Q(x) Wᵀ`` in integers, and the kernel weight that does it.

A quantized module with an INT activation quantizer (``input_quant``, :mod:`.actquant`) runs its
forward in one of two ways:

* **integer** (the default where it can): the input is *not* fake-quantized by the pre-hook; the
  module's :class:`IntActKernel` quantizes it to int8 with the quantizer's own scales
  (:func:`bitmosaic.formats.act.act_scales`) and multiplies the integers
  (:class:`bitmosaic.kernels.intmm.IntActWeight`: AVX-512 VNNI / AVX2 / portable, int32 sums per weight
  group).  Same integers as the simulated path; outputs equal up to float32 rounding.
* **simulated**: the pre-hook replaces the input by ``Q(x) = q s`` in float and the weight-only
  kernel multiplies it in float32.  Always the case for FP8/FP4 activations (DPQ's FP8 compute: this CPU
  has no FP8 instruction), for kinds without an integer path (``INT_ACT_KERNELS`` empty: SSQR's CSR
  outliers, DPQ, MosaicQuant, the SQ-format activations, SFMP, Huffman, FP8 weights), for group sizes
  that are not multiples of 8, activation groups that do not hold whole weight groups, off the CPU,
  and under ``$BITMOSAIC_ACT_COMPUTE=sim`` (for comparison).

:func:`int_act_blocker` says which, and why; ``bitmosaic inspect --layers`` prints it per layer.
"""

from __future__ import annotations

import os

import torch

from ..formats.act import ActQuantSpec, act_scales
from ..kernels.intmm import MAX_K, IntActWeight, vnni
from ..kernels.isa import kernel_isa
from ..kernels.select import KERNELS, runs

__all__ = ["ACT_COMPUTE_ENV", "act_compute_mode", "int_act_blocker", "IntActKernel", "act_path_label"]

ACT_COMPUTE_ENV = "BITMOSAIC_ACT_COMPUTE"
_MODES = ("auto", "sim")


def act_compute_mode() -> str:
    """``$BITMOSAIC_ACT_COMPUTE``: ``auto`` (unset: integer wherever it runs) or ``sim`` (simulated)."""
    mode = os.environ.get(ACT_COMPUTE_ENV, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(
            f"${ACT_COMPUTE_ENV}={mode!r} is not one of {', '.join(_MODES)}; unset it or pick one"
        )
    return mode


def int_act_blocker(
    kernels: tuple[str, ...],
    spec: ActQuantSpec | None,
    bits: int,
    group_size: int,
    in_features: int,
    permuted: bool,
) -> str | None:
    """``None`` when a layer (its kind's ``INT_ACT_KERNELS``, activation ``spec``, weight code width
    ``bits``, ``group_size``, ``in_features``, act-order ``permuted`` columns) runs the integer path on
    this machine, else why not (a short phrase)."""
    if spec is None:
        return "no activation quantizer"
    if spec.fmt != "int":
        return f"{spec.fmt} activations: no CPU instruction"
    if not kernels:
        return "no integer path for this kind"
    kernel = KERNELS[kernels[0]]
    gs = in_features if group_size is None or group_size < 0 or group_size >= in_features else group_size
    per_row = gs >= in_features
    if not runs(kernel, bits, "cpu", None if per_row else gs):
        return f"group size {gs} is not a multiple of {kernel.SUPPORTS_GROUP_SIZE_MULTIPLE}"
    if in_features >= MAX_K:
        return f"{in_features} input columns (the int32 sums hold fewer than {MAX_K})"
    if spec.granularity == "group" and spec.group_size < in_features:
        if per_row or spec.group_size % gs:
            return f"activation groups of {spec.group_size} do not hold whole weight groups of {gs}"
        if permuted:
            return "act-order columns with per-group activation scales"
    return None


def act_path_label(blocker: str | None, spec: ActQuantSpec | None) -> str:
    """What ``inspect`` prints for a layer: ``int8 (avx512-vnni)``, ``simulated (<why>)``, ``weight-only``."""
    if spec is None:
        return "weight-only"
    if blocker is not None:
        return f"simulated ({blocker})"
    if act_compute_mode() == "sim":
        return f"simulated (${ACT_COMPUTE_ENV}=sim)"
    if not IntActWeight.compiled():
        return f"int{spec.bits} (torch._int_mm)"
    isa = kernel_isa()
    isa = "avx512-vnni" if isa == "avx512" and vnni() else isa
    return f"int{spec.bits} ({isa})"


def _scale_table(s: torch.Tensor, spec: ActQuantSpec) -> torch.Tensor:
    """:func:`act_scales`' result as ``[1 or M, Ga]`` (what the kernel takes)."""
    if spec.granularity == "tensor" or (spec.static and spec.granularity == "group"):
        return s.reshape(1, -1)
    return s.reshape(-1, s.shape[-1])


class IntActKernel:
    """``x -> Q(x) Wᵀ`` in integers for one layer: an :class:`IntActWeight` and the act-order
    permutation of its columns (``None``: natural order)."""

    def __init__(self, weight: IntActWeight, perm: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.perm = perm

    def __call__(self, x: torch.Tensor, quantizer) -> torch.Tensor:
        spec, K = quantizer.spec, self.weight.K
        x2 = x.reshape(-1, K).float()
        s = None  # per-token dynamic: the kernel computes scale_from_amax itself (same float32 operations)
        if spec.granularity != "token" or spec.pow2:
            s = _scale_table(act_scales(x2, spec, quantizer.scale), spec)  # the simulated path's scales
        if self.perm is not None:  # per-token / per-tensor scales do not depend on the column order
            x2 = x2.index_select(-1, self.perm)
        group = spec.group_size if spec.granularity == "group" else K
        y = self.weight.matmul(x2, s, group, spec.qmax)
        return y.reshape(*x.shape[:-1], self.weight.N).to(x.dtype)

    def nbytes(self) -> int:
        perm = 0 if self.perm is None else self.perm.numel() * self.perm.element_size()
        return self.weight.nbytes() + perm
