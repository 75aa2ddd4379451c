"""One decoder layer of the calibration pipeline: calibrate each group, solve, record, propagate.

:func:`quantize_layer` is the body of :func:`~bitmosaic.pipeline.pipeline.quantize_model`'s loop.
For layer ``li`` it

1. takes the layer (from the streaming store, if any) to the calibration device in the compute dtype;
2. runs the ``transform`` hooks (smoothing) on the float layer's group inputs and folds their factors;
3. for each true-sequential group (q/k/v -> o -> gate/up -> down): accumulates the group's Hessians
   (and static activation statistics) on the layer's current inputs (:func:`group_statistics`; linears
   fed the very same tensor share one), solves each Hessian's linears -- stacked row-wise when they
   resolve to the same method and config (:func:`~bitmosaic.pipeline.solve.quantize_shared`) -- and
   records each linear's report row; the dequantized weights go in place so later groups calibrate on
   quantized outputs, and finished modules' outputs are cached for the rest of the layer
   (:class:`OutputCache`);
4. runs the layer once more to make the next layer's inputs, each batch handed on as it is made;
5. moves the layer home, swaps in the packed modules (with their input quantizers and online
   rotations) and hands the finished layer to the store.

:class:`LayerRun` is what the loop carries from layer to layer (set up once by the driver).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from ..algorithms.lattice import order_bound_table
from ..devices import release_host_memory
from ..errors import OptionError, check_finite
from ..formats.grid import IntGrid
from ..models.arch import ArchSpec
from ..modules.actquant import attach_input_quant
from ..modules.rotation import carry_input_rotation
from .calibration import layer_kind
from .capture import capture_groups, run_layer
from .distributed import Dist
from .experts import ExpertPool, apply_grid_fallback, expert_parts, expert_statistics, is_expert_group
from .lazy_experts import WEIGHT_FRACTION, LazyExperts, expert_linears, expert_weight_bytes
from .report import RunReport
from .settings import RunSettings
from .smoothing import fold_group_scales
from .solve import Handed, HessianSpentError, SolveJob, quantize_shared
from .statistics import OutputCache, group_statistics, plain_child

__all__ = ["LayerRun", "quantize_layer", "transform_layer", "entry_key", "UNSMOOTHED_EXPERTS"]

# why a smoothing transform leaves the experts' groups alone (their report rows say it)
UNSMOOTHED_EXPERTS = (
    "experts left unsmoothed: one per-channel factor folded into the norm before them would be shared by "
    "every expert and the router, fitting no expert's routed tokens"
)


def entry_key(entry) -> tuple:
    """Identity of a resolved ``(Method, config)``: linears with equal keys may be stacked and share
    one run state."""
    method, config = entry
    return method.name, repr(config)


@dataclass
class LayerRun:
    """The run state the per-layer loop reads and updates (set up by the driver)."""

    arch: ArchSpec
    layers: list
    plans: list[dict]  # per layer: linear name -> (Method, config), or None (left in float)
    settings: RunSettings
    dev: torch.device
    cdtype: torch.dtype
    dist: Dist
    report: RunReport
    named: bool = False  # rows name their method (a recipe run)
    default: tuple | None = None  # the default (Method, config): the report's and a rotation's
    calibrate: bool = False
    local: torch.Tensor | None = None  # this rank's calibration tokens
    inputs: object = None  # LayerInputs: the current layer's calibration inputs
    kwargs_by_kind: dict | None = None
    runc: object = None  # the bound calibration cache (float layer 0's statistics)
    cache_budget_mb: float = 0.0
    states: dict = field(default_factory=dict)  # entry key -> the run state its prepare returned
    gen: torch.Generator | None = None
    store: object = None  # a streaming LayerStore, or None
    bar: object = None
    total_bits: float = 0.0
    total_weights: int = 0


@dataclass
class _Layer:
    """One layer's work in progress."""

    li: int
    module: nn.Module
    prefix: str
    plan: dict
    kwargs: list | None
    groups: tuple = ()  # the map's true-sequential groups for this layer (ArchSpec.groups)
    use_cache: bool = False
    group_info: dict = field(default_factory=dict)  # group index -> the transform's report entry
    folded: dict = field(default_factory=dict)  # group index -> the factors folded into its input
    qmods: dict = field(default_factory=dict)  # linear name -> packed module
    act_scales: dict = field(default_factory=dict)  # linear name -> static input scale (or None)
    experts: dict = field(default_factory=dict)  # group index -> ExpertStats of an expert group
    lazy: LazyExperts | None = None  # expert weights read part by part (lazy_experts.py)
    journal: object = None  # a streamed layer's finished units (journal.py)


