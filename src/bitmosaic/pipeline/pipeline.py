"""The sequential layer-by-layer calibration pipeline, on the CPU or a GPU.

1. Capture the decoder-layer inputs (:func:`~bitmosaic.pipeline.calibration.capture_layer_inputs`).
2. For each decoder layer: move it to the calibration ``device``; for each true-sequential group
   (q/k/v -> o -> gate/up -> down) accumulate ``H = 2/n sum x x^T`` in float32 on the device
   (modules fed the very same tensor share one Hessian), stopping the layer's forward as soon as
   the group's inputs are seen; quantize the group's linears with the chosen method -- linears
   that share a Hessian are stacked row-wise into one matrix when the method quantizes rows
   independently (GPTQ, Babai, RTN), so the factorisation, order and column loop run once per
   group -- and put the dequantized weights in place so the next group calibrates on quantized
   outputs.
3. Run the layer once more to produce the next layer's inputs, swap in the packed modules and
   move the layer back to host memory.

The model stays in host memory; peak device memory is about one decoder layer, its Hessians and
the calibration activations (which are offloaded to host memory, batch by batch, when they would
not fit: ``offload_inputs``).  In host memory they spill to files when they would take over 40% of
the memory budget (``max_memory``; :mod:`bitmosaic.pipeline.spill`), read back one batch at a time.
Methods with a ``transform`` hook (smoothing) first see the float layer's group inputs and return
per-channel factors that are folded into the preceding ops.
With activation quantization (``config.act``) each linear's static input scale is calibrated on
its inputs as they arrive and an input quantizer is attached once it is quantized.

With a calibration cache (:mod:`bitmosaic.pipeline.calib_cache`), step 1's captured inputs, the
float layer 0's transform statistics and the Fisher salience -- the statistics of the float model,
the only ones methods can share -- come from disk when an earlier run stored them (bit-identical).

Methods that need no Hessian (``needs_hessian = False``, e.g. round-to-nearest) skip calibration
entirely unless something else needs it (static activation scales, a transform,
``analyze_orders``); their report rows then have no error metrics.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from tqdm.auto import tqdm

from ..algorithms.lattice import order_bound_table
from ..devices import release_host_memory, resolve_device
from ..errors import OptionError, check_finite
from ..formats.grid import IntGrid
from ..methods.base import Method, MethodContext, WeightQuantConfig
from ..models.arch import ArchSpec, get_arch
from ..modules.actquant import attach_input_quant
from ..modules.rotation import carry_input_rotation
from .calib_cache import CalibCache
from .calibration import (
    OutputCache,
    StopForward,
    capture_layer_inputs,
    cast_floating,
    first_layer_inputs,
    group_statistics,
    layer_kind,
)
from .capture import capture_groups, run_layer
from .distributed import Dist, current
from .fisher import fisher_service
from .report import RunReport, peak_rss_mb
from .rotate import rotate_model
from .smoothing import fold_group_scales
from .solve import Handed, HessianSpentError, quantize_shared
from .spill import SPILL_FRACTION, parse_size

__all__ = [
    "StopForward",
    "RunReport",
    "quantize_model",
    "peak_rss_mb",
    "capture_layer_inputs",
]


def _apply_transform(
    plan: dict, layer, arch, inputs, kwargs, gen, prefix: str = "", runc=None, states=None, dist=None,
    folded: dict | None = None,
) -> dict[int, dict]:  # fmt: skip
    """Run the per-layer ``transform`` of the method each group's linears use and fold the factors
    it returns; info per group.  A group is transformed only when all its linears resolve to one
    (method, config) that has a transform (skipped linears and mixed groups stay unsmoothed).
    ``runc``: the run's calibration cache, for the float layer 0 (its statistics may be cached);
    ``states``: the run state each (method, config) key's ``prepare`` returned; ``dist``: a
    data-parallel run's rank (statistics reduced, each capture's transform run by one rank);
    ``folded``: filled with the factors folded into each group's input (``{group: s}``)."""
    todo: dict[tuple, list[int]] = {}
    for gi, group in enumerate(arch.sequential):
        keys = {_key(plan[n]) if plan[n] else None for n in group}
        if len(keys) == 1 and None not in keys and plan[group[0]][0].has_transform:
            todo.setdefault(keys.pop(), []).append(gi)
    if not todo:
        return {}
    by_key = {_key(p): p for p in plan.values() if p}
    max_tokens = max(getattr(by_key[k][1], "max_tokens", 2048) for k in todo)
    if runc is not None:
        caps = runc.group_captures(layer, arch, inputs, kwargs, max_tokens=max_tokens, generator=gen)
    else:
        caps = capture_groups(layer, arch, inputs, kwargs, max_tokens=max_tokens, generator=gen, dist=dist)
    for cap in caps:
        cap.prefix = prefix
    info: dict[int, dict] = {}
    for key, gis in todo.items():
        method, config = by_key[key]
        mine = [cap for cap in caps if cap.index in gis]
        state = (states or {}).get(key)
        if dist is not None and dist.world > 1:  # the hook's contract: one result per capture
            one = lambda cap, m=method, c=config, st=state: m.transform([cap], c, st)[0]  # noqa: E731
            results = dist.map_owned(mine, one)
        else:
            results = method.transform(mine, config, state)
        for cap, (s, row) in zip(mine, results, strict=True):
            if s is not None:
                fold_group_scales(layer, arch, cap.index, s)
                if folded is not None:
                    folded[cap.index] = s
            info[cap.index] = {**row, "folded": s is not None}
    return info


