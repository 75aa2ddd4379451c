"""Exact bits-per-weight accounting, from the real buffers.

``bits_per_weight`` counts what is actually stored: ``numel * element_size * 8`` summed over
every buffer of a quantized layer (packed codes, scales, zeros, ``g_idx``...), divided by the
number of weights it represents.  For the packed layout that count is (the tests check it against
a formula written from this definition):

* codes: ``out * ceil(in / 8) * 8 * bits`` -- each row is padded to a multiple of 8 codes, exactly
  as :func:`bitmosaic.formats.packing.pack_codes` stores it (3-bit codes are dense);
* one scale per row and group (``num_groups`` counts a partial last group as a group), plus one
  zero per row and group on an asymmetric grid (a symmetric grid's zero is implied, not stored);
* optionally a ``g_idx`` of ``in`` entries (act-order layouts), ``g_idx_bits`` each.

Microscaling formats (:mod:`bitmosaic.formats.mx`, issue 75) count the same way: :func:`mx_storage_bits`.

:func:`paper_storage_bits` is the Babai paper's nominal count instead (a second column beside the
stored one, for comparing with its tables): symmetric, so no zeros, and no ``g_idx``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from .layout import num_groups
from .mx import MXFormat, get_mx_format

__all__ = ["storage_bits", "bits_per_weight", "dtype_name_bits", "paper_storage_bits", "mx_storage_bits"]


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


def dtype_name_bits(name: str) -> int:
    """Bits of one element of a safetensors dtype name: ``BF16`` -> 16, ``F8_E4M3`` -> 8, ``BOOL`` -> 8."""
    m = re.match(r"[A-Z]+(\d+)", name)
    return int(m.group(1)) if m else 8


def paper_storage_bits(
    out_features: int,
    in_features: int,
    bits: int,
    group_size: int | None,
    outliers: int = 0,
    *,
    scale_bits: int = 16,
    outlier_bits: int = 32,
) -> int:
    """The Babai paper's bit count of one ``[out, in]`` matrix (App. D.3, Table 3): ``bits`` per code
    (no padding), one ``scale_bits`` scale per row and group (symmetric: no zero point; no ``g_idx``;
    a partial last group counts as a group), and ``outlier_bits`` per sparse outlier (SSQR: a 16-bit
    value and a 16-bit column index; CSR row pointers are not counted).  Table 3's widths follow:
    GPTQ 4-bit g128 = 4 + 16/128 = 4.125 bits per weight, SSQR-1% = 4.125 + 0.01 * 32 = 4.445.
    """
    if out_features <= 0 or in_features <= 0:
        raise ValueError(f"shape must be positive, got ({out_features}, {in_features})")
    if outliers < 0 or outliers > out_features * in_features:
        raise ValueError(f"outliers must be in [0, {out_features * in_features}], got {outliers}")
    scales = out_features * num_groups(in_features, group_size)
    return out_features * in_features * bits + scales * scale_bits + outliers * outlier_bits


def mx_storage_bits(out_features: int, in_features: int, fmt: str | MXFormat) -> int:
    """Stored bits of an ``[out, in]`` matrix in ``fmt`` (what :meth:`MXTensor.tensors` holds):
    ``elem_bits`` per element, ``scale_bits`` per (possibly partial) block, 32 for a tensor scale."""
    fmt = get_mx_format(fmt)
    R, C = fmt.scale_shape(out_features, in_features)
    return (
        out_features * in_features * fmt.elem_bits + R * C * fmt.scale_bits + (32 if fmt.global_scale else 0)
    )
