"""One true-sequential group's statistics on a layer's calibration inputs.

- :func:`group_statistics`: Hessians ``2/n XᵀX`` (float32, on the device) and, when static
  activation scales are calibrated, input observers for one true-sequential group (the forward stops
  as soon as every member's input was seen; members that read one tensor share one Hessian).
- :class:`OutputCache`: outputs of already-quantized linears for the rest of their layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..algorithms.hessian import HessianAccumulator
from ..algorithms.observers import ActObserver
from ..devices import release_host_memory
from .calibration import LayerInputs, StopForward
from .capture import run_layer

if TYPE_CHECKING:
    from .distributed import Dist

__all__ = ["OutputCache", "group_statistics", "plain_child"]


class OutputCache:
    """Outputs of already-quantized linears, per calibration batch, for the rest of one layer.

    Once a linear is quantized its input can no longer change (it depends only on groups before
    it, which are final), so later partial forwards of the same layer may reuse its output
    exactly instead of recomputing it: the projections -- most of a layer's FLOPs -- then run
    once per layer instead of once per later group.  The same holds for a module without any of
    the layer's linears that finished before a group's first member was called (a norm: its
    input is final).  Setting :attr:`batch` starts a pass; a cached module answers only its first
    call of a pass (a module called twice in one forward runs the second time).  Use as a
    context manager: the forward patches are removed however the block ends (also when
    quantization raises).
    """

    def __init__(self) -> None:
        self._batch = 0
        self._calls: set[int] = set()  # id(module) of the cached modules called in this pass
        self.modules: list[nn.Module] = []
        self._stores: dict[int, dict[int, torch.Tensor]] = {}  # id(module) -> batch -> output

    @property
    def batch(self) -> int:
        return self._batch

    @batch.setter
    def batch(self, b: int) -> None:  # a new pass (of batch b)
        self._batch = b
        self._calls.clear()

    def install(self, module: nn.Module, outputs: dict[int, torch.Tensor] | None = None) -> None:
        """Cache ``module``'s output per batch from now on (``outputs``: those of batches already
        seen).  Caches of modules inside it stay until the outer one has stored that batch (its
        first call still runs them, and must not recompute them), then that batch's inner outputs
        are freed."""
        if module in self.modules:
            return
        inner = [sub for sub in module.modules() if sub is not module and sub in self.modules]
        orig = module.forward
        store: dict[int, torch.Tensor] = dict(outputs or {})
        self._stores[id(module)] = store

        def forward(*args, **kwargs):
            if id(module) in self._calls:  # a second call in one pass: other inputs, maybe
                return orig(*args, **kwargs)
            self._calls.add(id(module))
            y = store.get(self._batch)
            if y is None:
                y = store[self._batch] = orig(*args, **kwargs)
                for sub in inner:  # answered by the outer cache from now on
                    self._stores[id(sub)].pop(self._batch, None)
            return y

        module.forward = forward
        self.modules.append(module)

    @staticmethod
    def _restore(m: nn.Module) -> None:
        if "forward" in vars(m):
            del m.forward  # back to the class's forward (and its store is freed)

    def release(self, batch: int) -> None:
        """Free every output stored for ``batch`` (its last use is over)."""
        for store in self._stores.values():
            store.pop(batch, None)

    def clear(self) -> None:
        for m in self.modules:
            self._restore(m)
        self.modules.clear()
        self._stores.clear()

    def __enter__(self) -> OutputCache:
        return self

    def __exit__(self, *exc) -> None:
        self.clear()


def plain_child(child: nn.Module) -> bool:
    """A child of a layer that holds no matrix (a norm, an activation): no group's linear is inside it,
    so its output is final once it finished before a group's first member was called.  (A child that
    holds a linear is cached only once all its linears are solved: in a block whose forward runs its
    MLP before its attention, the MLP finishes before the attention's group is called.)"""
    return all(p.dim() < 2 for p in child.parameters())


class _StandInsSpoiled(Exception):
    """A group member read a tensor computed after a stand-in output: redo the pass without them."""


