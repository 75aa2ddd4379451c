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

The driver, :func:`quantize_model`, sets the run up (rotation, calibration inputs, each method's
``prepare``), runs :func:`~bitmosaic.pipeline.loop.quantize_layer` (steps 2-3) for every layer and
calls each method's ``finalize``; :func:`bitmosaic.pipeline.run.run` is the one entry above it (the
API, the CLI and streamed runs), which attaches the recipe and the provenance.

Methods that need no Hessian (``needs_hessian = False``, e.g. round-to-nearest) skip calibration
entirely unless something else needs it (static activation scales, a transform,
``analyze_orders``); their report rows then have no error metrics.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from tqdm.auto import tqdm

from ..devices import resolve_device
from ..errors import OptionError
from ..methods.base import Method, MethodContext
from ..models.arch import get_arch
from ..modules.experts import unfuse_experts
from .calib_cache import CalibCache
from .calibration import StopForward, capture_layer_inputs, cast_floating, first_layer_inputs
from .distributed import Dist, current
from .experts import check_grid_fallback
from .fisher import fisher_service
from .loop import LayerRun, entry_key, quantize_layer, use_output_cache
from .recipe import Recipe
from .report import RunReport, expert_summary, peak_rss_mb
from .rotate import rotate_model
from .settings import Calibration, RunSettings
from .spill import SPILL_FRACTION, parse_size

__all__ = ["StopForward", "RunReport", "quantize_model", "peak_rss_mb", "capture_layer_inputs"]


def quantize_model(
    model: nn.Module, calib, method: Method | Recipe, config=None, settings: RunSettings | None = None, *,
    store=None, inputs: dict | None = None, dist: Dist | None = None,
) -> RunReport:  # fmt: skip
    """Quantize every linear of ``model``'s decoder layers in place; return the run report.

    ``method``/``config``: one method for every linear, or a
    :class:`~bitmosaic.pipeline.recipe.Recipe` (``config`` ``None``) saying which method and config each
    linear gets (or leaving it in float) and which rotation is folded in first (``"hadamard"``,
    ``"random"``, ``"spinquant..."``: :mod:`bitmosaic.pipeline.rotate`; learned on ``calib`` against the
    activation quantizer; ``model.bitmosaic_rotation`` and ``report.calibration["rotation"]`` record it,
    a saved model re-applies the online ones on load).  Linears sharing a Hessian are stacked only when
    they resolve to the same method and config.  ``calib``: token ids ``[n, seqlen]`` or a
    :class:`~bitmosaic.pipeline.settings.Calibration` (whose ``more(n)`` serves a prepare step that asks
    for more samples).  ``settings``: :class:`~bitmosaic.pipeline.settings.RunSettings` (batch size,
    dtypes, device, offload, memory budget and spill folder, output and calibration caches, seed,
    progress, analysis switches; each documented there).  ``inputs``: extra inputs for the methods'
    ``prepare`` hooks (each method's ``prepare_inputs`` names the ones it takes), run once per (method,
    config) on the float model before anything else.  ``store``: where decoder layers come from and go
    to, one at a time (streaming, with resume: :class:`bitmosaic.pipeline.stream.LayerStore`).
    ``dist``: this process's rank of a data-parallel run (default: the ``torch.distributed`` process
    group when one is initialised, e.g. under ``torchrun``; :mod:`bitmosaic.pipeline.distributed`):
    each rank calibrates on its share of the batches, the statistics are reduced, the solves spread over
    the ranks, and every rank ends with the same quantized model; only rank 0 shows progress.  The
    spill folder, if the activations spill, is removed when the run ends, also on an error.
    """
    t0 = time.perf_counter()
    settings, calib = settings or RunSettings(), Calibration.of(calib)
    budget = parse_size(settings.max_memory)  # a bad size fails before any work
    run, rotate = _plan(model, method, config, settings, dist or current())
    run.report.calibration = {"samples": int(calib.tokens.shape[0]), "seqlen": int(calib.tokens.shape[1])}
    if rotate != "none" and store is not None:
        raise OptionError(
            f"--rotate {rotate} rotates the whole float model before calibration, which a streamed run "
            "(one layer in memory at a time) cannot do; use --stream off"
        )
    _rotate(model, run, rotate, calib.tokens)
    run.layers = run.arch.layers(model)
    run.cdtype = settings.compute_dtype or (
        torch.float32 if run.dev.type == "cpu" else next(model.parameters()).dtype
    )  # on the CPU float32: its bfloat16 matmuls are slow
    model.eval()
    run.store, run.local = store, run.dist.split(calib.tokens, settings.batch_size)
    progress = settings.progress and run.dist.is_main
    _calibration_inputs(model, run, budget)
    try:
        fisher = fisher_service(model, calib.tokens, progress, settings.calib_cache, calib.more, run.dist)
        contexts, run.states = _prepare(model, calib.tokens, run, progress, inputs or {}, fisher)
        for ctx in contexts.values():
            run.report.calibration.update(ctx._record)
        run.gen = torch.Generator().manual_seed(settings.seed)
        start = 0
        if store is not None:  # layers an earlier, interrupted run finished: their rows, RNG and outputs
            start, run.total_bits, run.total_weights = store.resume(run.report, run.gen, run.inputs)
        desc = f"{run.default[0].name} {run.default[1].scheme}"
        run.bar = tqdm(range(start, len(run.layers)), desc=desc, unit="layer", disable=not progress,
                       initial=start, total=len(run.layers))  # fmt: skip
        for li in run.bar:
            quantize_layer(run, li)
        for key, ctx in contexts.items():
            m, c = ctx.entry
            ctx._record.clear()
            m.finalize(model, c, run.states.get(key), ctx)
            run.report.calibration.update(ctx._record)
        return _close_report(run, t0)
    finally:
        if run.inputs is not None:
            run.inputs.close()  # the spill files go however the run ends