def _key(entry) -> tuple:
    """Identity of a resolved ``(Method, config)``: linears with equal keys may be stacked and share
    one run state."""
    method, config = entry
    return method.name, repr(config)


def _static_act(plan: dict, group, prefix: str):
    """The static activation quantizer the group's statistics observe (one per group)."""
    specs = {repr(a): a for n in group if plan[n] and (a := getattr(plan[n][1], "act", None)) and a.static}
    if len(specs) > 1:
        raise OptionError(
            f"linears of {prefix} that read one input ({', '.join(group)}) were given different static "
            "activation quantizers; give them the same act settings in the recipe"
        )
    return next(iter(specs.values()), None)


def quantize_model(
    model: nn.Module,
    calib: torch.Tensor,
    method: Method,
    config: WeightQuantConfig,
    *,
    arch: ArchSpec | None = None,
    batch_size: int = 4,
    hessian_dtype: torch.dtype = torch.float32,
    progress: bool = True,
    cache_outputs: bool | None = None,
    cache_budget_mb: float = 1024.0,
    analyze_orders: tuple[str, ...] | None = None,
    seed: int = 0,
    device: str | torch.device | None = None,
    offload_inputs: bool | None = None,
    check_packing: bool = True,
    measure_errors: bool = False,
    compute_dtype: torch.dtype | None = None,
    resolve=None,
    method_inputs: dict | None = None,
    calib_cache: CalibCache | None = None,
    more_calib=None,
    store=None,
    dist: Dist | None = None,
    max_memory: int | str | None = None,
    spill_dir=None,
    rotate: str = "none",
) -> RunReport:
    """Quantize every linear of ``model``'s decoder layers in place; return the run report.

    ``device``: where calibration and the solvers run (``None``: where the model is; ``"auto"``:
    CUDA when available).  Each decoder layer is moved there for its turn and back afterwards.
    ``offload_inputs``: keep the calibration activations in host memory (``None``: when they would
    not fit comfortably on the device).  ``cache_outputs`` keeps quantized linears' outputs for the
    rest of their layer (exact; see :class:`~bitmosaic.pipeline.calibration.OutputCache`); ``None``
    turns it on when that takes at most ``cache_budget_mb`` and 40% of ``max_memory`` (below).
    ``analyze_orders`` adds, per layer, the Babai bound and the measured no-clip GPTQ error under
    each named order.  ``seed`` fixes
    the token samples a ``transform`` draws.  ``check_packing`` verifies every packed module
    against the simulated weights.  ``measure_errors`` calibrates even methods that need no
    Hessian (RTN, FP8), so their report rows get the error metrics too.  ``compute_dtype``: the
    dtype a decoder layer is cast to while it is calibrated (``None``: float32 on the CPU, whose
    bfloat16 matmuls are slow, else the model's own dtype); the model keeps its dtype.
    ``resolve``: qualified linear name -> ``(Method, config)``, or ``None`` to leave that linear
    in float (a recipe, :mod:`bitmosaic.pipeline.recipe`); ``None`` = ``(method, config)`` for all.
    Linears sharing a Hessian are stacked only when they resolve to the same method and config.
    ``method_inputs``: extra inputs for the methods' ``prepare`` hooks (each method's
    ``prepare_inputs`` names the ones it takes), run once per (method, config) on the float model
    before anything else; ``more_calib(n)``: ``n`` calibration samples drawn like ``calib``, for a
    prepare step that asks for more samples than ``calib`` has (e.g. for its Fisher salience).
    ``calib_cache``: a :class:`~bitmosaic.pipeline.calib_cache.CalibCache` for the float-model
    statistics runs can share (layer-0 inputs, layer 0's transform statistics, Fisher); results are
    bit-identical with and without it; ``report.calibration["cache"]`` lists its hits.
    ``store``: where decoder layers come from and go to, one at a time (streaming, with resume:
    :class:`bitmosaic.pipeline.stream.LayerStore`); ``None``: the model holds every layer.
    ``dist``: this process's rank of a data-parallel run (default: the ``torch.distributed``
    process group when one is initialised, e.g. under ``torchrun``; see
    :mod:`bitmosaic.pipeline.distributed`): each rank calibrates on its share of the batches, the
    statistics are reduced, the solves spread over the ranks, and every rank ends with the same
    quantized model; only rank 0 shows progress.  The calibration cache then serves the Fisher
    salience only.  ``max_memory``: the host-memory budget (bytes, or a size such as ``"8GB"``:
    :func:`~bitmosaic.pipeline.spill.parse_size`; ``None``: the memory available when the run
    starts); when one layer's calibration activations, in and out, would take over 40% of it they
    spill to files in a temporary folder made in ``spill_dir`` (default: a streaming ``store``'s
    work folder, else the system's temporary folder) and are read back one batch at a time
    (:mod:`bitmosaic.pipeline.spill`; the same bytes result).  ``report.calibration["spill"]`` says
    whether they spilled and where; the folder is removed when the run ends, also on an error.
    ``rotate``: ``"hadamard"``, ``"random"`` or ``"spinquant[:steps=N,lr=X,batch=B]"`` (learned on ``calib``
    against ``config.act``, on ``device``) first folds QuaRot's rotations into the float model
    (:mod:`bitmosaic.pipeline.rotate`; ``model.bitmosaic_rotation`` and
    ``report.calibration["rotation"]`` record them, a saved model re-applies the online ones on load).
    """
    t0 = time.perf_counter()
    budget = parse_size(max_memory)  # a bad size fails before any work
    arch = arch or get_arch(model)
    if rotate not in (None, "none") and store is not None:
        raise OptionError(
            f"--rotate {rotate} rotates the whole float model before calibration, which a streamed run "
            "(one layer in memory at a time) cannot do; use --stream off"
        )
    dev = resolve_device(device, model)
    act = getattr(config, "act", None)  # what a learned rotation (--rotate spinquant) is learned against
    rotation = rotate_model(
        model, arch, rotate or "none", seed, calib=calib, act=act, progress=progress, device=dev
    )
    if rotation:
        model.bitmosaic_rotation = rotation
    layers = arch.layers(model)
    cdtype = _compute_dtype(compute_dtype, model, dev)
    dist = dist or current()
    local = dist.split(calib, batch_size)  # this rank's calibration batches (all of them alone)
    progress = progress and dist.is_main
    model.eval()
    resolver = resolve or (lambda name: (method, config))
    plans = [
        {n: resolver(f"{arch.layers_path}.{li}.{n}") for g in arch.sequential for n in g}
        for li in range(len(layers))
    ]
    entries = [e for plan in plans for e in plan.values() if e]
    report = RunReport(method=method.name, config=config.to_dict(), device=str(dev))
    report.calibration = {"samples": int(calib.shape[0]), "seqlen": int(calib.shape[1])}
    if rotation:
        report.calibration["rotation"] = {
            "kind": rotation["kind"], "seed": rotation["seed"], "online": len(rotation["online"]),
            "untied_head": rotation["untied"],
        }  # fmt: skip
        if "learned" in rotation:  # --rotate spinquant: its steps, rate and first/last loss
            report.calibration["rotation"]["learned"] = rotation["learned"]
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    calibrate = bool(analyze_orders) or measure_errors
    for m, c in entries:
        static = getattr(c, "act", None) is not None and c.act.static
        calibrate = calibrate or m.needs_hessian or m.has_transform or static
    inputs = kwargs_by_kind = None
    runc = None
    if calibrate:
        cache0 = calib_cache if dist.world == 1 else None  # a rank's own statistics: not shareable
        runc = (cache0 or CalibCache(None)).bind(
            model, layers, local, batch_size=batch_size, device=dev, compute_dtype=cdtype, seed=seed
        )
        where = spill_dir if spill_dir is not None else getattr(store, "work", None)
        inputs, kwargs_by_kind, report.calibration["spill"] = first_layer_inputs(
            model, layers, local, batch_size, dev, cdtype, runc, offload_inputs, budget, where
        )
        offload_inputs = inputs.offload
        # the output cache holds every batch's linear outputs: no more of the budget than the activations
        cache_budget_mb = min(cache_budget_mb, SPILL_FRACTION * report.calibration["spill"]["budget_mb"])
        kwargs_by_kind = {k: [cast_floating(kw, dev, cdtype) for kw in v] for k, v in kwargs_by_kind.items()}
        use0 = _use_cache(cache_outputs, cache_budget_mb, local, layers[0], arch)
        report.calibration["output_cache"] = use0
    report.calibration["calibrated"] = calibrate
    report.calibration["compute_dtype"] = str(cdtype).replace("torch.", "")
    report.calibration["offload_inputs"] = bool(offload_inputs) if calibrate else None
    try:
        fisher = fisher_service(model, calib, progress, calib_cache, more_calib, dist)
        contexts, states = _prepare(model, calib, plans, arch, progress, method_inputs or {}, fisher)
        for ctx in contexts.values():
            report.calibration.update(ctx._record)
        gen = torch.Generator().manual_seed(seed)
        total_bits = 0.0
        total_weights = 0
        start = 0
        if store is not None:  # layers an earlier, interrupted run finished: their rows, RNG and outputs
            start, total_bits, total_weights = store.resume(report, gen, inputs)
        desc = f"{method.name} {config.scheme}"
        bar = tqdm(range(start, len(layers)), desc=desc, unit="layer", disable=not progress, initial=start,
                   total=len(layers))  # fmt: skip
        for li in bar:
            layer = layers[li]
            n_rows = len(report.layers)
            if store is not None:
                store.load(li, layer)
            first_param = next(layer.parameters())
            home, home_dtype = first_param.device, first_param.dtype
            layer.to(dev, cdtype)
            prefix = f"{arch.layers_path}.{li}"
            plan = plans[li]
            qmods: dict[str, nn.Module] = {}
            act_scales: dict[str, torch.Tensor | None] = {}
            kwargs = kwargs_by_kind[layer_kind(layer)] if calibrate else None
            group_info, folded = {}, {}
            if calibrate:
                runc0 = runc if li == 0 and dist.world == 1 else None  # later layers: quantized inputs
                group_info = _apply_transform(plan, layer, arch, inputs, kwargs, gen, prefix, runc0, states,
                                              dist, folded)  # fmt: skip
            use_cache = calibrate and _use_cache(cache_outputs, cache_budget_mb, local, layer, arch)
            with OutputCache() as cache:
                for gi, group in enumerate(arch.sequential):
                    bar.set_postfix_str(f"{li}.{'/'.join(n.rsplit('.', 1)[-1] for n in group)}")
                    if calibrate:
                        stat_kw = dict(
                            hessian_dtype=hessian_dtype,
                            cache=cache if use_cache else None,
                            act_spec=_static_act(plan, group, prefix),
                            observe=any(getattr(plan[n][1], "needs_act_stats", False)
                                        for n in group if plan[n]),  # fmt: skip
                            dist=dist,
                        )
                        accs, owner, observers = group_statistics(layer, group, inputs, kwargs, **stat_kw)
                        shared: dict[str, list[str]] = {}
                        for name in group:
                            shared.setdefault(owner[name], []).append(name)
                    else:
                        accs, observers = {}, {}
                        shared = {name: [name] for name in group}
                    done = []
                    for own, names in shared.items():
                        H = accs[own].H if own in accs else None
                        if H is not None:
                            check_finite(H, f"the calibration inputs of {prefix}.{own}")
                        by_key: dict[tuple, list[str]] = {}  # stacked only with the same method + config
                        for n in names:
                            if plan[n] is not None:
                                by_key.setdefault(_key(plan[n]), []).append(n)
                        # H is no one's after a lone solve: the solver may overwrite it (solve.py)
                        lone = len(shared) == 1 and len(by_key) == 1 and not analyze_orders
                        lone = lone and dist.world == 1
                        if lone and H is not None:  # handed over: no reference stays here (solve.py)
                            H = Handed(accs.pop(own).take())
                        for sub in by_key.values():
                            m, c = plan[sub[0]]
                            pd = c.percdamp  # WeightQuantConfig: every method config
                            args = (m, c, layer, sub, H, pd, prefix, check_packing, observers.get(own),
                                    states.get(_key(plan[sub[0]])), dist)  # fmt: skip
                            try:
                                rows = quantize_shared(*args, disposable=lone, input_scales=folded.get(gi))
                            except HessianSpentError:  # needs a retry with more damping: a kept H
                                H = group_statistics(layer, group, inputs, kwargs, **stat_kw)[0][own].H
                                rows = quantize_shared(*args[:4], H, *args[5:], input_scales=folded.get(gi))
                            done += [(own, m, c, None if lone else H, *r) for r in rows]
                    for own, m, c, H, name, qlin, row in done:
                        act = getattr(c, "act", None)
                        if resolve is not None:
                            row["method"] = m.name
                        if act is not None:
                            row["act"] = act.label
                        if group_info.get(gi):
                            row["transform"] = group_info[gi]
                        if analyze_orders and H is not None:
                            grid = IntGrid(c.bits, c.symmetric)
                            W = layer.get_submodule(name).weight.data.float()
                            pd = c.percdamp  # WeightQuantConfig: every method config
                            row["order_bounds"] = order_bound_table(
                                W, H, grid, c.group_size, tuple(analyze_orders), percdamp=pd
                            )
                        report.layers.append(row)
                        total_bits += row["bits_per_weight"] * qlin.in_features * qlin.out_features
                        total_weights += qlin.in_features * qlin.out_features
                        qmods[name] = qlin
                        lin = layer.get_submodule(name)
                        if act is not None:  # later groups and the next layer see quantized inputs
                            act_scales[name] = observers[own].static_scale() if act.static else None
                            attach_input_quant(lin, act, lin.in_features, act_scales[name]).to(dev)
                    for name in group:  # quantized or skipped: final from now on
                        if use_cache and gi < len(arch.sequential) - 1:
                            cache.install(layer.get_submodule(name))
                    if use_cache and gi < len(arch.sequential) - 1:
                        for child in _finished_children(layer, arch, gi):
                            cache.install(child)
                    del accs
                    release_host_memory()  # the heap pages this group's temporaries freed
                if calibrate:  # the next layer's inputs, each batch handed on as soon as it is made
                    with torch.inference_mode():
                        for b in range(len(inputs)):  # no iterator keeps the last batch alive
                            cache.batch = b
                            y = run_layer(layer, inputs.get(b), kwargs[b])
                            check_finite(y, f"the outputs of {prefix} (calibration batch {b})")
                            cache.release(b)  # this batch's cached outputs are not needed again
                            inputs.set(b, y)  # input b is not read again
                            release_host_memory(grown_mb=64)
                            y = None
                        inputs.advance()
            release_host_memory()
            layer.to(home, home_dtype)  # before the packed modules go in: their scales keep their dtype
            for name, qlin in qmods.items():
                act = getattr(plan[name][1], "act", None)
                if act is not None:
                    attach_input_quant(qlin, act, qlin.in_features, act_scales[name])
                carry_input_rotation(layer.get_submodule(name), qlin)  # online rotation: still first
                layer.set_submodule(name, qlin.to(home))
            if store is not None:  # written, recorded as finished, and freed
                store.done(li, layer, report.layers[n_rows:], inputs, gen, total_bits, total_weights)
                release_host_memory()
        for key, ctx in contexts.items():
            m, c = ctx.entry
            ctx._record.clear()
            m.finalize(model, c, states.get(key), ctx)
            report.calibration.update(ctx._record)
        if calib_cache is not None:
            report.calibration["cache"] = calib_cache.summary()
        report.seconds = time.perf_counter() - t0
        report.peak_rss_mb = peak_rss_mb()
        if dist.world > 1:
            every = dist.all_gather_object((report.seconds, report.peak_rss_mb, local.shape[0]))
            report.calibration["distributed"] = {
                "world": dist.world,
                "batches": dist.batches,
                "samples_per_rank": [e[2] for e in every],
                "seconds_per_rank": [e[0] for e in every],
                "peak_rss_mb_per_rank": [e[1] for e in every],
            }
        if dev.type == "cuda":
            report.peak_device_mb = torch.cuda.max_memory_allocated(dev) / 2**20
        report.bits_per_weight = total_bits / max(total_weights, 1)
        return report
    finally:
        if inputs is not None:
            inputs.close()  # the spill files go however the run ends


