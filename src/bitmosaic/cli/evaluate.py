"""Evaluation from the command line, shared by ``quantize`` (step 4 of its flow), ``eval`` and
``reproduce``: perplexity with the quantized modules' own inference path, lm-eval tasks, and the JSON
report's checks and writing."""

from __future__ import annotations

import json
from pathlib import Path

from .args import task_list

__all__ = ["perplexity_of", "print_tasks", "check_json_path", "write_json", "evaluate_quantized"]


def perplexity_of(model, tok, src: str, seqlen: int, args, device=None, reference=None) -> dict:
    """Perplexity on ``src`` in windows of ``seqlen`` (``args``: ``--max-windows``, ``--data-dir``,
    ``--no-progress``), with the quantized modules' own inference path (the low-bit kernels on the CPU;
    no float copy of the weights is kept); with ``reference``, KL and top-1 agreement against it."""
    from ..data import bos_token_id, eval_tokens
    from ..eval.perplexity import perplexity

    ids = eval_tokens(tok, src, data_dir=args.data_dir)
    return perplexity(model, ids, seqlen, max_windows=args.max_windows, progress=not args.no_progress,
                      device=device, bos_token_id=bos_token_id(tok), reference=reference)  # fmt: skip


def print_tasks(args, model, tok, device) -> dict:
    """lm-eval's ``--tasks`` on ``model``, one printed line per task; their metrics."""
    from ..eval.tasks import run_tasks

    limit = args.tasks_limit
    limit = int(limit) if limit is not None and limit >= 1 else limit
    dev = "cpu" if device is None else str(device)
    res = run_tasks(model, tok, task_list(args.tasks), limit=limit, tasks_dir=args.tasks_dir, device=dev)
    for task, metrics in res.items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if not k.endswith("_stderr"))
        print(f"{task:<16} {shown}")
    return res


def check_json_path(path: str | None) -> None:
    """Refuse a ``--json`` that cannot be written, before any work (one line)."""
    if not path:
        return
    if Path(path).is_dir():
        from ..errors import BitmosaicError

        raise BitmosaicError(f"--json {path} is a folder; give the path of a .json file")
    from ..io.saved.outdir import check_writable

    check_writable(path, "--json")


def write_json(path: str | None, obj: dict) -> None:
    if path:
        from ..io.saved.outdir import atomic_write_text

        atomic_write_text(path, json.dumps(obj, indent=2))
        print(f"report written to {path}")


def evaluate_quantized(args, model, tok, recipe, where) -> dict:
    """``quantize``'s evaluation (``--eval``, ``--eval-float``, ``--fidelity``, ``--tasks``) of the
    quantized ``model`` (``None``: a streamed run's, loaded from ``--out``); ``where``: ``(device,
    dtype)``.  The float model is loaded afresh for the float row and the fidelity reference.  Its JSON
    entries (``eval``, ``tasks``)."""
    from ..errors import NonFiniteError
    from ..io import load_model, load_quantized

    device, dtype = where
    if model is None:
        from ..modules.intact import set_runtime_activations

        model, tok = load_quantized(args.out, dtype=dtype)
        set_runtime_activations(model, "none")  # the method's weights alone, as an in-memory run's
    out, results, reference = {}, {}, None
    if args.eval_src and (args.eval_float or args.fidelity):
        reference, ftok = load_model(args.model, dtype=dtype)
        if args.eval_float:
            results["float"] = perplexity_of(reference, ftok, args.eval_src, args.eval_seqlen, args, device)
            print(f"float perplexity: {results['float']['ppl']:.3f}")
        if not args.fidelity:
            reference = None
    if args.eval_src:
        try:
            results["quantized"] = perplexity_of(model, tok, args.eval_src, args.eval_seqlen, args, device,
                                                 reference)  # fmt: skip
        except NonFiniteError as e:  # never a "perplexity nan" and exit 0
            if args.out:  # saved before it could be evaluated: kept, for the user to inspect
                raise NonFiniteError(f"the model saved to {args.out} does not evaluate: {e}") from None
            raise NonFiniteError(f"{e}; nothing was saved" if args.json else str(e)) from None
        del reference
        out["eval"] = results
        _print_table(args, recipe, results)
    if args.tasks:
        out["tasks"] = print_tasks(args, model, tok, device)
    return out


def _print_table(args, recipe, results: dict) -> None:
    spec, config = recipe.default()
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
