"""Minifloat grids: FP8 E4M3 (OCP ``±448`` and the IEEE-style ``±240`` variant), FP8 E5M2 and FP4 E2M1.

:func:`fp_round` maps values onto a grid with round-to-nearest-even and saturation at the largest
finite value (``x`` is clamped to ``±max`` first, so nothing becomes NaN or inf).  Where torch has
the storage dtype, the rounding *is* torch's cast (``float8_e4m3fn``, ``float8_e5m2``); the
``±240`` E4M3 of Intel Gaudi 2 (DPQ paper §4.1: IEEE-style, the top exponent reserved) has the
same bias and subnormals as ``float8_e4m3fn`` and only a smaller range, so it is the same cast
after clamping to ±240.  (It is *not* torch's ``float8_e4m3fnuz``, whose bias is 8.)  E2M1 has no
portable torch cast, and torch casts float64 via float32 (a double rounding), so those are
rounded arithmetically.  Tests compare every grid against an
independent enumeration of its bit patterns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FloatFormat", "FP_FORMATS", "get_float_format", "fp_round"]


@dataclass(frozen=True)
class FloatFormat:
    """Sign + ``exp_bits`` + ``man_bits`` minifloat, exponent ``bias``, largest value ``max_value``."""

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    max_value: float
    torch_dtype: str | None = None  # a torch dtype whose cast is this grid's rounding

    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    @property
    def min_normal_exp(self) -> int:
        return 1 - self.bias

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.min_normal_exp - self.man_bits)

    def cast_dtype(self) -> torch.dtype | None:
        return getattr(torch, self.torch_dtype, None) if self.torch_dtype else None


FP_FORMATS: dict[str, FloatFormat] = {
    "e4m3": FloatFormat("e4m3", 4, 3, 7, 448.0, "float8_e4m3fn"),
    "e4m3-240": FloatFormat("e4m3-240", 4, 3, 7, 240.0, "float8_e4m3fn"),
    "e5m2": FloatFormat("e5m2", 5, 2, 15, 57344.0, "float8_e5m2"),
    "e2m1": FloatFormat("e2m1", 2, 1, 1, 6.0, None),
}


def get_float_format(name: str | FloatFormat) -> FloatFormat:
    if isinstance(name, FloatFormat):
        return name
    try:
        return FP_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown float format {name!r}; known: {', '.join(FP_FORMATS)}") from None


def fp_round(x: torch.Tensor, fmt: str | FloatFormat) -> torch.Tensor:
    """Round ``x`` to the nearest value of ``fmt`` (ties to even), saturating at ``±max_value``.

    Returns a tensor of ``x``'s dtype (float32 or wider recommended) holding grid values.
    """
    f = get_float_format(fmt)
    dt = f.cast_dtype()
    if dt is not None and x.dtype != torch.float64:
        return x.float().clamp(-f.max_value, f.max_value).to(dt).to(x.dtype)
    # Arithmetic rounding (float64 inputs round once, not via float32; formats without a dtype).
    xf = x if x.dtype == torch.float64 else x.float()
    xf = xf.clamp(-f.max_value, f.max_value)
    a = xf.abs()
    _, e = torch.frexp(a)  # a = m 2^e, m in [0.5, 1): floor(log2 a) = e - 1 exactly
    e = (e - 1).clamp(min=f.min_normal_exp).to(xf.dtype)
    step = torch.exp2(e - f.man_bits)
    r = (torch.round(a / step) * step).clamp(max=f.max_value)  # torch.round: half to even
    return (torch.sign(xf) * r).to(x.dtype)