def _plan(model: nn.Module, method, config, settings: RunSettings, dist: Dist) -> tuple[LayerRun, str]:
    """The run's :class:`LayerRun` with every linear's ``(Method, config)`` resolved, and the rotation."""
    arch = get_arch(model)
    unfuse_experts(model)  # a mixture of experts: one linear per expert projection (modules/experts.py)
    layers = arch.layers(model)
    n_layers = len(layers)
    per_layer = [arch.layer_linear_names(layer) for layer in layers]
    names = [f"{arch.layers_path}.{li}.{n}" for li in range(n_layers) for n in per_layer[li]]
    named = isinstance(method, Recipe)
    if named:
        if config is not None:
            raise OptionError("a recipe sets every linear's config; give the recipe alone (config=None)")
        resolve, rotate = method.resolver(names), method.rotate or "none"
        method, config = resolve.default  # one object: a model-wide plan made on it reaches every linear
    else:
        resolve, rotate = (lambda name: (method, config)), "none"
    plans = [{n: resolve(f"{arch.layers_path}.{li}.{n}") for n in per_layer[li]} for li in range(n_layers)]
    check_grid_fallback(layers, arch.groups, plans, settings.moe_fallback)  # refused before any work
    dev = resolve_device(settings.device, model)
    report = RunReport(method=method.name, config=config.to_dict(), device=str(dev))
    run = LayerRun(arch, [], plans, settings, dev, torch.float32, dist, report, named=named)
    run.default = (method, config)
    return run, rotate


def _rotate(model: nn.Module, run: LayerRun, rotate: str, tokens: torch.Tensor) -> None:
    """Fold the recipe's rotation into the float model (before anything is calibrated)."""
    if rotate == "none":
        return
    act = getattr(run.default[1], "act", None)  # what a learned rotation (spinquant) is learned against
    s = run.settings
    if rotate == "block":  # --rotate block: Hadamards of the weights' scale block (group) size
        group = getattr(run.default[1], "group_size", None)
        if not group:
            raise OptionError(
                "--rotate block rotates within the weights' scale blocks, but these are per channel; "
                "give --rotate-block N"
            )
        rotate = f"block:{group}"
    rotation = rotate_model(model, run.arch, rotate, s.seed, calib=tokens, act=act, progress=s.progress,
                            device=run.dev)  # fmt: skip
    if not rotation:
        return
    model.bitmosaic_rotation = rotation
    run.report.calibration["rotation"] = {
        "kind": rotation["kind"], "seed": rotation["seed"], "online": len(rotation["online"]),
        "untied_head": rotation["untied"],
    }  # fmt: skip
    if "learned" in rotation:  # --rotate spinquant: its steps, rate and first/last loss
        run.report.calibration["rotation"]["learned"] = rotation["learned"]


