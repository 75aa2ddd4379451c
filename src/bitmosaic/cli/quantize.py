"""``bitmosaic quantize``: one flow for every run -- check, run, save, evaluate.

1. **Check** everything that can be refused before the model loads (counts, sizes, the recipe, the
   output folder and the report path, ``--stream`` against the recipe and ``torchrun``).
2. **Run** the quantization (:func:`bitmosaic.pipeline.run.run`): in memory, or streamed layer by layer
   from the checkpoint into ``--out`` (:mod:`bitmosaic.pipeline.stream`; chosen by ``--stream``,
   :mod:`.stream`).  Under ``torchrun`` every process runs it on its share of the samples and rank 0
   alone goes on.
3. **Save** to ``--out`` (a streamed run has saved already).
4. **Evaluate** (``--eval``, ``--tasks``): the quantized model as run (or, streamed, as saved), the float
   model loaded afresh for ``--eval-float`` and ``--fidelity``; a non-finite evaluation names the saved
   folder.  ``--json`` is written last.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from .args import ACT_DESTS
from .checks import check_counts, check_float_model, warn_positions
from .evaluate import check_json_path, evaluate_quantized, write_json
from .method_flags import method_flags, method_options
from .settings_flags import calibration_from_args, settings_from_args

__all__ = ["cmd_quantize", "recipe_from_args"]


def recipe_from_args(args):
    """The recipe of a ``quantize`` command line: ``--recipe FILE``, or the flags as a one-entry recipe."""
    from ..errors import OptionError
    from ..methods import DEFAULT_METHOD, get_method
    from ..pipeline.recipe import Recipe, load_recipe

    if args.recipe is None:
        spec = get_method(args.method)
        rotate = _rotate_flag(args)
        return Recipe.from_options(spec.name, method_options(args, spec), rotate=rotate)
    given = [
        d.typed(getattr(args, d.dest))
        for d in method_flags().values()
        if getattr(args, d.dest, None) is not None
    ]
    given += ["--" + a.replace("_", "-") for a in ACT_DESTS if getattr(args, a, None) not in (None, False)]
    if getattr(args, "rotate", None) is not None or getattr(args, "rotate_block", None) is not None:
        given.append("--rotate (the recipe's 'rotate' key)")
    if args.method != DEFAULT_METHOD:  # a --method next to --recipe (other than the default) is an error
        given.insert(0, "--method")
    if given:
        raise OptionError(
            f"--recipe sets the method and its settings, so {', '.join(given)} cannot be given too; "
            "put them in the recipe file"
        )
    return load_recipe(args.recipe)


def _rotate_flag(args) -> str | None:
    """``--rotate``, with ``--rotate-block N`` read into ``block:N`` (it needs ``--rotate block``)."""
    from ..errors import OptionError

    rotate, block = getattr(args, "rotate", None), getattr(args, "rotate_block", None)
    if block is None:
        return rotate
    if rotate not in ("block", f"block:{block}"):
        raise OptionError(f"--rotate-block {block} sizes a block rotation; give it with --rotate block")
    return f"block:{block}"


def cmd_quantize(args) -> int:
    """``quantize``; under ``torchrun`` (``WORLD_SIZE`` > 1) every process runs it with the same
    flags, calibrates on its share of the samples (:mod:`bitmosaic.pipeline.distributed`), and
    rank 0 alone prints, evaluates and writes ``--out`` / ``--json``."""
    import torch

    from ..io.sources.loading import resolve_device
    from ..pipeline.distributed import init_from_env, local_threads, shutdown

    check_counts(args)
    dist, device = init_from_env(resolve_device(args.device))
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        elif dist.world > 1:  # the cores of this machine, shared by its ranks
            torch.set_num_threads(local_threads())
        dist.check_batches(args.nsamples, args.batch_size)  # before the model loads
        if not dist.is_main:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            args.no_progress = True
        with contextlib.ExitStack() as stack:
            if args.out and dist.is_main:  # one run per --out: a second one refuses now, not at save
                from ..io.saved.outdir import check_output_dir, output_lock

                check_output_dir(args.out, args.overwrite)
                stack.enter_context(output_lock(args.out))
            return _quantize(args, device, dist)
    finally:
        shutdown()


def _quantize(args, device, dist) -> int:
    """The flow of the module doc: check, run, save, evaluate, report."""
    from ..io import save_quantized
    from ..pipeline.report import peak_rss_mb

    recipe, dtype, streamed = _check(args, device, dist)
    settings = settings_from_args(args, device)
    if streamed:
        model, tok, report = None, None, _run_streamed(args, recipe, settings, dtype)
    else:
        model, tok, report = _run_in_memory(args, recipe, settings, dtype, dist.is_main)
    if not dist.is_main:  # the other ranks of a torchrun: rank 0 reports and writes
        return 0
    out = _summary(args, recipe, report, device, dtype)
    if args.out:  # in memory: what run attached (method, settings, recipe, provenance) is saved too
        saved = args.out
        if not streamed:
            saved = save_quantized(model, args.out, tokenizer=tok, overwrite=args.overwrite)
        out["saved_to"] = str(saved)
        print(f"saved to {saved}")
    if args.eval_src or args.tasks:
        out.update(evaluate_quantized(args, model, tok, recipe, (device, dtype)))
    out["peak_rss_mb"] = peak_rss_mb()
    write_json(args.json, out)
    return 0


def _check(args, device, dist):
    """Step 1 (module doc): ``(recipe, dtype, streamed)``, or a one-line refusal before any work."""
    from ..errors import OptionError
    from ..io.sources.loading import resolve_dtype
    from ..pipeline.spill import parse_size
    from .stream import should_stream

    args.max_memory = parse_size(args.max_memory)  # a bad size fails before the model loads
    recipe = recipe_from_args(args)
    check_float_model(args.model)
    dtype = resolve_dtype(args.dtype, device, args.model)
    if args.out:  # refuse a bad --out (or --json) before hours of work, not after
        from ..io.saved.outdir import check_output_dir

        check_output_dir(args.out, args.overwrite)
    check_json_path(args.json)
    if args.fidelity and not args.eval_src:
        raise ValueError("--fidelity compares on the --eval windows; add --eval wikitext2 (or a text file)")
    streamed = should_stream(args, recipe, dtype)
    if streamed and dist.world > 1:
        raise OptionError(
            f"this run would stream (--stream {args.stream}), which torchrun's {dist.world} processes cannot "
            "share: its resume record holds one process's calibration activations; use --stream off (every "
            "process then holds the whole model) or run the streamed quantization as one process"
        )
    return recipe, dtype, streamed


def _run_in_memory(args, recipe, settings, dtype, main: bool):
    """Step 2 in memory: ``(model, tokenizer, report)``."""
    import torch

    from ..io import load_model
    from ..pipeline.run import run, source_name

    t0 = time.perf_counter()
    model, tok = load_model(args.model, dtype=dtype)
    if main:
        print(f"loaded {args.model} ({type(model).__name__}) in {time.perf_counter() - t0:.1f}s")
        warn_positions(model, args.seqlen, "--seqlen")
        if args.eval_src:
            warn_positions(model, args.eval_seqlen, "--eval-seqlen")
    calibration = calibration_from_args(args, tok)
    torch.manual_seed(args.seed)  # what the run draws from torch's global generator: seeded alike
    report = run(model, recipe, calibration, settings, source_model=source_name(args.model))
    return model, tok, report


def _run_streamed(args, recipe, settings, dtype):
    """Step 2 streamed (and so step 3): the report; the finished layers stay for a resume on Ctrl-C."""
    from .stream import run_streaming

    try:
        return run_streaming(args, recipe, settings, dtype)
    except KeyboardInterrupt as e:  # the finished layers stay for a resume
        from ..pipeline.stream import partial_dir

        e.bitmosaic_note = (
            f"the finished layers are kept in {partial_dir(Path(args.out).resolve())}: rerun the same "
            "command to resume"
        )
        raise


def _summary(args, recipe, report, device, dtype) -> dict:
    """What the run did, printed, and the report's JSON entries."""
    from ..pipeline.report import expert_lines

    spec, _ = recipe.default()
    for line in spec.summary_lines(report):
        print(line)
    out = {**report.to_dict(), "model": args.model, "device": str(device),
           "dtype": str(dtype).removeprefix("torch.")}  # fmt: skip
    print(
        f"quantized {len(report.layers)} linears with {spec.name} in {report.seconds:.1f}s, "
        f"{report.bits_per_weight:.3f} bits/weight, peak RSS {report.peak_rss_mb:.0f} MB"
    )
    sp = report.calibration.get("spill") or {}
    if sp.get("spilled"):
        print(f"calibration activations ({sp['activations_mb']:.0f} MB in and out, over 40% of the "
              f"{sp['budget_mb']:.0f} MB budget) spilled to {sp['dir']} (now removed)")  # fmt: skip
    dp = report.calibration.get("distributed")
    if dp:
        rss = ", ".join(f"{v:.0f}" for v in dp["peak_rss_mb_per_rank"])
        print(f"data-parallel: {dp['world']} processes, {dp['batches']} batches; peak RSS per rank {rss} MB")
    for line in expert_lines(report.calibration.get("experts")):
        print(line)
    cache = report.calibration.get("cache") or {}
    if cache.get("hits") or cache.get("misses"):
        hits, misses = ", ".join(cache["hits"]) or "-", ", ".join(cache["misses"]) or "-"
        print(f"calibration cache {cache['root']}: hits {hits}; misses {misses}")
    return out
