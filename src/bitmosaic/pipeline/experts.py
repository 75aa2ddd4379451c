"""Statistics of a group of expert projections (``mlp.experts.<e>.gate_proj`` ...): one Hessian per
expert from the tokens routed to it.

For expert ``e`` the layer's output gets ``w_t * expert_e(x_t)`` from token ``t`` routed to it with
routing weight ``w_t``, so an error ``dW x_t`` of one of its linears reaches the layer output scaled by
``w_t``: the squared output error is ``sum_t w_t^2 |dW x_t|^2`` -- the GPTQ objective (GPTQ paper,
Eq. 1-2) with the Hessian ``2/n sum_t w_t^2 x_t x_t^T``.  That is exact for ``down_proj`` and first
order for ``gate_proj``/``up_proj`` (whose error passes the gate rule first), and it is what
``moe_calib='routed'`` accumulates: each routed row scaled by its routing weight.  ``'all'`` sends every
calibration token through every expert (:attr:`~bitmosaic.modules.experts.RoutedExperts.observe_all`),
unweighted, for statistics only: no expert lacks tokens, at E/k times the expert FLOPs.

An expert routed fewer than ``moe_min_tokens`` rows (``'auto'``: the projection's input width) falls back
to ``moe_fallback``: ``'pooled'``, the layer's pooled Hessian of the same projection (all experts' rows,
weighted alike), solved by the run's method; or ``'rtn'``, round-to-nearest with MSE-searched scales on
the run's grid (bits, group size, symmetry): the method registry's statistics-free method
(:func:`~bitmosaic.methods.registry.grid_fallback`), which the loop swaps in for that expert's linears
(:func:`apply_grid_fallback`). Few rows make an ``H x H`` Hessian rank-poor: GPTQ then fits the handful of
seen rows and errs on the tokens it will see; on a random 16-expert layer fed real token embeddings its
own Hessian beat the pooled one on held-out tokens only from about ``H`` rows on
(``benchmarks/moe/min_tokens.py``; docs/moe.md), hence ``'auto'``. :func:`expert_statistics` returns the
rows each expert saw and which experts fell back, for the run report.

**Experts in parts** (issue 71: "a layer's experts are calibrated, solved and written expert by expert").
One Hessian per expert is ``E d^2`` floats per group: 2.1 GB for Qwen3-30B-A3B's gate/up (128 x 2048^2),
52 GB for DeepSeek-V3's (256 x 7168^2). When a group's Hessians exceed :data:`HESSIAN_FRACTION` of the
memory budget (``max_memory``, else the memory available at the start), :func:`expert_parts` splits it
into parts of whole experts that fit, and the loop runs one statistics pass per part (only the part's
experts run: :attr:`~bitmosaic.modules.experts.RoutedExperts.only`; the attention's outputs come from the
output cache when it is on), solves the part and frees its Hessians before the next. :class:`ExpertPool`
keeps what outlives a part: the rows each expert saw, the running pooled sum ``sum_e n_e H_e`` (added in
the order the whole group would add it) and the experts below ``moe_min_tokens``, solved last on the
pooled Hessian (or by the grid rule). An expert's Hessian depends only on its own routed rows, so the
parts give the bytes of the whole group at once.
"""

from __future__ import annotations

import torch
from torch import nn

from ..algorithms.hessian import HessianAccumulator
from ..algorithms.observers import ActObserver
from ..devices import release_host_memory
from ..errors import OptionError
from ..methods.registry import grid_fallback
from ..modules.experts import RoutedExperts
from .calibration import LayerInputs, StopForward
from .capture import run_layer
from .settings import RunSettings

__all__ = ["expert_statistics", "is_expert_group", "ExpertStats", "ExpertPool", "expert_parts",
           "HESSIAN_FRACTION", "GRID_RULES", "apply_grid_fallback", "check_grid_fallback"]  # fmt: skip

GRID_RULES = ("rtn",)  # fallback rules that quantize on the run's grid without statistics (module doc)

HESSIAN_FRACTION = 0.25  # of the memory budget: what one part of a group's expert Hessians may take


def is_expert_group(layer: nn.Module, names) -> bool:
    """Whether the group's linears are expert projections (their parent's parent is a RoutedExperts)."""
    return any(isinstance(_container(layer, n), RoutedExperts) for n in names)


