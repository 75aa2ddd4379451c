"""Fold per-channel factors into a decoder layer: any method's ``transform`` hook that returns factors.

For a group whose input is ``X`` and factors ``s``: the group's weights become ``W·diag(s)`` and
the preceding op's output is divided by ``s`` (norm weight, or the rows of ``v_proj``/``up_proj``;
see :class:`~bitmosaic.models.arch.ArchSpec`), so the float layer computes the same function
(tested) while the linears see the easier ``X·diag(s)⁻¹``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..algorithms.smooth import fold_scales_into_linear_rows, fold_scales_into_norm, shared_scales
from ..models.arch import ArchSpec
from .capture import foldable, gqa_tie

__all__ = ["fold_group_scales"]


@torch.no_grad()
def fold_group_scales(layer: nn.Module, arch: ArchSpec, group_index: int, s: torch.Tensor) -> None:
    """Apply factors ``s`` ([in]) to group ``group_index`` of ``layer`` in place.  Under grouped-query
    attention ``o_proj``'s factors must be shared by the query heads of each key-value head
    (:func:`~.capture.gqa_tie`); ``v_proj``'s rows are then divided by the shared factors."""
    tie = None if foldable(layer, arch, group_index) else gqa_tie(layer, arch, group_index)
    if tie is None and not foldable(layer, arch, group_index):
        raise ValueError(
            f"group {arch.groups(layer)[group_index]} has no preceding op to fold factors into "
            f"(smooth_prev={arch.smooth_prev})"
        )
    prev = layer.get_submodule(arch.smooth_prev[group_index])
    s = s.detach().float().to(prev.weight.device)
    if isinstance(prev, nn.Linear):
        rows = s if tie is None else shared_scales(s, tie)
        w, b = fold_scales_into_linear_rows(
            prev.weight.float(), None if prev.bias is None else prev.bias.float(), rows
        )
        prev.weight.copy_(w.to(prev.weight.dtype))
        if b is not None:
            prev.bias.copy_(b.to(prev.bias.dtype))
    else:
        prev.weight.copy_(
            fold_scales_into_norm(prev.weight.float(), s, arch.norm_offset).to(prev.weight.dtype)
        )
    for name in arch.groups(layer)[group_index]:
        lin = layer.get_submodule(name)
        lin.weight.copy_((lin.weight.float() * s[None, :]).to(lin.weight.dtype))