def _prepare(model, calib, plans, arch, progress, inputs, fisher):
    """One :class:`MethodContext` per distinct (method, config) of the run and, for methods with a
    ``prepare`` hook, its run state (computed here, on the float model, before any calibration).
    Inputs that no method of the run takes are an error."""
    names: dict[tuple, list[str]] = {}
    entries: dict[tuple, tuple] = {}
    for li, plan in enumerate(plans):
        for n, e in plan.items():
            if e:
                names.setdefault(_key(e), []).append(f"{arch.layers_path}.{li}.{n}")
                entries.setdefault(_key(e), e)
    wanted = {i for m, _ in entries.values() for i in m.prepare_inputs}
    unused = sorted(k for k, v in inputs.items() if v is not None and k not in wanted)
    if unused:
        run = ", ".join(sorted({m.name for m, _ in entries.values()}))
        raise OptionError(
            f"{', '.join(unused)} feed a method's prepare step (e.g. a global bit allocation), which "
            f"no method of this run ({run}) takes; drop them"
        )
    contexts, states = {}, {}
    for key, (m, c) in entries.items():
        mine = {k: v for k, v in inputs.items() if k in m.prepare_inputs and v is not None}
        ctx = MethodContext(arch, names[key], calib, progress, mine, fisher, (m, c))
        contexts[key] = ctx
        if m.has_prepare:
            states[key] = m.prepare(model, c, ctx)
    return contexts, states


