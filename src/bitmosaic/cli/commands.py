"""The ``quantize``, ``eval``, ``inspect`` and ``methods`` subcommands."""

from __future__ import annotations

import contextlib
import copy
import json
import time
from pathlib import Path

from .args import ACT_DESTS, calib_cache_from_args, task_list
from .checks import check_counts, check_float_model, warn_positions
from .eval_options import _fidelity_reference, _is_saved_quantized, _runtime_act, _runtime_head
from .method_flags import method_flags, method_options


def _ppl(model, tok, src, seqlen, max_windows, data_dir, progress, device=None, reference=None) -> dict:
    """Perplexity with the quantized modules' own inference path (the low-bit kernels on the CPU;
    no float copy of the weights is kept)."""
    from ..data import bos_token_id, eval_tokens
    from ..eval.perplexity import perplexity

    ids = eval_tokens(tok, src, data_dir=data_dir)
    return perplexity(
        model,
        ids,
        seqlen,
        max_windows=max_windows,
        progress=progress,
        device=device,
        bos_token_id=bos_token_id(tok),
        reference=reference,
    )


def _tasks(args, model, tok, device) -> dict:
    from ..eval.tasks import run_tasks

    limit = args.tasks_limit
    limit = int(limit) if limit is not None and limit >= 1 else limit
    dev = "cpu" if device is None else str(device)
    res = run_tasks(model, tok, task_list(args.tasks), limit=limit, tasks_dir=args.tasks_dir, device=dev)
    for task, metrics in res.items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if not k.endswith("_stderr"))
        print(f"{task:<16} {shown}")
    return res


def _check_json_path(path: str | None) -> None:
    """Refuse a ``--json`` that cannot be written, before any work (one line)."""
    if not path:
        return
    if Path(path).is_dir():
        from ..errors import BitmosaicError

        raise BitmosaicError(f"--json {path} is a folder; give the path of a .json file")
    from ..io.saved.outdir import check_writable

    check_writable(path, "--json")


def _write_json(path: str | None, obj: dict) -> None:
    if path:
        from ..io.saved.outdir import atomic_write_text

        atomic_write_text(path, json.dumps(obj, indent=2))
        print(f"report written to {path}")


def recipe_from_args(args):
    """The recipe of a ``quantize`` command line: ``--recipe FILE``, or the flags as a one-entry recipe."""
    from ..errors import OptionError
    from ..methods import DEFAULT_METHOD, get_method
    from ..pipeline.recipe import Recipe, load_recipe

    if args.recipe is None:
        spec = get_method(args.method)
        rotate = getattr(args, "rotate", None)
        return Recipe.from_options(spec.name, method_options(args, spec), rotate=rotate)
    given = [
        d.typed(getattr(args, d.dest))
        for d in method_flags().values()
        if getattr(args, d.dest, None) is not None
    ]
    given += ["--" + a.replace("_", "-") for a in ACT_DESTS if getattr(args, a, None) not in (None, False)]
    if getattr(args, "rotate", None) is not None:
        given.append("--rotate (the recipe's 'rotate' key)")
    if args.method != DEFAULT_METHOD:  # a --method next to --recipe (other than the default) is an error
        given.insert(0, "--method")
    if given:
        raise OptionError(
            f"--recipe sets the method and its settings, so {', '.join(given)} cannot be given too; "
            "put them in the recipe file"
        )
    return load_recipe(args.recipe)