def _container(layer: nn.Module, name: str) -> nn.Module | None:
    parts = name.split(".")
    if len(parts) < 3:
        return None
    return layer.get_submodule(".".join(parts[:-2]))


class _Fixed:
    """A Hessian that is not accumulated here (a fallback's): what the solver reads of an accumulator."""

    def __init__(self, H: torch.Tensor) -> None:
        self.H = H

    def take(self) -> torch.Tensor:
        return self.H.clone()


class ExpertStats:
    """Per expert group: ``tokens`` (owner name -> routed rows seen), ``fallback`` (owner -> rule)."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}
        self.fallback: dict[str, str] = {}


@torch.inference_mode()
def expert_statistics(
    layer: nn.Module,
    names,
    inputs: LayerInputs,
    kwargs: list[dict],
    *,
    cache=None,
    observe=False,
    dist=None,
    settings: RunSettings | None = None,
) -> tuple[dict, dict[str, str], dict[str, ActObserver], ExpertStats]:
    """Hessians of the expert linears ``names`` (module doc), the owner of each (an expert's gate and up
    read one tensor: one Hessian), input observers when ``observe`` and the :class:`ExpertStats`;
    ``settings``: the run's ``hessian_dtype``, ``moe_calib``, ``moe_min_tokens`` and ``moe_fallback``."""
    settings = settings or RunSettings()
    accs, owner, observers, stats = _expert_pass(layer, names, inputs, kwargs, cache=cache, observe=observe,
                                                 dist=dist, settings=settings)  # fmt: skip
    widths = {n: layer.get_submodule(n).in_features for n in names}
    _fall_back(names, accs, owner, stats, settings.moe_min_tokens, settings.moe_fallback, widths)
    return accs, owner, observers, stats


@torch.inference_mode()
def _expert_pass(layer, names, inputs, kwargs, *, cache, observe, dist, settings):
    """One statistics pass over ``names``' experts (only they run): Hessians, owners, observers, rows.

    ``dist``: this process's rank of a data-parallel run (``inputs``: its batches).  Each rank runs the
    attention, router and experts on its own batches; what the hooks saw of each batch (every expert
    linear's input, routing weights, who shares whose input) is broadcast in global batch order
    (:meth:`~.distributed.Dist.stream`) and every rank adds it in that order, each Hessian's block rows
    dealt over the ranks: the statistics of one process, bit for bit (distributed.py)."""
    rec = _ExpertPass(layer, names, observe, dist, settings)
    try:
        if rec.many:
            batches = iter(zip(inputs, kwargs, strict=True))
            dist.stream(len(inputs), lambda j: _encode(rec.run(j, *next(batches), cache)),
                        lambda b, items: rec.take(_decode(items)))  # fmt: skip
            for name, acc in rec.accs.items():
                dist.gather_hessian(acc, rec.blocks[name])
        else:
            for b, (hs, kw) in enumerate(zip(inputs, kwargs, strict=True)):
                rec.run(b, hs, kw, cache)
    finally:
        rec.close()
    return rec.accs, rec.owner, rec.observers, rec.stats