def _compute_dtype(dtype: torch.dtype | None, model: nn.Module, dev: torch.device) -> torch.dtype:
    if dtype is not None:
        return dtype
    if dev.type == "cpu":
        return torch.float32
    return next(model.parameters()).dtype


def _finished_children(layer: nn.Module, arch: ArchSpec, gi: int) -> list[nn.Module]:
    """Direct children of ``layer`` (e.g. ``self_attn``) whose quantized linears are all in groups
    ``<= gi``: their inputs and weights are final, so their whole output can be cached (the
    attention itself is then computed once per layer, not once per later group)."""
    done = {n for g in arch.sequential[: gi + 1] for n in g}
    pending = {n for g in arch.sequential[gi + 1 :] for n in g}
    out = []
    for cname, child in layer.named_children():
        mine = {n for n in done | pending if n.startswith(cname + ".")}
        if mine and mine <= done and not isinstance(child, nn.Linear):
            out.append(child)
    return out


def _use_cache(cache_outputs, budget_mb, calib, layer, arch) -> bool:
    if cache_outputs is not None:
        return bool(cache_outputs)
    width = sum(layer.get_submodule(n).weight.shape[0] for g in arch.sequential[:-1] for n in g)
    return calib.numel() * width * 4 / 2**20 <= budget_mb