def _budget(run: LayerRun) -> int:
    """The run's memory budget in bytes; a data-parallel run's is the least of its ranks' (every rank then
    cuts an expert group into the same parts, experts.py)."""
    budget = int(run.report.calibration["spill"]["budget_mb"] * 2**20)
    return min(run.dist.all_gather_object(budget)) if run.dist.world > 1 else budget


def _move(layer: nn.Module, device, dtype) -> None:
    """``layer.to(device, dtype)`` leaving ``meta`` parameters (experts not read yet) where they are."""

    def convert(t: torch.Tensor) -> torch.Tensor:
        return t if t.is_meta else t.to(device, dtype if t.is_floating_point() else None)

    layer._apply(convert)


def quantize_layer(run: LayerRun, li: int) -> None:
    """Quantize decoder layer ``li`` (module doc, steps 1-5)."""
    layer = run.layers[li]
    n_rows = len(run.report.layers)
    lazy = run.store is not None and run.calibrate and _lazy_wanted(run, layer)
    if run.store is not None:
        run.store.load(li, layer, skip=expert_linears(layer) if lazy else ())
    first_param = next(p for p in layer.parameters() if not p.is_meta)
    home, home_dtype = first_param.device, first_param.dtype
    if lazy:
        _move(layer, run.dev, run.cdtype)
    else:
        layer.to(run.dev, run.cdtype)
    kwargs = run.kwargs_by_kind[layer_kind(layer)] if run.calibrate else None
    plan = dict(run.plans[li])  # a copy: an expert's fallback may swap its entry (experts.py)
    lay = _Layer(li, layer, f"{run.arch.layers_path}.{li}", plan, kwargs, run.arch.groups(layer))
    if lazy:
        lay.lazy = LazyExperts(layer, run.store.reader(li), lay.qmods, run.cdtype, run.dev)
    if run.store is not None and run.calibrate:
        lay.journal = run.store.journal(li)
    if run.calibrate:
        runc0 = run.runc if li == 0 and run.dist.world == 1 else None  # later layers: quantized inputs
        lay.group_info = _apply_transform(run, lay, runc0)
        lay.use_cache = use_output_cache(run, layer)
    with OutputCache() as cache:
        for gi, group in enumerate(lay.groups):
            if group:  # a map's group this layer lacks (a dense MLP in an MoE layer) is empty
                _quantize_group(run, lay, gi, group, cache)
        if run.calibrate:
            with lay.lazy.per_call() if lay.lazy else contextlib.nullcontext():
                _propagate(run, lay, cache)
    release_host_memory()
    if lay.lazy:  # an expert projection left float (no plan) is saved as read
        for name in lay.lazy.names:
            if name not in lay.qmods:
                lay.lazy.read(name, layer.get_submodule(name))
    if lay.lazy:  # before the packed modules go in: their scales keep their dtype
        _move(layer, home, home_dtype)
    else:
        layer.to(home, home_dtype)
    for name, qlin in lay.qmods.items():
        act = getattr(lay.plan[name][1], "act", None)
        if act is not None:
            attach_input_quant(qlin, act, qlin.in_features, lay.act_scales[name])
        carry_input_rotation(layer.get_submodule(name), qlin)  # online rotation: still first
        layer.set_submodule(name, qlin.to(home))
    if run.store is not None:  # written, recorded as finished, and freed
        run.store.done(li, layer, run.report.layers[n_rows:], run.inputs, run.gen, run.total_bits,
                       run.total_weights)  # fmt: skip
        release_host_memory()


