"""Statistics of a float decoder layer's linear inputs, per true-sequential group.

Used by methods with a ``transform`` hook (smoothing): before a layer is quantized, one
forward of the (still float) layer over the calibration batches records, at the input of each
group, the per-channel statistics (:class:`~bitmosaic.algorithms.observers.ActObserver`), the
Hessian ``2/n XᵀX`` and a seeded random sample of token rows (for objectives that quantize the
activations and so cannot be written through the Hessian).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..algorithms.hessian import HessianAccumulator
from ..algorithms.observers import ActObserver
from ..algorithms.smooth import gqa_channel_map
from ..models.arch import ArchSpec

if TYPE_CHECKING:
    from .distributed import Dist

__all__ = ["GroupCapture", "capture_groups", "foldable", "gqa_tie", "run_layer"]


@dataclass
class GroupCapture:
    index: int
    names: tuple[str, ...]
    observer: ActObserver
    hessian: torch.Tensor  # 2/n XᵀX of the group's float input, float32 [n, n]
    sample: torch.Tensor  # [<= max_tokens, n] float32 rows of the input
    weights: dict[str, torch.Tensor]  # the group's float weights (float32 copies)
    foldable: bool  # whether per-channel factors can be folded into the preceding op
    prefix: str = ""  # qualified name of the decoder layer (names are relative to it)
    # not foldable per channel, but factors constant on the classes of this map are (GQA o_proj: one
    # per v_proj channel, shared by the query heads of its key-value head; gqa_tie)
    tie: torch.Tensor | None = None


def foldable(layer: nn.Module, arch: ArchSpec, group_index: int) -> bool:
    """True when ``arch.smooth_prev`` names an op whose output channels are the group's inputs (not
    when the group's input is rotated online: the rotation mixes the channels between the two)."""
    if arch.smooth_prev is None or arch.smooth_prev[group_index] is None:
        return False
    group = arch.groups(layer)[group_index]
    if not group or arch.expert_group(group_index):
        return False
    if any(getattr(layer.get_submodule(n), "input_rotation", None) is not None for n in group):
        return False
    prev = layer.get_submodule(arch.smooth_prev[group_index])
    n = layer.get_submodule(group[0]).weight.shape[1]
    if isinstance(prev, nn.Linear):
        return prev.weight.shape[0] == n  # GQA v_proj -> o_proj: widths differ
    w = getattr(prev, "weight", None)
    return w is not None and w.ndim == 1 and w.shape[0] == n


def gqa_tie(layer: nn.Module, arch: ArchSpec, group_index: int) -> torch.Tensor | None:
    """For ``o_proj`` under grouped-query attention (``smooth_prev`` a ``v_proj`` narrower than the
    group's input): the map of each input channel to the ``v_proj`` row it averages
    (:func:`~bitmosaic.algorithms.smooth.gqa_channel_map`), read from the attention module's
    ``head_dim`` and ``num_key_value_groups`` (transformers' attention classes); ``None`` where the
    group is foldable per channel, has no such producer, or the attention normalises ``v`` (a
    ``v_norm`` would undo the fold)."""
    if arch.smooth_prev is None or arch.smooth_prev[group_index] is None:
        return None
    group = arch.groups(layer)[group_index]
    if not group or arch.expert_group(group_index) or foldable(layer, arch, group_index):
        return None
    if any(getattr(layer.get_submodule(n), "input_rotation", None) is not None for n in group):
        return None
    name = arch.smooth_prev[group_index]
    prev = layer.get_submodule(name)
    attn = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
    hd, rep = getattr(attn, "head_dim", None), getattr(attn, "num_key_value_groups", None)
    if not isinstance(prev, nn.Linear) or not isinstance(hd, int) or not isinstance(rep, int):
        return None
    if getattr(attn, "v_norm", None) is not None:
        return None
    n = layer.get_submodule(group[0]).weight.shape[1]
    if n != prev.weight.shape[0] * rep or prev.weight.shape[0] % hd:
        return None
    return gqa_channel_map(n, prev.weight.shape[0], hd)


def run_layer(layer: nn.Module, hs: torch.Tensor, kw: dict) -> torch.Tensor:
    """One decoder layer's forward -> its hidden states (some versions return a tuple)."""
    out = layer(hs, **kw)
    return out[0] if isinstance(out, tuple) else out


@torch.inference_mode()
def capture_groups(
    layer: nn.Module,
    arch: ArchSpec,
    inputs: list[torch.Tensor],
    kwargs: list[dict],
    *,
    max_tokens: int = 2048,
    generator: torch.Generator | None = None,
    dist: Dist | None = None,
) -> list[GroupCapture]:
    """``dist``: this process's rank of a data-parallel run (``inputs``: its batches); every rank
    then adds every batch's group inputs in batch order (:meth:`~.distributed.Dist.stream`), so
    the statistics and the token sample are those of one process."""
    every = arch.groups(layer)  # experts' groups are not captured: no per-channel factor serves them all
    index = [i for i, g in enumerate(every) if g and not arch.expert_group(i)]
    groups = [every[i] for i in index]
    heads = [layer.get_submodule(g[0]) for g in groups]
    obs = [ActObserver(m.weight.shape[1]) for m in heads]
    accs = [HessianAccumulator(m.weight.shape[1]) for m in heads]
    samples: list[list[torch.Tensor]] = [[] for _ in groups]
    many = dist is not None and dist.world > 1
    per_batch = -(-max_tokens // max(dist.batches if many else len(inputs), 1))
    blocks = [dist.hessian_blocks(a) for a in accs] if many else [None] * len(groups)
    stash: list[tuple[int, torch.Tensor]] = []

    def take(i: int, x: torch.Tensor) -> None:  # group i's input of the next batch (batch order)
        obs[i].add(x)
        accs[i].add(x, blocks[i])
        k = min(per_batch, x.shape[0])
        idx = torch.randperm(x.shape[0], generator=generator)[:k].sort().values
        samples[i].append(x[idx.to(x.device)].cpu())

    def make_hook(i):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            if many:
                stash.append((i, x))  # broadcast and taken after the forward
            else:
                take(i, x)

        return hook

    batches = iter(zip(inputs, kwargs, strict=True))

    def forward(j: int) -> list:
        stash.clear()
        run_layer(layer, *next(batches))
        return list(stash)

    handles = [m.register_forward_pre_hook(make_hook(i)) for i, m in enumerate(heads)]
    try:
        if many:
            dist.stream(len(inputs), forward, lambda b, items: [take(i, x) for i, x in items])
            for acc, mine in zip(accs, blocks, strict=True):
                dist.gather_hessian(acc, mine)
        else:
            for hs, kw in zip(inputs, kwargs, strict=True):
                run_layer(layer, hs, kw)
    finally:
        for h in handles:
            h.remove()
    return [
        GroupCapture(
            index=index[i],
            names=tuple(g),
            observer=obs[i],
            hessian=accs[i].H,
            sample=torch.cat(samples[i])[:max_tokens],
            weights={n: layer.get_submodule(n).weight.detach().float().clone() for n in g},
            foldable=foldable(layer, arch, index[i]),
            tie=gqa_tie(layer, arch, index[i]),
        )
        for i, g in enumerate(groups)
    ]