def run_recipe(model, tok, recipe, args, device, progress: bool, calib=None):
    """Calibration samples from ``args`` (unless given) and the quantization itself (through
    :func:`bitmosaic.quantize_`, which attaches the report, recipe and provenance to the model):
    ``(report, calib)``.  ``quantize`` and ``reproduce`` both run this."""
    import torch

    from ..api import quantize_
    from ..data import calibration_samples

    if calib is None:
        calib = calibration_samples(
            tok, args.calib, args.nsamples, args.seqlen, args.seed, data_dir=args.data_dir
        )
    hdt = {"float32": torch.float32, "float64": torch.float64}[args.hessian_dtype]
    orders = tuple(o for o in args.bound_orders.split(",") if o) if args.bound_orders else None

    def more_calib(n: int) -> torch.Tensor:  # a prepare step that wants more samples than --nsamples
        return calibration_samples(tok, args.calib, n, args.seqlen, args.seed, data_dir=args.data_dir)

    torch.manual_seed(args.seed)
    report = quantize_(
        model,
        recipe,
        calib,
        tokenizer=tok,
        calib_source=args.calib,
        source_model=str(Path(args.model).resolve()) if Path(args.model).exists() else args.model,
        more_calib=more_calib,
        batch_size=args.batch_size,
        hessian_dtype=hdt,
        progress=progress,
        analyze_orders=orders,
        seed=args.seed,
        device=device,
        calib_cache=calib_cache_from_args(args),
        max_memory=getattr(args, "max_memory", None),
        spill_dir=Path(args.out).resolve().parent if getattr(args, "out", None) else None,
    )
    return report, calib


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
    import torch

    from ..errors import OptionError
    from ..io import load_model, save_quantized
    from ..io.sources.loading import resolve_dtype
    from ..pipeline.pipeline import peak_rss_mb
    from ..pipeline.spill import parse_size

    args.max_memory = parse_size(args.max_memory)  # a bad size fails before the model loads
    torch.manual_seed(args.seed)
    recipe = recipe_from_args(args)
    spec, config = recipe.default()
    progress = not args.no_progress
    check_float_model(args.model)
    dtype = resolve_dtype(args.dtype, device, args.model)
    if args.out:  # refuse a bad --out (or --json) before hours of work, not after
        from ..io.saved.outdir import check_output_dir

        check_output_dir(args.out, args.overwrite)
    _check_json_path(args.json)
    if args.fidelity and not args.eval_src:
        raise ValueError("--fidelity compares on the --eval windows; add --eval wikitext2 (or a text file)")
    from .stream import run_streaming, should_stream

    main = dist.is_main
    streamed = should_stream(args, recipe, dtype)
    if streamed and dist.world > 1:
        raise OptionError(
            f"this run would stream (--stream {args.stream}), which torchrun's {dist.world} processes cannot "
            "share: its resume record holds one process's calibration activations; use --stream off (every "
            "process then holds the whole model) or run the streamed quantization as one process"
        )
    if streamed:
        try:
            report, out = run_streaming(args, recipe, spec, config, device, dtype, progress)
        except KeyboardInterrupt as e:  # the finished layers stay for a resume
            from ..pipeline.stream import partial_dir

            e.bitmosaic_note = (
                f"the finished layers are kept in {partial_dir(Path(args.out).resolve())}: rerun the same "
                "command to resume"
            )
            raise
        model = tok = reference = None
        results: dict = {}
    else:
        t0 = time.perf_counter()
        model, tok = load_model(args.model, dtype=dtype)
        if main:
            print(f"loaded {args.model} ({type(model).__name__}) in {time.perf_counter() - t0:.1f}s")
            warn_positions(model, args.seqlen, "--seqlen")
            if args.eval_src:
                warn_positions(model, args.eval_seqlen, "--eval-seqlen")
        reference = copy.deepcopy(model) if args.fidelity and main else None
        results = {}
        if args.eval_src and args.eval_float and main:
            results["float"] = _ppl(
                model, tok, args.eval_src, args.eval_seqlen, args.max_windows, args.data_dir, progress, device
            )
            print(f"float perplexity: {results['float']['ppl']:.3f}")
        report, _ = run_recipe(model, tok, recipe, args, device, progress)
        out = {}
    if not main:  # the other ranks of a torchrun: rank 0 reports and writes
        return 0
    for line in spec.summary_lines(report):
        print(line)
    out = {**report.to_dict(), **out}
    out.update(model=args.model, device=str(device), dtype=str(dtype).removeprefix("torch."))
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
    cache = report.calibration.get("cache") or {}
    if cache.get("hits") or cache.get("misses"):
        hits, misses = ", ".join(cache["hits"]) or "-", ", ".join(cache["misses"]) or "-"
        print(f"calibration cache {cache['root']}: hits {hits}; misses {misses}")
    if model is None:  # streamed: the model is on disk; evaluation loads what was saved
        print(f"saved to {out['saved_to']}")
        if args.eval_src or args.tasks:
            from ..io import load_quantized

            if args.eval_src and (args.eval_float or args.fidelity):
                reference, ftok = load_model(args.model, dtype=dtype)
                if args.eval_float:
                    results["float"] = _ppl(reference, ftok, args.eval_src, args.eval_seqlen,
                                            args.max_windows, args.data_dir, progress, device)  # fmt: skip
                    print(f"float perplexity: {results['float']['ppl']:.3f}")
                if not args.fidelity:
                    reference = None
            model, tok = load_quantized(args.out, dtype=dtype)
    if args.eval_src:
        from ..errors import NonFiniteError

        try:
            results["quantized"] = _ppl(
                model, tok, args.eval_src, args.eval_seqlen, args.max_windows, args.data_dir, progress,
                device, reference,
            )  # fmt: skip
        except NonFiniteError as e:  # never a "perplexity nan" and exit 0; never a saved model that does this
            if "saved_to" in out:  # streamed: saved before it could be evaluated
                raise NonFiniteError(f"the model saved to {out['saved_to']} does not evaluate: {e}") from None
            raise NonFiniteError(f"{e}; nothing was saved" if args.out or args.json else str(e)) from None
        del reference
        out["eval"] = results
        rows = [("float", results["float"]["ppl"])] if "float" in results else []
        label = f"{spec.name} {config.scheme} g{config.group_size or 'ch'}"
        if recipe.rotate != "none":
            label += f" +{recipe.rotate}"
        rows.append((label, results["quantized"]["ppl"]))
        print(f"\n{'model':<28} {'perplexity':>12}")
        for name, v in rows:
            print(f"{name:<28} {v:>12.3f}")
        print(f"({args.eval_src}, {results['quantized']['windows']} windows x {args.eval_seqlen} tokens)")
        if args.fidelity:
            q = results["quantized"]
            kl = f"KL mean {q['kl_mean']:.4f} (p99 {q['kl_p99']:.4f})"
            print(f"vs float: {kl}, top-1 agreement {q['top1_agreement']:.4f}")
    if args.tasks:
        out["tasks"] = _tasks(args, model, tok, device)
    if args.out and "saved_to" not in out:  # what quantize_ attached: method, settings, recipe, provenance
        path = save_quantized(model, args.out, tokenizer=tok, overwrite=args.overwrite)
        out["saved_to"] = str(path)
        print(f"saved to {path}")
    out["peak_rss_mb"] = peak_rss_mb()
    _write_json(args.json, out)
    return 0


