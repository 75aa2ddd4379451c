"""Uniform integer grids: the INT-k code space and the scale/zero affine map onto it.

Convention (the one GPTQ, AutoGPTQ and GPTQModel use, so codes are interchangeable):
codes are *unsigned* integers ``0 .. 2**bits - 1``; the real value of a code ``q`` is
``(q - zero) * scale``.  A symmetric grid fixes ``zero = 2**(bits-1)`` (so it need not be
stored), an asymmetric grid stores one zero per group.  ``clip=False`` keeps the unbounded
integer ``round(w / scale) + zero`` -- the no-clipping lattice of the Babai paper (§3.1).

Scales are rounded to float16 *before* any code is computed (``fp16_exact``), so that the
weights a quantizer simulates are exactly the ones a packed model reproduces at load time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FP16_MAX", "IntGrid", "quantize_codes", "dequantize_codes", "fp16_exact", "fp16_ceil"]


@dataclass(frozen=True)
class IntGrid:
    """An INT-``bits`` grid, symmetric or asymmetric."""

    bits: int
    symmetric: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be an integer in 2..8, got {self.bits!r}")

    @property
    def maxq(self) -> int:
        """Largest code; codes live in ``[0, maxq]``."""
        return (1 << self.bits) - 1

    @property
    def sym_zero(self) -> int:
        """The fixed zero-point of the symmetric grid."""
        return 1 << (self.bits - 1)

    def __str__(self) -> str:
        return f"int{self.bits}-{'sym' if self.symmetric else 'asym'}"


def fp16_exact(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest float16 value and return it in ``x``'s dtype (storage-exact scales)."""
    return x.to(torch.float16).to(x.dtype)


FP16_MAX = 65504.0


def fp16_ceil(x: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """Smallest float16 value ``>= x`` (in ``x``'s dtype): a stored scale never shrinks the range.

    A finite ``x`` above the largest float16 (65504) has no such value: that is a
    :class:`~bitmosaic.errors.ScaleOverflowError` (the weights are too large for float16 scales),
    never an Inf scale that would silently turn the weights into NaN.  ``check=False`` skips that
    test (one device synchronisation) where the caller knows ``x`` is below a value already
    checked, e.g. the shrunk candidates of an MSE scale search.  The rounding itself never
    synchronises (no data-dependent branch), so on a GPU it is a few queued kernels."""
    if check:
        big = x > FP16_MAX
        if bool(big.any()):
            big &= torch.isfinite(x)
            if bool(big.any()):
                from ..errors import ScaleOverflowError

                raise ScaleOverflowError(
                    f"its weights are too large for float16 scales: a group needs a scale of "
                    f"{float(x[big].max()):.3g}, and float16 holds at most {FP16_MAX:.0f}; rescale the "
                    "checkpoint, or keep this layer in float (a recipe's skip)"
                )
    h = x.to(torch.float16)
    h = torch.where(h.to(x.dtype) < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h)
    return h.to(x.dtype)


def quantize_codes(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int, clip: bool = True
) -> torch.Tensor:
    """``round(w / scale) + zero``, clamped to ``[0, maxq]`` unless ``clip`` is False.

    Returns codes in ``w``'s floating dtype (integral values); the caller casts for storage.
    """
    q = torch.round(w / scale) + zero
    if clip:
        q = q.clamp_(0, maxq)
    return q


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``(codes - zero) * scale`` -- the single dequantization formula used everywhere."""
    return (codes - zero) * scale