@dataclass
class _Group:
    """One true-sequential group's statistics: its Hessians (``accs``, by owner), which linears read
    each (``shared``), its input observers and the keywords that computed them (for a retry)."""

    index: int
    names: tuple
    accs: dict
    shared: dict
    observers: dict
    stat_kw: dict | None


def _lazy_wanted(run: LayerRun, layer: nn.Module) -> bool:
    """Whether a streamed ``layer``'s expert weights are read part by part (lazy_experts.py)."""
    return expert_weight_bytes(layer, run.cdtype) > WEIGHT_FRACTION * _budget(run)


def _resident(lay: _Layer, names):
    """The experts of ``names`` in memory for the block (a lazily read layer), else nothing to do."""
    return lay.lazy.resident(names) if lay.lazy is not None else contextlib.nullcontext()


def _quantize_group(run: LayerRun, lay: _Layer, gi: int, group, cache: OutputCache) -> None:
    """Calibrate group ``gi``, solve each of its Hessians' linears, record the rows, cache what is final."""
    run.bar.set_postfix_str(f"{lay.li}.{'/'.join(n.rsplit('.', 1)[-1] for n in group)}")
    parts, pool = [group], None
    if run.calibrate and is_expert_group(lay.module, group):  # experts in parts past the budget (experts.py)
        weights = 0
        if lay.lazy is not None:  # the float weights of one expert come with its Hessians
            one = lay.lazy.experts_of(group[:1])
            weights = sum(p.numel() for n in one for p in lay.module.get_submodule(n).parameters())
            weights *= torch.empty((), dtype=run.cdtype).element_size()
        parts = expert_parts(lay.module, group, _budget(run), run.settings.hessian_dtype, weights)
        pool = ExpertPool(run.settings) if len(parts) > 1 else None
    for part in parts:
        with _resident(lay, part):
            grp = _statistics(run, lay, gi, part, cache, pool)
            _solve_group(run, lay, gi, grp)
            del grp
        release_host_memory()  # the part's Hessians (and float experts)
    if pool is not None:  # the experts with too few rows, on the pooled Hessian of every part
        accs, owner = pool.rest()
        apply_grid_fallback(lay.plan, pool.stats, owner)
        shared: dict[str, list[str]] = {}
        for name, own in owner.items():
            shared.setdefault(own, []).append(name)
        per_part = max(len({n.rsplit(".", 1)[0] for n in p}) for p in parts) if lay.lazy else len(shared)
        owners = list(shared)  # a lazily read layer: as many float experts at once as a part has
        for i in range(0, len(owners), max(per_part, 1)):
            chunk = {o: shared[o] for o in owners[i : i + per_part]}
            names = tuple(n for ns in chunk.values() for n in ns)
            with _resident(lay, names):
                sub = {o: accs[o] for o in chunk if o in accs}
                _solve_group(run, lay, gi, _Group(gi, names, sub, chunk, {}, None))
    if lay.use_cache and gi < len(lay.groups) - 1:  # quantized or skipped: final from now on
        if not is_expert_group(lay.module, group):  # an expert may run twice a batch (--moe-calib all)
            for name in group:
                cache.install(lay.module.get_submodule(name))
        for child in _finished_children(lay.module, lay.groups, gi):
            cache.install(child)
    release_host_memory()  # the heap pages this group's temporaries freed


def _solve_group(run: LayerRun, lay: _Layer, gi: int, grp: _Group) -> None:
    """Solve each of the group's Hessians' linears and record their rows.  In a streamed layer each
    Hessian's solved linears are journaled, and those a killed run journaled are installed instead of
    solved again (journal.py)."""
    for own, names in grp.shared.items():
        planned = [n for n in names if lay.plan[n] is not None]
        if lay.journal is not None and len(lay.journal) and lay.journal.solved(planned):
            for name, qlin, row, scale in lay.journal.take(planned):
                _install(run, lay, name, qlin, row, scale, in_place=True)
            continue
        done = _solve_hessian(run, lay, grp, own, names)
        for entry in done:
            _record(run, lay, gi, entry, grp.observers)
        if lay.journal is not None:
            lay.journal.add([(e[4], e[5], e[6], lay.act_scales.get(e[4])) for e in done])