class _ExpertPass:
    """The hooks of :func:`_expert_pass` on one layer.  Each call of an expert linear is an event,
    ``("add", name, x, w)`` (its input rows and their routing weights, ``None`` for a statistics call
    under ``'all'``) or ``("share", name, owner)`` (it reads the very tensor ``owner`` read: gate and up);
    one process takes each event as it happens, a data-parallel rank keeps a batch's events for
    :meth:`~.distributed.Dist.stream`.  :meth:`take` adds them; :meth:`close` removes the hooks."""

    def __init__(self, layer: nn.Module, names, observe, dist, settings: RunSettings) -> None:
        self.layer, self.settings, self.dist = layer, settings, dist
        self.many = dist is not None and dist.world > 1
        self.act_spec = None if isinstance(observe, bool) else observe
        self.observe = bool(observe) and (self.act_spec is None or self.act_spec.static)
        self.accs: dict[str, HessianAccumulator] = {}
        self.blocks: dict[str, set[int] | None] = {}  # a data-parallel run: the block rows this rank adds
        self.observers: dict[str, ActObserver] = {}
        self.owner: dict[str, str] = {}
        self.stats = ExpertStats()
        self.events: list = []  # this batch's, kept for the broadcast (a data-parallel run)
        self.weights: dict[int, torch.Tensor | None] = {}  # id(expert) -> its current call's routing weights
        self.seen: dict[int, list] = {}  # id(expert) -> (owner, input) of this batch's calls
        self.want_routed = settings.moe_calib == "routed"
        self.containers = {id(c): c for n in names if isinstance(c := _container(layer, n), RoutedExperts)}
        self.handles = []
        for n in names:
            hook = self._linear_hook(n, layer.get_submodule(n.rsplit(".", 1)[0]))
            self.handles.append(layer.get_submodule(n).register_forward_pre_hook(hook))
        mine = {id(layer.get_submodule(n.rsplit(".", 1)[0])) for n in names}
        for c in self.containers.values():
            self.handles += [e.register_forward_pre_hook(self._expert_hook) for e in c]
            self.handles.append(c.register_forward_hook(_stop))
            c.observe_all = not self.want_routed
            c.only = {i for i, e in enumerate(c) if id(e) in mine}

    def _expert_hook(self, module, args) -> None:
        self.weights[id(module)] = args[1] if len(args) > 1 else None

    def _linear_hook(self, name: str, expert: nn.Module):
        def hook(module, args):
            w = self.weights.get(id(expert))
            if (w is not None) != self.want_routed:
                return  # a routed call under 'all' (or the statistics call under 'routed')
            own = next((o for o, t in self.seen.get(id(expert), []) if t is args[0]), None)
            if own is not None:  # gate and up of one expert read one tensor
                event = ("share", name, own)
            else:
                self.seen.setdefault(id(expert), []).append((name, args[0]))
                event = ("add", name, args[0], w)
            if self.many:
                self.events.append(event)
            else:
                self.take([event])

        return hook

    def run(self, b: int, hs: torch.Tensor, kw: dict, cache) -> list:
        """Batch ``b``'s pass (its events added as they happen, or returned: a data-parallel rank)."""
        if cache is not None:
            cache.batch = b
        self.seen.clear()
        try:
            run_layer(self.layer, hs, kw)
        except StopForward:
            pass
        self.seen.clear()
        events, self.events = self.events, []
        release_host_memory()
        return events

    def take(self, events: list) -> None:
        """Add one batch's events, in the order they happened."""
        hessian_dtype = self.settings.hessian_dtype
        for kind, name, *rest in events:
            if kind == "share":
                self.owner.setdefault(name, rest[0])
                continue
            x, w = rest[0].reshape(-1, rest[0].shape[-1]), rest[1]
            self.owner.setdefault(name, name)
            xf = x.float() if w is None else x.float() * w.reshape(-1, 1).float()
            acc = self.accs.get(name)
            if acc is None:
                acc = self.accs[name] = HessianAccumulator(x.shape[-1], dtype=hessian_dtype, device=x.device)
                # rotated by the accumulator's index: thin experts' one block row spread over the ranks
                self.blocks[name] = self.dist.hessian_blocks(acc, len(self.accs)) if self.many else None
            acc.add(xf.to(hessian_dtype) if hessian_dtype != torch.float32 else xf, self.blocks[name])
            self.stats.tokens[name] = self.stats.tokens.get(name, 0) + x.shape[0]
            if self.observe:
                self.observers.setdefault(name, ActObserver(x.shape[-1], self.act_spec)).add(x)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for c in self.containers.values():
            c.observe_all, c.only = False, None


def _stop(module, args, out):
    raise StopForward


def _encode(events: list) -> list:
    """A batch's events as :meth:`~.distributed.Dist.stream` items ``[(key, tensor or None)]``: an
    input that is the very tensor an earlier event sent (every expert's statistics call under ``'all'``
    reads the whole batch) travels once, as a reference."""
    items: list = []
    sent: list[tuple[torch.Tensor, int]] = []
    for kind, name, *rest in events:
        if kind == "share":
            items.append((("share", name, rest[0]), None))
            continue
        x, w = rest
        ref = next((k for t, k in sent if t is x), None)
        if ref is None:
            sent.append((x, len(items)))
        items.append((("add", name, ref), x if ref is None else None))
        if w is not None:
            items.append((("w",), w))
    return items