@torch.inference_mode()
def group_statistics(
    layer: nn.Module,
    names,
    inputs: LayerInputs,
    kwargs: list[dict],
    *,
    hessian_dtype: torch.dtype = torch.float32,
    cache: OutputCache | None = None,
    observe=False,
    dist: Dist | None = None,
) -> tuple[dict[str, HessianAccumulator], dict[str, str], dict[str, ActObserver]]:
    """Hessians of the inputs of linears ``names`` (modules fed the very same tensor share one:
    ``owner[name]`` is the name whose accumulator holds it), and input observers when ``observe``:
    ``True`` for per-channel statistics only, a static activation quantizer (``ActQuantSpec``) for
    its calibrated scales too.  The layer's forward
    stops as soon as every input was seen.

    Members of a group read one tensor (q/k/v, gate/up), so computing q and k only to reach v's
    input wastes two projections per pass (a quarter of a layer's linear FLOPs).  While a group
    is incomplete, a member whose input was recorded returns a zero stand-in instead of running;
    when a later member then reads a tensor that is *not* one already recorded (so it may have been
    computed from a stand-in), the pass is redone with every member running, for that batch and the
    rest.  Inputs are added to the Hessians only when a pass completes, so a redone pass counts once.

    ``dist``: this process's rank of a data-parallel run (``inputs``: its batches); every rank then
    adds every batch in batch order (:mod:`bitmosaic.pipeline.distributed`): the statistics of one
    process, bit for bit.
    """
    mods = {n: layer.get_submodule(n) for n in names}
    accs: dict[str, HessianAccumulator] = {}
    observers: dict[str, ActObserver] = {}
    act_spec = None if isinstance(observe, bool) else observe
    observe = bool(observe) and (act_spec is None or act_spec.static)
    many = dist is not None and dist.world > 1
    blocks: dict[str, set[int] | None] = {}

    def take(seen: list[tuple[str, torch.Tensor]]) -> None:  # one batch's inputs, in batch order
        for name, x in seen:
            acc = accs.get(name)
            if acc is None:
                acc = accs[name] = HessianAccumulator(x.shape[-1], dtype=hessian_dtype, device=x.device)
                blocks[name] = dist.hessian_blocks(acc) if many else None
            acc.add(x, blocks[name])
            if observe:
                observers.setdefault(name, ActObserver(x.shape[-1], act_spec)).add(x)

    rec = _GroupPass(layer, mods, cache)
    try:
        if many:  # each rank runs its batches; every rank adds every batch (bit-identical statistics)
            batches = iter(zip(inputs, kwargs, strict=True))
            dist.stream(len(inputs), lambda j: rec.inputs(j, *next(batches)), lambda b, seen: take(seen))
            for name, acc in accs.items():
                dist.gather_hessian(acc, blocks[name])
        else:
            for b, (hs, kw) in enumerate(zip(inputs, kwargs, strict=True)):
                take(rec.inputs(b, hs, kw))
                release_host_memory()  # the forward's freed temporaries (devices.py)
        if cache is not None:
            rec.cache_early()
    finally:
        rec.close()
    return accs, rec.owner, observers


class _GroupPass:
    """The hooks of :func:`group_statistics` on one layer: each member's input recorded (``owner``: who
    holds the tensor each member reads), stand-in outputs while the group is incomplete, the forward
    stopped once every member was seen.  :meth:`close` removes them."""

    def __init__(self, layer: nn.Module, mods: dict[str, nn.Module], cache: OutputCache | None) -> None:
        self.layer, self.mods, self.cache = layer, mods, cache
        self.owner: dict[str, str] = {}
        self.state: dict = {"stand_ins": len(mods) > 1}
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in mods.items()]
        # the layer's children that finish before a member is called in every pass: final (cacheable),
        # with their outputs per batch
        self.early: set[nn.Module] | None = None
        self.early_out: dict[nn.Module, dict[int, torch.Tensor]] = {}
        if cache is not None:
            for child in layer.children():
                if plain_child(child) and child not in cache.modules:
                    self.handles.append(child.register_forward_hook(self._finished(child)))
        self.patched = [m for m in mods.values() if isinstance(m, nn.Linear) and "forward" not in vars(m)]
        for m in self.patched:
            m.forward = self._forward(m)

    def _hook(self, name: str):
        state, owner, n_mods = self.state, self.owner, len(self.mods)

        def hook(module, args):
            x = args[0]
            seen: list = state["seen"]
            if any(n == name for n, _ in seen):
                return  # a member called twice in one pass: its first input is the one recorded
            own = next((n for n, t in seen if t is x and owner.get(n, n) == n), None)
            if own is None and state["stood_in"]:
                raise _StandInsSpoiled
            owner.setdefault(name, own or name)
            seen.append((name, x))
            if len(seen) == n_mods:
                raise StopForward

        return hook

    def _finished(self, child: nn.Module):
        state = self.state

        def hook(module, args, out):  # no member called yet in this pass: nothing seen
            if not state["seen"] and (self.early is None or child in self.early):
                state["early"].add(child)
                self.early_out.setdefault(child, {})[self.cache.batch] = out

        return hook

    def _forward(self, module: nn.Linear):
        orig, state = module.forward, self.state

        def forward(x, *args, **kw):
            if state["stand_ins"]:
                state["stood_in"] = True
                return x.new_zeros(*x.shape[:-1], module.out_features)
            return orig(x, *args, **kw)

        return forward

    def inputs(self, b: int, hs: torch.Tensor, kw: dict) -> list[tuple[str, torch.Tensor]]:
        """Batch ``b``'s pass(es) until every member's input was seen: the owners' inputs."""
        state = self.state
        while True:
            if self.cache is not None:
                self.cache.batch = b  # a new pass
            state["seen"], state["stood_in"], state["early"] = [], False, set()
            try:
                run_layer(self.layer, hs, kw)
            except StopForward:
                self.early = state["early"] if self.early is None else self.early & state["early"]
                break
            except _StandInsSpoiled:
                state["stand_ins"] = False  # this group's members do not share one input
                continue
            missing = sorted(set(self.mods) - {n for n, _ in state["seen"]})
            raise RuntimeError(f"layer forward never called {missing}; check the architecture's layer map")
        seen, state["seen"] = [(n, x) for n, x in state["seen"] if self.owner[n] == n], []
        return seen

    def cache_early(self) -> None:
        """Cache the children that finished before any member was called in every pass: their inputs
        come from groups already final (groups run in forward order), so their outputs are final."""
        for child in self.early or ():
            self.cache.install(child, self.early_out.pop(child))
        self.early_out.clear()

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for m in self.patched:
            del m.forward