def _statistics(run: LayerRun, lay: _Layer, gi: int, group, cache: OutputCache, pool=None) -> _Group:
    """The group's Hessians and observers on the layer's current inputs (none for a run that does not
    calibrate: each linear then solves alone); ``pool``: an :class:`ExpertPool` when the group is one
    part of an expert group (its owners with too few rows are left to the pool)."""
    if not run.calibrate:
        return _Group(gi, group, {}, {name: [name] for name in group}, {}, None)
    plan = lay.plan
    observe = _static_act(plan, group, lay.prefix) or any(
        getattr(plan[n][1], "needs_act_stats", False) for n in group if plan[n]
    )
    stat_kw = dict(hessian_dtype=run.settings.hessian_dtype, cache=cache if lay.use_cache else None,
                   observe=observe, dist=run.dist)  # fmt: skip
    if is_expert_group(lay.module, group):
        del stat_kw["hessian_dtype"]  # the settings' own
        if pool is not None:
            accs, owner, observers, seen = pool.part(lay.module, group, run.inputs, lay.kwargs, **stat_kw)
        stat_kw["settings"] = run.settings
        if pool is None:
            accs, owner, observers, seen = expert_statistics(lay.module, group, run.inputs, lay.kwargs,
                                                             **stat_kw)  # fmt: skip
        lay.experts[gi] = seen
        apply_grid_fallback(plan, seen, owner)  # experts too thin for their own statistics (experts.py)
    else:
        accs, owner, observers = group_statistics(lay.module, group, run.inputs, lay.kwargs, **stat_kw)
    shared: dict[str, list[str]] = {}
    for name in group:
        if name in owner:  # not: a part's expert with too few rows (solved last, by the pool)
            shared.setdefault(owner[name], []).append(name)
    return _Group(gi, group, accs, shared, observers, stat_kw)


def _solve_hessian(run: LayerRun, lay: _Layer, grp: _Group, own: str, names: list[str]) -> list[tuple]:
    """Solve the linears ``names`` that read Hessian ``own``: one call per distinct (method, config)."""
    H = grp.accs[own].H if own in grp.accs else None
    if H is not None:
        check_finite(H, f"the calibration inputs of {lay.prefix}.{own}")
    by_key: dict[tuple, list[str]] = {}  # stacked only with the same method + config
    for n in names:
        if lay.plan[n] is not None:
            by_key.setdefault(entry_key(lay.plan[n]), []).append(n)
    # H is no one's after a lone solve: the solver may overwrite it (solve.py)
    lone = len(grp.shared) == 1 and len(by_key) == 1 and not run.settings.analyze_orders
    lone = lone and run.dist.world == 1
    if lone and H is not None:  # handed over: no reference stays here (solve.py)
        H = Handed(grp.accs.pop(own).take())
    done = []
    for key, sub in by_key.items():
        m, c = lay.plan[sub[0]]
        job = SolveJob(m, c, lay.module, sub, lay.prefix, run.settings.check_packing, grp.observers.get(own),
                       run.states.get(key), run.dist, lay.folded.get(grp.index))  # fmt: skip
        try:
            rows = quantize_shared(job, H, disposable=lone)
        except HessianSpentError:  # needs a retry with more damping: a kept H
            again = expert_statistics if is_expert_group(lay.module, grp.names) else group_statistics
            H = again(lay.module, grp.names, run.inputs, lay.kwargs, **grp.stat_kw)[0][own].H
            rows = quantize_shared(job, H)
        done += [(own, m, c, None if lone else H, *r) for r in rows]
    return done