def _decode(items: list) -> list:
    """The events :func:`_encode` made of ``items`` (the tensors as broadcast)."""
    events: list = []
    for key, t in items:
        if key[0] == "share":
            events.append(key)
        elif key[0] == "w":
            events[-1] = (*events[-1][:3], t)
        else:
            events.append(("add", key[1], t if key[2] is None else items[key[2]][1], None))
    return events


def _own_uncalled(names, owner: dict, template: dict[str, str]) -> None:
    """Owners for experts never called: their projections share inputs as the called experts' do
    (``template``: member -> owner by projection name, e.g. up_proj -> gate_proj; updated here)."""
    for n, o in owner.items():
        template.setdefault(n.rsplit(".", 1)[1], o.rsplit(".", 1)[1])
    for n in names:
        if n not in owner:
            base, proj = n.rsplit(".", 1)
            owner[n] = f"{base}.{template.get(proj, proj)}"


def _no_tokens(proj: str) -> OptionError:
    return OptionError(f"no calibration token reached any expert's {proj} in this layer; use more "
                       "calibration samples or --moe-calib all")  # fmt: skip


def _below(rows: int, min_tokens: int | str, width: int) -> bool:
    """Whether ``rows`` routed rows are too few (``min_tokens`` ``'auto'``: fewer than the input width)."""
    return rows < (width if min_tokens == "auto" else min_tokens)


def _fall_back(names, accs: dict, owner: dict, stats: ExpertStats, min_tokens: int | str, rule: str,
               widths: dict[str, int]) -> None:  # fmt: skip
    """Owners for experts never called, and the fallback ``rule`` for every owner below ``min_tokens``
    rows (``'auto'``: its input width ``widths[owner]``, the size of its Hessian): the pooled Hessian,
    or a grid rule (:func:`apply_grid_fallback` swaps the method)."""
    _own_uncalled(names, owner, {})
    by_proj: dict[str, list[str]] = {}
    for o in dict.fromkeys(owner[n] for n in names):
        by_proj.setdefault(_proj(o), []).append(o)
    for proj, owns in by_proj.items():
        for o in owns:
            stats.tokens.setdefault(o, 0)
        low = [o for o in owns if _below(stats.tokens[o], min_tokens, widths[o])]
        if not low:
            continue
        if rule in GRID_RULES:  # solved without statistics
            stats.fallback.update(dict.fromkeys(low, rule))
            continue
        pool = [o for o in owns if stats.tokens.get(o, 0) > 0]
        if not pool:
            raise _no_tokens(proj)
        rows = sum(stats.tokens[o] for o in pool)
        H = sum(accs[o].H * stats.tokens[o] for o in pool) / rows  # as ExpertPool adds it
        for o in low:
            accs[o] = _Fixed(H)
            stats.fallback[o] = rule


def apply_grid_fallback(plan: dict, stats: ExpertStats, owner: dict) -> None:
    """Give the linears of every expert that fell back to a grid rule (``'rtn'``) the registry's
    statistics-free method on their planned grid (:func:`~bitmosaic.methods.registry.grid_fallback`),
    in ``plan`` (this layer's linear name -> ``(Method, config)``).  A planned method that needs no
    Hessian keeps its entry: its result does not depend on the statistics."""
    for name, own in owner.items():
        entry = plan.get(name)
        if entry is not None and stats.fallback.get(own) in GRID_RULES and entry[0].needs_hessian:
            plan[name] = grid_fallback(*entry)


def check_grid_fallback(layers, groups_of, plans: list[dict], rule: str) -> None:
    """Refuse, before any work, a grid fallback ``rule`` for an expert linear whose planned method has
    no plain integer grid (one line, from :func:`~bitmosaic.methods.registry.grid_fallback`).
    ``groups_of(layer)``: the layer's true-sequential groups."""
    if rule not in GRID_RULES:
        return
    seen = set()
    for layer, plan in zip(layers, plans, strict=True):
        for group in groups_of(layer):
            if not group or not is_expert_group(layer, group):
                continue
            for n in group:
                entry = plan.get(n)
                if entry is not None and entry[0].needs_hessian and id(entry) not in seen:
                    seen.add(id(entry))
                    grid_fallback(*entry)