def _calibration_inputs(model: nn.Module, run: LayerRun, budget: int | None) -> None:
    """Whether the run calibrates and, if so, layer 0's calibration inputs (spilled past the budget),
    their kwargs by layer kind and the output cache's budget; the report's calibration record."""
    s, cal = run.settings, run.report.calibration
    if run.dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.dev)
    calibrate = bool(s.analyze_orders) or s.measure_errors
    for m, c in (e for plan in run.plans for e in plan.values() if e):
        static = getattr(c, "act", None) is not None and c.act.static
        calibrate = calibrate or m.needs_hessian or m.has_transform or static
    run.calibrate = calibrate
    offload = s.offload_inputs
    if calibrate:
        cache0 = s.calib_cache if run.dist.world == 1 else None  # a rank's own statistics: not shareable
        run.runc = (cache0 or CalibCache(None)).bind(
            model, run.layers, run.local, batch_size=s.batch_size, device=run.dev, compute_dtype=run.cdtype,
            seed=s.seed,
        )
        where = s.spill_dir if s.spill_dir is not None else getattr(run.store, "work", None)
        run.inputs, kwargs_by_kind, cal["spill"] = first_layer_inputs(
            model, run.layers, run.local, s.replace(spill_dir=where), run.dev, run.cdtype, run.runc, budget
        )
        offload = run.inputs.offload
        # the output cache holds every batch's linear outputs: no more of the budget than the activations
        run.cache_budget_mb = min(s.cache_budget_mb, SPILL_FRACTION * cal["spill"]["budget_mb"])
        run.kwargs_by_kind = {k: [cast_floating(kw, run.dev, run.cdtype) for kw in v]
                              for k, v in kwargs_by_kind.items()}  # fmt: skip
        cal["output_cache"] = use_output_cache(run, run.layers[0])
    cal["calibrated"] = calibrate
    cal["compute_dtype"] = str(run.cdtype).replace("torch.", "")
    cal["offload_inputs"] = bool(offload) if calibrate else None


def _prepare(model, calib, run: LayerRun, progress, inputs, fisher):
    """One :class:`MethodContext` per distinct (method, config) of the run and, for methods with a
    ``prepare`` hook, its run state (computed here, on the float model, before any calibration).
    Inputs that no method of the run takes are an error."""
    plans, arch = run.plans, run.arch
    names: dict[tuple, list[str]] = {}
    entries: dict[tuple, tuple] = {}
    for li, plan in enumerate(plans):
        for n, e in plan.items():
            if e:
                names.setdefault(entry_key(e), []).append(f"{arch.layers_path}.{li}.{n}")
                entries.setdefault(entry_key(e), e)
    wanted = {i for m, _ in entries.values() for i in m.prepare_inputs}
    unused = sorted(k for k, v in inputs.items() if v is not None and k not in wanted)
    if unused:
        used = ", ".join(sorted({m.name for m, _ in entries.values()}))
        raise OptionError(
            f"{', '.join(unused)} feed a method's prepare step (e.g. a global bit allocation), which "
            f"no method of this run ({used}) takes; drop them"
        )
    contexts, states = {}, {}
    for key, (m, c) in entries.items():
        mine = {k: v for k, v in inputs.items() if k in m.prepare_inputs and v is not None}
        ctx = MethodContext(arch, names[key], calib, progress, mine, fisher, (m, c))
        contexts[key] = ctx
        if m.needs_prepare(c):
            states[key] = m.prepare(model, c, ctx)
    return contexts, states


def _close_report(run: LayerRun, t0: float) -> RunReport:
    """The report's totals: time, memory, bits per weight, the cache's hits, every rank's share."""
    report, dist = run.report, run.dist
    if run.settings.calib_cache is not None:
        report.calibration["cache"] = run.settings.calib_cache.summary()
    report.seconds = time.perf_counter() - t0
    report.peak_rss_mb = peak_rss_mb()
    if dist.world > 1:
        every = dist.all_gather_object((report.seconds, report.peak_rss_mb, run.local.shape[0]))
        report.calibration["distributed"] = {
            "world": dist.world,
            "batches": dist.batches,
            "samples_per_rank": [e[2] for e in every],
            "seconds_per_rank": [e[0] for e in every],
            "peak_rss_mb_per_rank": [e[1] for e in every],
        }
    if run.dev.type == "cuda":
        report.peak_device_mb = torch.cuda.max_memory_allocated(run.dev) / 2**20
    report.bits_per_weight = run.total_bits / max(run.total_weights, 1)
    experts = expert_summary(report.layers, run.settings)
    if experts is not None:
        report.calibration["experts"] = experts
    return report