def cmd_eval(args) -> int:
    import torch

    from ..errors import BitmosaicError, OptionError
    from ..io import load_model
    from ..io.sources.loading import resolve_device, resolve_dtype

    check_counts(args, seqlen=2)  # an evaluation window: one token of context, one predicted
    skip_ppl = args.ppl.lower() == "none"
    if skip_ppl and args.fidelity:
        raise OptionError("--fidelity compares on the perplexity windows; give --ppl wikitext2 or a file")
    if skip_ppl and not args.tasks:
        raise OptionError("--ppl none leaves nothing to evaluate; add --tasks (or drop --ppl none)")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device, args.model)
    _check_json_path(args.json)
    ref_spec = _fidelity_reference(args.model, args.fidelity) if args.fidelity else None
    if args.runtime_act not in (None, "none") and not _is_saved_quantized(args.model):
        raise OptionError(
            f"--runtime-act {args.runtime_act} applies to the layers of a saved quantized model; "
            f"{args.model} is not one (quantize it first)"
        )
    model, tok = load_model(args.model, dtype=dtype)
    if tok is None:
        raise BitmosaicError(f"{args.model} has no tokenizer saved; cannot evaluate text")
    warn_positions(model, args.seqlen, "--seqlen")
    progress = not args.no_progress
    res = {"model": args.model, "source": None if skip_ppl else args.ppl, "device": str(device)}
    if args.runtime_act is not None:
        res["runtime_act"] = args.runtime_act
        _runtime_act(model, args.runtime_act)
    if args.runtime_head is not None:
        res["runtime_head"] = args.runtime_head
        _runtime_head(model, args.runtime_head)
    res["dtype"] = str(dtype).removeprefix("torch.")
    if not skip_ppl:
        reference = load_model(ref_spec, dtype=dtype)[0] if ref_spec else None
        windows = (args.ppl, args.seqlen, args.max_windows, args.data_dir, progress, device)
        res.update(_ppl(model, tok, *windows, reference))
        del reference
        n = f"{res['tokens']} tokens ({res['windows']} windows x {args.seqlen})"
        print(f"perplexity {res['ppl']:.4f} over {n}")
        if ref_spec:
            res["fidelity_reference"] = ref_spec
            print(
                f"KL to {ref_spec}: mean {res['kl_mean']:.5f} p99 {res['kl_p99']:.5f} nats; "
                f"top-1 agreement {res['top1_agreement']:.4f}"
            )
    if args.tasks:
        res["tasks"] = _tasks(args, model, tok, device)
    _write_json(args.json, res)
    return 0


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def verify_file_hashes(path: Path) -> list[str] | None:
    """Check ``path``'s files against its ``SHA256SUMS`` (one line naming a changed file); a folder
    saved before bitmosaic recorded hashes gets one warning line and ``None``."""
    import sys

    from ..io.saved.integrity import SUMS, verify_folder

    checked = verify_folder(path)
    if checked is None:
        print(
            f"bitmosaic: warning: {path} has no {SUMS} (saved by a bitmosaic before file hashes were "
            "recorded): its files cannot be verified; save it again to record them",
            file=sys.stderr,
        )
    return checked


