"""Expert weights read part by part: a streamed layer whose experts do not fit in memory (issue 71, item 4).

A DeepSeek-V3 layer holds 256 experts of 3 x 7168 x 2048 weights: 45 GB in float32, more than a 24 GB
machine has.  When a streamed layer's expert weights (in the compute dtype) exceed
:data:`WEIGHT_FRACTION` of the memory budget, :class:`LazyExperts` keeps them out of memory: the layer is
filled without them (their parameters stay on ``meta``), and

* each part of an expert group (:func:`~bitmosaic.pipeline.experts.expert_parts`, sized here for the
  part's Hessians *and* weights) makes its experts resident for its statistics pass and solve
  (:meth:`LazyExperts.resident`): a projection not yet solved is read from the checkpoint, one already
  solved is its packed module's dequantized weights -- bit for bit the values an in-memory run leaves
  in place (:func:`~bitmosaic.pipeline.solve.quantize_shared` checks the packed module against them) --
  and all of them go back to ``meta`` when the part is done (the packed modules stay);
* the pass that makes the next layer's inputs materialises each expert just for its own call
  (:meth:`LazyExperts.per_call`), from the packed modules.

So at most one part's experts are float at once, the layer's packed experts are all that accumulates,
and the bytes written are those of a run that held every expert (tested with a budget that forces parts).
The cost: a projection not yet solved is read once per group that runs it (gate/up's part reads the
down projections too, since the expert's forward runs them: about 1.3x the layer's expert bytes), and
each call of the last pass dequantizes its expert.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..modules.experts import RoutedExperts

__all__ = ["WEIGHT_FRACTION", "LazyExperts", "expert_linears", "expert_weight_bytes"]

WEIGHT_FRACTION = 0.25  # of the memory budget: above it a streamed layer's experts are read in parts


def expert_linears(layer: nn.Module) -> list[str]:
    """Names (in ``layer``) of every routed expert's linear projections."""
    out = []
    for name, mod in layer.named_modules():
        if isinstance(mod, RoutedExperts):
            for e, expert in enumerate(mod):
                out += [f"{name}.{e}.{p}" for p, m in expert.named_children() if isinstance(m, nn.Linear)]
    return out


def expert_weight_bytes(layer: nn.Module, dtype: torch.dtype) -> int:
    """The bytes ``layer``'s expert projections take in ``dtype`` (meta or not)."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() * size for n in expert_linears(layer) for p in layer.get_submodule(n).parameters())


def _to_meta(lin: nn.Module) -> None:
    for name, p in list(lin.named_parameters(recurse=False)):
        setattr(lin, name, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False))


class LazyExperts:
    """The expert projections of one streamed layer, resident only while used (module doc).

    ``read(name, linear)`` fills ``linear`` (on ``meta``) from the checkpoint; ``packed`` maps a solved
    projection's name to its packed module (the loop's own dict: filled as parts are solved); ``dtype``
    and ``device``: the compute dtype and device of the run."""

    def __init__(self, layer: nn.Module, read: Callable[[str, nn.Module], None], packed: dict,
                 dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        self.layer, self.read, self.packed = layer, read, packed
        self.dtype, self.device = dtype, device
        self.names = expert_linears(layer)
        for n in self.names:
            _to_meta(layer.get_submodule(n))

    def _fill(self, name: str) -> None:
        lin = self.layer.get_submodule(name)
        if not lin.weight.is_meta:
            return
        q = self.packed.get(name)
        if q is None:
            self.read(name, lin)
        else:  # solved: the packed module's weights (and the float bias it keeps)
            lin.weight = nn.Parameter(q.dequantize_weight(torch.float32).to(self.dtype), requires_grad=False)
            if getattr(lin, "bias", None) is not None and lin.bias.is_meta:
                lin.bias = nn.Parameter(q.bias.detach().to(self.dtype).clone(), requires_grad=False)
        for name_, p in list(lin.named_parameters(recurse=False)):
            if p.device != self.device or p.dtype != self.dtype:
                setattr(lin, name_, nn.Parameter(p.to(self.device, self.dtype), requires_grad=False))

    def experts_of(self, names: Iterable[str]) -> list[str]:
        """Every projection of the experts that ``names`` belong to (an expert's forward runs them all)."""
        experts = {n.rsplit(".", 1)[0] for n in names}
        return [n for n in self.names if n.rsplit(".", 1)[0] in experts]

    @contextlib.contextmanager
    def resident(self, names: Iterable[str]):
        """The experts of ``names`` float for the block's duration, back on ``meta`` after it."""
        todo = self.experts_of(names)
        try:
            for n in todo:
                self._fill(n)
            yield
        finally:
            for n in todo:
                _to_meta(self.layer.get_submodule(n))

    @contextlib.contextmanager
    def per_call(self):
        """Each expert float only during its own call (the pass that makes the next layer's inputs)."""
        handles = []
        for name, mod in self.layer.named_modules():
            if not isinstance(mod, RoutedExperts):
                continue
            for e, expert in enumerate(mod):
                projs = [f"{name}.{e}.{p}" for p, m in expert.named_children() if isinstance(m, nn.Linear)]

                def pre(module, args, projs=projs):
                    for n in projs:
                        self._fill(n)

                def post(module, args, out, projs=projs):
                    for n in projs:
                        _to_meta(self.layer.get_submodule(n))

                handles += [expert.register_forward_pre_hook(pre), expert.register_forward_hook(post)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