def _record(run: LayerRun, lay: _Layer, gi: int, entry: tuple, observers: dict) -> None:
    """One solved linear's report row, bits and input quantizer."""
    own, m, c, H, name, qlin, row = entry
    act = getattr(c, "act", None)
    seen = lay.experts.get(gi)
    if run.named or (seen is not None and own in seen.fallback):  # a fallback may change the method
        row["method"] = m.name
    if act is not None:
        row["act"] = act.label
    if lay.group_info.get(gi):
        row["transform"] = lay.group_info[gi]
    if seen is not None:  # an expert projection: the rows routed to it, and its fallback rule if any
        row["expert_tokens"] = seen.tokens.get(own, 0)
        if own in seen.fallback:
            row["expert_fallback"] = seen.fallback[own]
    orders = run.settings.analyze_orders
    if orders and H is not None:
        grid = IntGrid(c.bits, c.symmetric)
        W = lay.module.get_submodule(name).weight.data.float()
        row["order_bounds"] = order_bound_table(W, H, grid, c.group_size, tuple(orders), percdamp=c.percdamp)
    scale = observers[own].static_scale() if act is not None and act.static else None
    _install(run, lay, name, qlin, row, scale)


def _install(run: LayerRun, lay: _Layer, name: str, qlin: nn.Module, row: dict, scale,
             in_place: bool = False) -> None:  # fmt: skip
    """A solved linear's row, bits, packed module and input quantizer (with static ``scale``);
    ``in_place``: also put its dequantized weights in place, as the solve does (a journaled linear)."""
    run.report.layers.append(row)
    run.total_bits += row["bits_per_weight"] * qlin.in_features * qlin.out_features
    run.total_weights += qlin.in_features * qlin.out_features
    lay.qmods[name] = qlin
    lin = lay.module.get_submodule(name)
    if in_place:  # the packing check made these the solve's own values (solve.py)
        lin.weight.data.copy_(qlin.dequantize_weight(torch.float32).to(lin.weight.device, lin.weight.dtype))
    act = getattr(lay.plan[name][1], "act", None)
    if act is not None:  # later groups and the next layer see quantized inputs
        lay.act_scales[name] = scale
        attach_input_quant(lin, act, lin.in_features, scale).to(run.dev)


def _propagate(run: LayerRun, lay: _Layer, cache: OutputCache) -> None:
    """The next layer's inputs, each batch handed on as soon as it is made."""
    inputs = run.inputs
    with torch.inference_mode():
        for b in range(len(inputs)):  # no iterator keeps the last batch alive
            cache.batch = b
            y = run_layer(lay.module, inputs.get(b), lay.kwargs[b])
            check_finite(y, f"the outputs of {lay.prefix} (calibration batch {b})")
            cache.release(b)  # this batch's cached outputs are not needed again
            inputs.set(b, y)  # input b is not read again
            release_host_memory()
            y = None
        inputs.advance()


def transform_layer(layer: nn.Module, arch: ArchSpec, plan: dict, inputs, kwargs: list,
                    gen) -> dict[int, dict]:  # fmt: skip
    """Step 2 (module doc) on one float ``layer`` outside a run: the ``transform`` hooks of the methods
    ``plan`` gives its linears, on ``inputs`` (its calibration inputs, one tensor per batch) drawing
    token samples from ``gen``; the factors are folded in.  The report entry per group."""
    from .distributed import current

    run = LayerRun(arch, [layer], [plan], RunSettings(), torch.device("cpu"), torch.float32, current(), None,
                   inputs=inputs, gen=gen)  # fmt: skip
    lay = _Layer(0, layer, f"{arch.layers_path}.0", plan, kwargs, arch.groups(layer))
    return _apply_transform(run, lay, None)


