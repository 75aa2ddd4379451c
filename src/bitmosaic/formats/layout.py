"""Group layouts along the input dimension of a ``[out, in]`` weight.

A group size ``g`` splits the ``in`` columns into ``ceil(in / g)`` groups; the last one is
partial when ``g`` does not divide ``in`` (SmolLM2's 576 columns with g=128 give 4 full groups
and one of 64).  ``group_size`` of ``None``/``-1``/``>= in`` means one group per row
(per-channel).  ``g_idx[j]`` names the group that column ``j`` uses; it is ``j // g`` unless an
act-order quantizer processed groups in a permuted order.
"""

from __future__ import annotations

import torch

from .grid import dequantize_codes

_ROWS = 1 << 22  # elements of a row block of dequantize's temporaries

__all__ = ["normalize_group_size", "num_groups", "default_g_idx", "is_trivial_g_idx", "dequantize"]


def normalize_group_size(group_size: int | None, in_features: int) -> int:
    """Return an effective group size in ``1..in_features`` (per-channel -> ``in_features``)."""
    if group_size is None or group_size == -1 or group_size >= in_features:
        return in_features
    if group_size <= 0:
        raise ValueError(f"group size must be positive or -1 (per-channel), got {group_size}")
    return group_size


def num_groups(in_features: int, group_size: int | None) -> int:
    g = normalize_group_size(group_size, in_features)
    return -(-in_features // g)


def default_g_idx(in_features: int, group_size: int | None, device=None) -> torch.Tensor:
    g = normalize_group_size(group_size, in_features)
    return torch.arange(in_features, device=device) // g


def is_trivial_g_idx(g_idx: torch.Tensor, group_size: int | None) -> bool:
    """True when ``g_idx`` is the contiguous ``j // g`` map (no gather needed at inference)."""
    return bool(torch.equal(g_idx.cpu().long(), default_g_idx(g_idx.numel(), group_size)))


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | float,
    g_idx: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Reference dequantization of ``[out, in]`` codes with ``[out, G]`` scales/zeros.

    ``zeros`` may be a scalar (symmetric grid).  Computed in ``dtype`` (float32 default) with the
    exact formula of :func:`bitmosaic.formats.grid.dequantize_codes`, a block of rows at a time
    into one output (memory: the expanded scales, zeros and codes of a 4096 x 14336 linear would
    otherwise be four more full-size float copies, 0.9 GB; the values are the same elementwise).
    """
    g_idx = g_idx.long()
    if not torch.is_tensor(zeros) or zeros.dim() == 0:
        zeros = torch.tensor(float(zeros), dtype=dtype, device=codes.device)

    def expand(t: torch.Tensor, a: int | None = None, b: int | None = None) -> torch.Tensor:
        return t if t.dim() == 0 else t[a:b].to(dtype)[:, g_idx]

    rows = codes.shape[0]
    if codes.dim() != 2 or scales.shape[0] != rows or (zeros.dim() and zeros.shape[0] != rows):
        return dequantize_codes(codes.to(dtype), expand(scales), expand(zeros))  # broadcast rows
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    step = max(1, _ROWS // max(codes.shape[1], 1))
    for a in range(0, rows, step):
        out[a : a + step] = dequantize_codes(codes[a : a + step].to(dtype), expand(scales, a, a + step),
                                             expand(zeros, a, a + step))  # fmt: skip
    return out
