"""Exact bits-per-weight accounting, from the real buffers or analytically.

``bits_per_weight`` counts what is actually stored: ``numel * element_size * 8`` summed over
every buffer of a quantized layer (packed codes, scales, zeros, ``g_idx``...), divided by the
number of weights it represents.  ``nominal_bits_per_weight`` is the same count derived from the
format alone, so that a layer's reported bit rate can be checked against its buffers:

* codes: ``out * ceil(in / 8) * 8 * bits`` -- each row is padded to a multiple of 8 codes, exactly
  as :func:`bitmosaic.formats.packing.pack_codes` stores it (3-bit codes are dense);
* one scale per row and group (``num_groups`` counts a partial last group as a group), plus one
  zero per row and group on an asymmetric grid (a symmetric grid's zero is implied, not stored);
* optionally a ``g_idx`` of ``in`` entries (act-order layouts), ``g_idx_bits`` each.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from .layout import num_groups

__all__ = ["storage_bits", "bits_per_weight", "nominal_bits_per_weight"]


def storage_bits(tensors: Iterable[torch.Tensor | None] | Mapping[str, torch.Tensor | None]) -> int:
    """Total stored bits of ``tensors`` (an iterable, a dict's values, or one tensor); ``None`` skipped."""
    if torch.is_tensor(tensors):
        tensors = [tensors]
    elif isinstance(tensors, Mapping):
        tensors = tensors.values()
    total = 0
    for t in tensors:
        if t is None:
            continue
        if not torch.is_tensor(t):
            raise TypeError(f"storage_bits expects tensors (or None), got {type(t).__name__}")
        total += t.numel() * t.element_size() * 8
    return total


def bits_per_weight(
    tensors: Iterable[torch.Tensor | None] | Mapping[str, torch.Tensor | None], n_weights: int
) -> float:
    """``storage_bits(tensors) / n_weights``."""
    if n_weights <= 0:
        raise ValueError(f"n_weights must be positive, got {n_weights}")
    return storage_bits(tensors) / n_weights


def nominal_bits_per_weight(
    bits: int,
    in_features: int,
    out_features: int,
    group_size: int | None,
    symmetric: bool,
    scale_bits: int = 16,
    zero_bits: int = 16,
    g_idx_bits: int = 0,
) -> float:
    """Analytic bits per weight of a packed ``[out_features, in_features]`` layer (see module doc)."""
    if in_features <= 0 or out_features <= 0:
        raise ValueError(f"in_features and out_features must be positive, got {in_features}, {out_features}")
    n_groups = num_groups(in_features, group_size)
    code_bits = out_features * (-(-in_features // 8) * 8) * bits
    scale_total = out_features * n_groups * scale_bits
    zero_total = 0 if symmetric else out_features * n_groups * zero_bits
    g_idx_total = in_features * g_idx_bits
    return (code_bits + scale_total + zero_total + g_idx_total) / (out_features * in_features)