def _proj(name: str) -> str:
    """``mlp.experts.3.gate_proj`` -> ``mlp.experts.*.gate_proj``."""
    parts = name.split(".")
    return ".".join(parts[:-2] + ["*", parts[-1]])


def expert_parts(
    layer: nn.Module, names, budget: int, hessian_dtype: torch.dtype, weight_bytes: int = 0
) -> list[tuple[str, ...]]:
    """``names`` in parts of whole experts whose Hessians (one per distinct input width of an expert's
    linears; plus ``weight_bytes`` per expert when its weights are read with it, lazy_experts.py) take at
    most :data:`HESSIAN_FRACTION` of ``budget`` bytes; one part when all fit (module doc).  Names outside a
    list of experts go with the first part."""
    key = {n: n.rsplit(".", 1)[0] if isinstance(_container(layer, n), RoutedExperts) else "" for n in names}
    experts = list(dict.fromkeys(k for k in key.values() if k))
    widths = {k: {layer.get_submodule(n).weight.shape[1] for n in names if key[n] == k} for k in experts}
    one = max((sum(d * d for d in w) for w in widths.values()), default=0)
    size = torch.empty((), dtype=hessian_dtype).element_size()
    per_part = max(1, int(HESSIAN_FRACTION * budget // max(one * size + weight_bytes, 1)))
    if len(experts) <= per_part:
        return [tuple(names)]
    parts = [{"", *experts[: per_part]}]
    parts += [set(experts[i : i + per_part]) for i in range(per_part, len(experts), per_part)]
    return [tuple(n for n in names if key[n] in p) for p in parts]


class ExpertPool:
    """What outlives one part of an expert group (module doc): the rows seen, the running pooled sums
    ``sum_e n_e H_e`` per projection, the owners below ``moe_min_tokens`` (solved last)."""

    def __init__(self, settings: RunSettings) -> None:
        self.settings = settings
        self.stats = ExpertStats()
        self.template: dict[str, str] = {"up_proj": "gate_proj"}  # ExpertMLP: gate and up read one tensor
        self.sums: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}
        self.low: dict[str, list[str]] = {}  # owner -> the names it owns, deferred to :meth:`rest`

    def part(self, layer, names, inputs, kwargs, **stat_kw) -> tuple[dict, dict, dict, ExpertStats]:
        """One part's statistics pass: the Hessians of its owners with enough rows (theirs to solve now),
        the owners of its names that have enough, its observers and the group's :class:`ExpertStats`."""
        accs, owner, observers, seen = _expert_pass(layer, names, inputs, kwargs, settings=self.settings,
                                                    **stat_kw)  # fmt: skip
        self.stats.tokens.update(seen.tokens)
        _own_uncalled(names, owner, self.template)
        for o in dict.fromkeys(owner[n] for n in names):  # the group's owner order
            n_o = seen.tokens.get(o, 0)
            if n_o > 0:
                p = _proj(o)
                add = accs[o].H * n_o
                self.sums[p] = add if p not in self.sums else self.sums[p] + add
                self.rows[p] = self.rows.get(p, 0) + n_o
            if _below(n_o, self.settings.moe_min_tokens, layer.get_submodule(o).in_features):
                accs.pop(o, None)
                self.low[o] = [n for n in names if owner[n] == o]
        ready = {n: o for n, o in owner.items() if o in accs}
        return accs, ready, observers, self.stats

    def rest(self) -> tuple[dict, dict]:
        """The deferred owners' pooled Hessians and the owner of each of their names (after every part)."""
        accs, owner, pooled = {}, {}, {}
        rule = self.settings.moe_fallback
        for o, names in self.low.items():
            p = _proj(o)
            self.stats.tokens.setdefault(o, 0)
            self.stats.fallback[o] = rule
            owner.update(dict.fromkeys(names, o))
            if rule in GRID_RULES:  # no Hessian: apply_grid_fallback swaps the method
                continue
            if p not in self.sums:
                raise _no_tokens(p)
            if p not in pooled:  # one tensor per projection: a DeepSeek-V3 layer's ~256 thin experts
                pooled[p] = self.sums[p] / self.rows[p]  # would otherwise hold 256 x 205 MB copies
            accs[o] = _Fixed(pooled[p])
        self.low, self.sums = {}, {}
        return accs, owner
