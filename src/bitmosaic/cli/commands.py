"""The ``eval``, ``inspect`` and ``methods`` subcommands (``quantize``: :mod:`.quantize`)."""

from __future__ import annotations

from pathlib import Path

from .checks import check_counts, warn_positions
from .eval_options import (
    announce_runtime_act,
    apply_runtime_act,
    apply_runtime_head,
    fidelity_reference,
    is_saved_quantized,
)
from .evaluate import check_json_path, perplexity_of, print_tasks, write_json


def cmd_eval(args) -> int:
    import torch

    from ..errors import BitmosaicError, OptionError
    from ..io import load_model
    from ..io.sources.loading import resolve_device, resolve_dtype
    from ..modules.intact import runtime_activations

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
    check_json_path(args.json)
    ref_spec = fidelity_reference(args.model, args.fidelity) if args.fidelity else None
    if args.runtime_act not in (None, "none") and not is_saved_quantized(args.model):
        raise OptionError(
            f"--runtime-act {args.runtime_act} applies to the layers of a saved quantized model; "
            f"{args.model} is not one (quantize it first)"
        )
    model, tok = load_model(args.model, dtype=dtype)
    if tok is None:
        raise BitmosaicError(f"{args.model} has no tokenizer saved; cannot evaluate text")
    warn_positions(model, args.seqlen, "--seqlen")
    res = {"model": args.model, "source": None if skip_ppl else args.ppl, "device": str(device)}
    if args.runtime_act is not None:
        apply_runtime_act(model, args.runtime_act)
    elif is_saved_quantized(args.model):
        announce_runtime_act(model)  # what the load path chose (modules/intact.py default_runtime_act)
    res["runtime_act"] = runtime_activations(model)
    if args.runtime_head is not None:
        res["runtime_head"] = args.runtime_head
        apply_runtime_head(model, args.runtime_head)
    res["dtype"] = str(dtype).removeprefix("torch.")
    if not skip_ppl:
        reference = load_model(ref_spec, dtype=dtype)[0] if ref_spec else None
        res.update(perplexity_of(model, tok, args.ppl, args.seqlen, args, device, reference))
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
        res["tasks"] = print_tasks(args, model, tok, device)
    write_json(args.json, res)
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
        label = cls.act_compute(lc)
        if label == "weight-only":  # the run-time activations a load path gives it, where they run
            from ..modules.intact import RUNTIME_ACT_SPECS, default_runtime_act_for

            mode = default_runtime_act_for(lc.get("storage_bits") or lc.get("bits"))
            spec = RUNTIME_ACT_SPECS[mode]
            if spec is not None:
                runs = cls.act_compute({**lc, "act": spec.to_dict()})
                if not runs.startswith("simulated"):
                    label = f"{runs} at run time (not saved)"
        return label
    except (KeyError, TypeError, ValueError) as e:
        return f"simulated (unreadable activation settings: {e})"


def cmd_methods(args) -> int:
    from .method_flags import method_help, methods_table

    name = getattr(args, "name", None)
    print(method_help(name) if name else methods_table(markdown=getattr(args, "markdown", False)))
    return 0
