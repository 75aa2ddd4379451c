"""SQ-format activations' scale groups and stored bits (Huang et al., §3.2.2 and §4.1): which
channels share one activation scale -- the whole token, one bank, or ``G`` channels independent of the
bank -- and the bits per activation value that the split and its scales take.  The paper does not
print its activation scale granularity; its Table 2 (dynamic perplexity worsens as the bank grows at
fixed sparsity) fits per-bank scales.

:func:`act_bits` (issue 73) is the one accounting of an activation layout's bits per value, for SQ
splits and for plain INT/FP activations alike, so that rows compare at equal activation bits: the
paper's ``y`` (or the INT width), the fp16 scales and the mask, each from the layout itself."""

from __future__ import annotations

from dataclasses import dataclass

from .act import ActQuantSpec
from .sq import SQFormat, pos_bits

__all__ = [
    "ACT_SCALES",
    "ActBits",
    "SQActLayout",
    "act_bits",
    "act_scale_bits",
    "act_scale_group",
    "act_storage_bits",
]

ACT_SCALES = ("token", "bank", "group")  # activation scale groups: a token, a bank, G channels


def act_scale_group(fmt: SQFormat, K: int, scale: str, group: int | None = None) -> int:
    """Channels that share one activation scale (per part): ``K`` for ``"token"``, ``b`` for
    ``"bank"``, ``group`` for ``"group"`` (any positive width, independent of the bank; a partial
    last group is used when it does not divide ``K``)."""
    if scale == "token":
        return K
    if scale == "bank":
        return fmt.bank
    if scale == "group":
        if group is None or int(group) < 1:
            raise ValueError(f"SQ activation scale 'group' needs a positive group width, got {group!r}")
        return min(int(group), K)
    raise ValueError(f"SQ activation scale must be one of {ACT_SCALES}, got {scale!r}")


def act_scale_bits(K: int, group: int, calibrated: bool = False, tokens: int = 2048) -> float:
    """Bits per activation value spent on scales: two fp16 scales (low, high) per scale group of
    ``group`` channels, per token -- or, ``calibrated``, once per linear (amortised over ``tokens``)."""
    per_row = 2 * 16 * -(-K // group)
    return per_row / (K * tokens) if calibrated else per_row / K


@dataclass(frozen=True)
class SQActLayout:
    """How one linear's input is split into SQ-format (Algorithm 2): ``strategy`` dynamic | static,
    scales per ``scale`` group (token | bank | ``group`` channels), ``calibrated`` static scales."""

    fmt: SQFormat
    strategy: str
    scale: str = "token"
    group: int | None = None
    calibrated: bool = False


@dataclass(frozen=True)
class ActBits:
    """Bits per activation value of one linear's input, by what they pay for: ``values`` (the
    paper's ``y = (1 - s) h_high + s h_low`` of §4.1, or the INT/FP width), ``scales`` (the fp16
    scales), ``mask`` (where the high values sit)."""

    values: float
    scales: float
    mask: float

    @property
    def total(self) -> float:
        """Everything the layout holds per value: the activation bits rows are compared at."""
        return self.values + self.scales + self.mask

    @property
    def with_scales(self) -> float:
        """The paper's accounting (``y``, or the INT width) with the scales counted, no mask."""
        return self.values + self.scales


def act_bits(K: int, layout: ActQuantSpec | SQActLayout | None, tokens: int = 2048) -> ActBits:
    """Bits per activation value of ``tokens`` rows of width ``K`` in ``layout`` (``None``: 16-bit).

    INT/FP (:class:`~bitmosaic.formats.act.ActQuantSpec`): the width, plus one fp16 scale (8 bits
    when ``pow2``) per token and group (``K`` channels per token; a static or per-tensor scale once
    per linear, spread over the ``tokens``); symmetric grids, no zero-point.  Microscaled: an 8-bit
    (E8M0/E4M3) scale per block and token, plus NVFP4's FP32 tensor scale once per linear.  SQ
    (:class:`SQActLayout`): ``y``; two fp16 scales (low, high) per token and scale group
    (:func:`act_scale_bits`); the mask -- static: one bit per channel per linear over ``tokens``;
    dynamic: the Fig. 1 layout's low tensor keeps every place, so each high value also holds an
    ``h_low``-bit ``v_mask`` (``h_low = 0``: an in-bank position).
    """
    if layout is None:
        return ActBits(16.0, 0.0, 0.0)
    if isinstance(layout, ActQuantSpec) and layout.mx is not None:  # 8-bit block scales, NVFP4's FP32 one
        g = layout.group_size
        tensor = 32 / K / tokens if layout.mx == "nvfp4" else 0.0
        return ActBits(float(layout.bits), 8 * -(-K // g) / K + tensor, 0.0)
    if isinstance(layout, ActQuantSpec):
        g = min(layout.group_size, K) if layout.granularity == "group" else K
        per_linear = layout.static or layout.granularity == "tensor"
        sbits = 8 if layout.pow2 else 16  # a power-of-two scale is an exponent (MX's E8M0)
        scales = sbits * -(-K // g) / K / (tokens if per_linear else 1)
        return ActBits(float(layout.bits), scales, 0.0)
    fmt = layout.fmt
    g = act_scale_group(fmt, K, layout.scale, layout.group)
    if layout.strategy == "dynamic":
        if layout.calibrated:
            raise ValueError("calibrated activation scales need a static mask")
        mask = fmt.high_count(K) * (fmt.h_low or pos_bits(fmt)) / K
    elif layout.strategy == "static":
        mask = 1 / tokens
    else:
        raise ValueError(f"strategy must be dynamic or static, got {layout.strategy!r}")
    kh = fmt.high_count(K)
    values = ((K - kh) * fmt.h_low + kh * fmt.h_high) / K
    return ActBits(values, act_scale_bits(K, g, layout.calibrated, tokens), mask)


def act_storage_bits(
    fmt: SQFormat,
    K: int,
    strategy: str,
    tokens: int = 2048,
    scale: str = "token",
    group: int | None = None,
    calibrated: bool = False,
) -> float:
    """Stored bits per activation value of ``tokens`` rows of width ``K`` (scales included):
    ``act_bits(K, SQActLayout(...), tokens).total``.  ``dynamic``: the Fig. 1 layout (full-shape low
    tensor carrying ``v_mask``, compact high values, one fp16 scale per part, token and scale group);
    ``static``: the two reordered dense parts, their scales (per linear when ``calibrated``) and the
    1-bit channel mask per linear, amortised over ``tokens``."""
    return act_bits(K, SQActLayout(fmt, strategy, scale, group, calibrated), tokens).total