def cmd_inspect(args) -> int:
    from ..errors import CorruptModelError
    from ..io.saved.load import stored_module_bits, verify_saved
    from ..modules import KINDS

    path = Path(args.dir)
    if args.verify:  # the hashes first: a changed file is named as such, whatever else it breaks
        checked = verify_file_hashes(path)
    _, qc = verify_saved(path)  # every entry, file and tensor, as the loaders check them
    bits_by_module = stored_module_bits(path, list(qc["modules"]))
    rows, total_bits, total_w = [], 0.0, 0
    by_kind: dict[type, dict] = {}
    for name, lc in qc["modules"].items():
        try:
            n_w = int(lc["in_features"]) * int(lc["out_features"])
        except (KeyError, TypeError, ValueError):
            raise CorruptModelError(
                f"{path}/config.json: layer {name!r} lacks valid in_features/out_features; save it again"
            ) from None
        bpw = bits_by_module[name] / n_w
        rows.append((name, lc, bpw))
        total_bits += bits_by_module[name]
        total_w += n_w
        cls = KINDS.get(lc.get("kind", "packed"))
        if cls is not None:
            by_kind.setdefault(cls, {})[name] = lc
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    header, bits_cells = [], {}
    for cls, cfgs in by_kind.items():  # what each kind present says of itself
        lines, cells = cls.describe_saved(path, cfgs, qc)
        header += lines
        bits_cells.update(cells)
    print(f"model folder     {path}")
    print(f"method           {qc.get('method')} (format v{qc.get('format_version')})")
    if not header:
        print(
            f"bits / group     w{qc.get('bits')} g{qc.get('group_size') or 'per-channel'}"
            f" {'sym' if qc.get('symmetric') else 'asym'}, order {qc.get('order')}"
        )
    for line in header:
        print(line)
    rot = qc.get("rotation")
    if rot:
        online = rot.get("online") or {}
        kinds = sorted({s.get("type", "?") for s in online.values()})
        untied = "; head untied from the embeddings" if rot.get("untied") else ""
        print(f"rotation         {rot.get('kind')} (seed {rot.get('seed')}): online {'/'.join(kinds) or '-'} "
              f"at the input of {len(online)} layer(s){untied}")  # fmt: skip
    print(f"quantized layers {len(rows)} ({total_w / 1e6:.1f}M weights)")
    print(f"bits per weight  {total_bits / max(total_w, 1):.4f} (all stored tensors)")
    print(f"weights on disk  {size / 2**20:.1f} MiB; folder {_dir_size(path) / 2**20:.1f} MiB")
    if args.verify and checked is not None:
        print(f"verified         all {len(checked)} files match the SHA-256 recorded at save (SHA256SUMS)")
    compute = {name: _act_compute(lc) for name, lc, _ in rows}
    with_act = [c for c in compute.values() if c != "weight-only"]
    if with_act:
        counts = {c: with_act.count(c) for c in dict.fromkeys(with_act)}
        print("activations      " + "; ".join(f"{c}: {n} layers" for c, n in counts.items()))
    if args.layers:
        print(f"\n{'layer':<44} {'shape':>12} {'kind':>10} {'bits':>5} {'group':>6} {'bpw':>7}  compute")
        for name, lc, bpw in rows:
            shape = f"{lc['out_features']}x{lc['in_features']}"
            kind, bits, group = lc.get("kind", "packed"), lc.get("bits", "-"), lc.get("group_size", "-")
            bits = bits_cells.get(name, bits)  # a kind's own cell (e.g. a layer's average code bits)
            cells = f"{kind:>10} {bits:>5} {group:>6} {bpw:>7.3f}  {compute[name]}"
            print(f"{name:<44} {shape:>12} {cells}")
    return 0


def _act_compute(lc: dict) -> str:
    """How a saved layer computes with its activations here (integer kernel, simulated and why, or none)."""
    from ..modules import KINDS

    cls = KINDS.get(lc.get("kind", "packed"))
    if cls is None:
        return "simulated (unknown kind)" if lc.get("act") else "weight-only"
    try:
        return cls.act_compute(lc)
    except (KeyError, TypeError, ValueError) as e:
        return f"simulated (unreadable activation settings: {e})"


def cmd_methods(args) -> int:
    from .method_flags import methods_table

    print(methods_table(markdown=getattr(args, "markdown", False)))
    return 0