def _apply_transform(run: LayerRun, lay: _Layer, runc) -> dict[int, dict]:
    """Run the per-layer ``transform`` of the method each group's linears use and fold the factors
    it returns (into ``lay.folded``); the report entry per group.  A group is transformed only when
    all its linears resolve to one (method, config) that has a transform (skipped linears and mixed
    groups stay unsmoothed).  ``runc``: the run's calibration cache, for the float layer 0 (its
    statistics may be cached).  In a data-parallel run the statistics are reduced and each capture's
    transform runs on one rank."""
    plan, arch, dist = lay.plan, run.arch, run.dist
    todo: dict[tuple, list[int]] = {}
    info: dict[int, dict] = {}
    for gi, group in enumerate(lay.groups):
        keys = {entry_key(plan[n]) if plan[n] else None for n in group}
        if not (group and len(keys) == 1 and None not in keys and plan[group[0]][0].has_transform):
            continue
        if is_expert_group(lay.module, group):  # said in the group's report rows
            info[gi] = {"folded": False, "unsmoothed": UNSMOOTHED_EXPERTS}
        else:
            todo.setdefault(keys.pop(), []).append(gi)
    if not todo:
        return info
    by_key = {entry_key(p): p for p in plan.values() if p}
    max_tokens = max(getattr(by_key[k][1], "max_tokens", 2048) for k in todo)
    cap_args = (lay.module, arch, run.inputs, lay.kwargs)
    if runc is not None:
        caps = runc.group_captures(*cap_args, max_tokens=max_tokens, generator=run.gen)
    else:
        caps = capture_groups(*cap_args, max_tokens=max_tokens, generator=run.gen, dist=dist)
    for cap in caps:
        cap.prefix = lay.prefix
    for key, gis in todo.items():
        method, config = by_key[key]
        mine = [cap for cap in caps if cap.index in gis]
        state = run.states.get(key)
        if dist.world > 1:  # the hook's contract: one result per capture
            one = lambda cap, m=method, c=config, st=state: m.transform([cap], c, st)[0]  # noqa: E731
            results = dist.map_owned(mine, one)
        else:
            results = method.transform(mine, config, state)
        for cap, (s, row) in zip(mine, results, strict=True):
            if s is not None:
                fold_group_scales(lay.module, arch, cap.index, s)
                lay.folded[cap.index] = s
            info[cap.index] = {**row, "folded": s is not None}
    return info


def _static_act(plan: dict, group, prefix: str):
    """The static activation quantizer the group's statistics observe (one per group)."""
    specs = {repr(a): a for n in group if plan[n] and (a := getattr(plan[n][1], "act", None)) and a.static}
    if len(specs) > 1:
        raise OptionError(
            f"linears of {prefix} that read one input ({', '.join(group)}) were given different static "
            "activation quantizers; give them the same act settings in the recipe"
        )
    return next(iter(specs.values()), None)


def _finished_children(layer: nn.Module, groups: tuple, gi: int) -> list[nn.Module]:
    """Direct children of ``layer`` (e.g. ``self_attn``) whose quantized linears are all in groups
    ``<= gi``: their inputs and weights are final, so their whole output can be cached (the
    attention itself is then computed once per layer, not once per later group)."""
    done = {n for g in groups[: gi + 1] for n in g}
    pending = {n for g in groups[gi + 1 :] for n in g}
    out = []
    for cname, child in layer.named_children():
        mine = {n for n in done | pending if n.startswith(cname + ".")}
        if mine and mine <= done and not isinstance(child, nn.Linear):
            out.append(child)
    return out


def use_output_cache(run: LayerRun, layer: nn.Module) -> bool:
    """Whether ``layer``'s quantized linears' outputs are cached (``cache_outputs``, or when they fit the
    output cache's budget)."""
    if run.settings.cache_outputs is not None:
        return bool(run.settings.cache_outputs)
    groups = run.arch.groups(layer)
    width = sum(layer.get_submodule(n).weight.shape[0] for g in groups[:-1] for n in g
                if not is_expert_group(layer, (n,)))  # an expert's outputs: its routed rows only
    first = next((n for g in groups for n in g), None)
    if first is not None:  # the children without matrices (norms) are cached at the hidden width
        width += layer.get_submodule(first).weight.shape[1] * sum(map(plain_child, layer.children()))
    return run.local.numel() * width * 4 / 2**20 <= run.cache_budget_mb
