"""SQ-format activations' scale groups and stored bits (Huang et al., §3.2.2 and §4.1): which
channels share one activation scale -- the whole token, one bank, or ``G`` channels independent of the
bank -- and the bits per activation value that the split and its scales take.  The paper does not
print its activation scale granularity; its Table 2 (dynamic perplexity worsens as the bank grows at
fixed sparsity) fits per-bank scales."""

from __future__ import annotations

import torch

from .sq import SQFormat, bank_topk_mask, measured_bits, pack_sq, sq_quantize

__all__ = ["ACT_SCALES", "act_scale_bits", "act_scale_group", "act_storage_bits"]

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


def act_storage_bits(
    fmt: SQFormat,
    K: int,
    strategy: str,
    tokens: int = 2048,
    scale: str = "token",
    group: int | None = None,
    calibrated: bool = False,
) -> float:
    """Stored bits per activation value of ``tokens`` rows of width ``K`` (scales included).

    ``dynamic``: the Fig. 1 layout built from an actual split (full-shape low tensor carrying
    ``v_mask``, compact high values, one fp16 scale per part, token and scale group).  ``static``:
    the two reordered dense parts (``s K`` low and ``(1 - s) K`` high values per token), two fp16
    scales per token and scale group (:func:`act_scale_bits`; per linear when ``calibrated``), plus
    the 1-bit channel mask per linear, amortised over ``tokens``.  The scale group is
    :func:`act_scale_group` of ``scale``/``group``.
    """
    g = act_scale_group(fmt, K, scale, group)
    if strategy == "dynamic":
        if calibrated:
            raise ValueError("calibrated activation scales need a static mask")
        x = torch.randn(tokens, K, generator=torch.Generator().manual_seed(0))
        m = bank_topk_mask(x.abs(), fmt)
        return measured_bits(pack_sq(sq_quantize(x, m, fmt, group=g)), tokens * K)
    if strategy != "static":
        raise ValueError(f"strategy must be dynamic or static, got {strategy!r}")
    kh = fmt.high_count(K)
    values = (K - kh) * fmt.h_low + kh * fmt.h_high
    return (values + K / tokens) / K + act_scale_bits(K, g, calibrated, tokens)
