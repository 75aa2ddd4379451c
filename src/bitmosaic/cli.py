"""The ``bitmosaic`` command: ``quantize``, ``eval``, ``inspect``, ``methods``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

__all__ = ["main", "build_parser"]

DEFAULT_MODEL = "smollm2-135m"


def _group_size(text: str) -> int:
    v = int(text)
    if v < -1 or v == 0:
        raise argparse.ArgumentTypeError("group size must be positive, or -1 for per-channel")
    return v


def _alpha(text: str) -> float | str:
    if text == "search":
        return text
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("alpha must be a number in [0, 1] or 'search'") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError("alpha must be in [0, 1] or 'search'")
    return v


def _add_act_args(q: argparse.ArgumentParser) -> None:
    a = q.add_argument_group("activation quantization (default: 16-bit activations)")
    a.add_argument(
        "--scheme", default=None, help="W4A16 | W4A8 | W4A4 | W8A8 | W4A8-FP8 (sets --wbits/--abits/--afmt)"
    )
    a.add_argument("--abits", type=int, default=None, help="activation bits (16 = off)")
    a.add_argument(
        "--afmt", default=None, help="int (default) | fp8 (=fp8-e4m3) | fp8-e4m3-240 | fp8-e5m2 | fp4 (e2m1)"
    )
    a.add_argument("--a-granularity", choices=["token", "tensor", "group"], default=None)
    a.add_argument(
        "--a-group-size", type=int, default=None, help="hidden-dim group for --a-granularity group"
    )
    st = a.add_mutually_exclusive_group()
    st.add_argument(
        "--a-static", dest="a_static", action="store_true", default=None, help="calibrated scales"
    )
    st.add_argument("--a-dynamic", dest="a_static", action="store_false", help="scales computed per input")
    a.add_argument("--a-pow2", action="store_true", help="power-of-two activation scales")
    a.add_argument("--a-calib", choices=["max", "percentile"], default=None, help="static scale statistic")
    a.add_argument("--a-percentile", type=float, default=None, help="with --a-calib percentile (99.99)")
    a.add_argument("--alpha", type=_alpha, default=None, help="smoothquant migration strength, or 'search'")
    a.add_argument(
        "--smooth-weights", choices=["rtn", "gptq"], default=None, help="smoothquant weight quantizer"
    )
    d = q.add_argument_group("dpq (W4A8 with FP8 compute)")
    d.add_argument("--fp8-range", type=int, choices=[448, 240], default=None, help="E4M3 range (448)")
    d.add_argument("--pow2-scales", action="store_true", help="power-of-two FP8 weight/activation scales")
    d.add_argument("--naive", action="store_true", help="naive GPTQ W4A8 baseline (INT4 error only)")
    d.add_argument("--fp8-per-channel", action="store_true", help="FP8 weight scale per output channel")
    d.add_argument("--fp8-margin", type=float, default=None, help="FP8 weight-scale headroom factor (1)")
    d.add_argument("--solver", choices=["gptq", "rtn"], default=None, help="dpq: rtn = the RTN W4A8 baseline")


def act_spec_from_args(args):
    """The activation quantizer the flags ask for (None = 16-bit); also settles ``args.bits``."""
    import dataclasses

    from .formats.act import ActQuantSpec, normalize_fmt, parse_scheme

    spec = None
    if args.scheme:
        wbits, spec = parse_scheme(args.scheme)
        if args.bits_given and args.bits != wbits:
            raise ValueError(f"--scheme {args.scheme} says {wbits}-bit weights but --wbits is {args.bits}")
        args.bits = wbits
    if args.abits is not None or args.afmt is not None:
        fmt = normalize_fmt(args.afmt or "int")
        if args.abits is not None and args.abits >= 16:
            if args.afmt:
                raise ValueError("--afmt needs --abits below 16")
            return None
        bits = args.abits if args.abits is not None else (8 if fmt == "int" else None)
        if fmt == "int":
            spec = ActQuantSpec("int", bits)
        else:
            from .formats.fp import get_float_format

            bits = bits if bits is not None else get_float_format(fmt).bits
            spec = ActQuantSpec(fmt, bits, granularity="tensor", static=True)
    extra = {
        "granularity": args.a_granularity,
        "group_size": args.a_group_size,
        "static": args.a_static,
        "pow2": args.a_pow2 or None,
        "calib": args.a_calib,
        "percentile": args.a_percentile,
    }
    extra = {k: v for k, v in extra.items() if v is not None}
    if extra and spec is None:
        raise ValueError(f"activation options {sorted(extra)} need --abits/--afmt or --scheme")
    if spec is not None and extra:
        if extra.get("granularity") == "token" and "static" not in extra:
            extra["static"] = False
        spec = dataclasses.replace(spec, **extra)
    return spec


def _add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        default="auto",
        help="where calibration, the solvers and evaluation run: auto (CUDA when available) | cpu | "
        "cuda | cuda:N; the model stays in host memory and each decoder layer visits the device in turn",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="dtype the model is loaded in (auto: the checkpoint's dtype on CUDA, float32 on the CPU); "
        "on the CPU each layer is calibrated in float32 whatever this is",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bitmosaic", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    q = sub.add_parser("quantize", help="quantize a model with calibration data")
    q.add_argument("--model", default=DEFAULT_MODEL, help="HF dir, hub id, gguf:PATH or alias (smollm2-135m)")
    q.add_argument(
        "--method", default="gptq", help="rtn | gptq | awq | smoothquant | ... (`bitmosaic methods`)"
    )
    q.add_argument("--bits", "--wbits", dest="bits", type=int, default=None, help="weight bits (2-8; 4)")
    q.add_argument(
        "--group-size", type=_group_size, default=None, help="group size; -1 = per-channel (default 128)"
    )
    sym = q.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="symmetric", action="store_true", default=None, help="symmetric grid")
    sym.add_argument("--asym", dest="symmetric", action="store_false", help="asymmetric grid (default)")
    _add_act_args(q)
    q.add_argument("--scale", dest="scale_method", choices=["minmax", "mse"], default=None)
    q.add_argument("--order", choices=["natural", "act", "gar", "min-pivot"], default=None)
    q.add_argument("--direction", choices=["front", "back"], default=None)
    q.add_argument("--no-clip", action="store_true", help="keep unbounded integers (lattice analysis)")
    q.add_argument("--static-groups", action="store_true", help="fix group scales before GPTQ updates")
    q.add_argument("--damp", type=float, default=None, help="damping, fraction of mean diag(H) (0.01)")
    q.add_argument("--outlier-rate", type=float, default=None, help="ssqr: target outlier density")
    q.add_argument(
        "--ssqr-groups",
        choices=["dynamic", "static"],
        default=None,
        help="ssqr: the paper's static groups (default) or GPTQ's act-order dynamic groups",
    )
    q.add_argument("--target-bits", type=float, default=None, help="hptq/hrtn: target encoded bits/weight")
    q.add_argument("--scale-per", choices=["matrix", "row"], default=None, help="hptq/hrtn scale sharing")
    q.add_argument(
        "--bound-orders",
        default=None,
        help="comma list of orders (e.g. natural,act,min-pivot): per-layer Babai bound and no-clip error",
    )
    q.add_argument("--solver-dtype", choices=["float32", "float64"], default=None)
    q.add_argument("--hessian-dtype", choices=["float32", "float64"], default="float32")
    q.add_argument("--calib", default="wikitext2", help="wikitext2 or a text file")
    q.add_argument("--nsamples", type=int, default=32)
    q.add_argument("--seqlen", type=int, default=512)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--batch-size", type=int, default=4, help="calibration samples per layer forward")
    q.add_argument("--data-dir", default=None, help="shared data folder (else $BITMOSAIC_DATA, else the hub)")
    q.add_argument("--out", default=None, help="save the quantized model to this folder")
    q.add_argument("--json", default=None, help="write the run report (per layer + totals) here")
    q.add_argument("--eval", dest="eval_src", default=None, help="also measure perplexity on this source")
    q.add_argument("--eval-float", action="store_true", help="with --eval, also measure the float model")
    q.add_argument("--eval-seqlen", type=int, default=512)
    q.add_argument("--max-windows", type=int, default=None, help="with --eval: first K windows only")
    q.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    q.add_argument("--no-progress", action="store_true")
    _add_device_args(q)
    q.add_argument(
        "--overwrite", action="store_true", help="replace an existing bitmosaic model folder at --out"
    )

    e = sub.add_parser("eval", help="perplexity of a model or a saved quantized folder")
    e.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    e.add_argument("--ppl", default="wikitext2", help="wikitext2 or a text file")
    e.add_argument("--seqlen", type=int, default=512)
    e.add_argument("--max-windows", type=int, default=None)
    e.add_argument("--data-dir", default=None)
    e.add_argument("--json", default=None)
    e.add_argument("--threads", type=int, default=None)
    e.add_argument("--no-progress", action="store_true")
    _add_device_args(e)

    i = sub.add_parser("inspect", help="describe a saved quantized model folder")
    i.add_argument("dir")
    i.add_argument("--layers", action="store_true", help="print the per-layer table")

    sub.add_parser("methods", help="list registered methods")
    return p


# CLI argument -> method config field; passed when the method's config has that field.
_OPTIONAL_FIELDS = {
    "order": "order",
    "direction": "direction",
    "damp": "percdamp",
    "static_groups": "static_groups",
    "solver_dtype": "dtype",
    "outlier_rate": "outlier_rate",
    "ssqr_groups": "groups",
    "target_bits": "target_bits",
    "scale_per": "scale_per",
    "smooth_weights": "weights",
    "fp8_range": "fp8_range",
    "pow2_scales": "pow2",
    "naive": "naive",
    "fp8_per_channel": "per_channel",
    "fp8_margin": "margin",
    "solver": "solver",
}


# flags shared by every method -> the config field they set
_COMMON_FLAGS = {"bits": "--bits", "group_size": "--group-size", "scale_method": "--scale"}


def _refuse_ignored_flags(args, spec) -> None:
    """A flag the user gave for a field the method does not use is an error, not a silent no-op
    (only flags actually given are checked: defaults are not the user's words)."""
    from .errors import OptionError

    ignored = getattr(spec.config_cls, "IGNORED_FIELDS", ())
    given = [flag for fld, flag in _COMMON_FLAGS.items() if getattr(args, fld) is not None and fld in ignored]
    if args.symmetric is not None and "symmetric" in ignored:
        given.append("--sym" if args.symmetric else "--asym")
    if given:
        why = getattr(spec.config_cls, "IGNORED_WHY", "")
        raise OptionError(f"{', '.join(given)} does not apply to method {spec.name!r}{why}")


def _method_options(args, spec) -> dict:
    import dataclasses

    names = {f.name for f in dataclasses.fields(spec.config_cls)}
    args.bits_given = args.bits is not None
    _refuse_ignored_flags(args, spec)
    act = act_spec_from_args(args)  # may set args.bits from --scheme
    opts: dict = {}
    if args.bits is not None:  # else the method's own default (4; 8 for fp8)
        opts["bits"] = args.bits
    if args.no_clip:
        opts["clip"] = False
    if act is not None or args.scheme or args.abits is not None:  # else the method's default
        opts["act"] = act
    if args.symmetric is not None:
        opts["symmetric"] = args.symmetric
    if args.alpha is not None:
        if "alpha" not in names:
            raise ValueError(f"--alpha does not apply to method {spec.name!r}")
        opts["alpha"] = None if args.alpha == "search" else args.alpha
    if args.group_size is not None:  # else the method's default (128, or none for hptq/hrtn)
        opts["group_size"] = None if args.group_size == -1 else args.group_size
    if args.scale_method is not None:
        opts["scale_method"] = args.scale_method
    for arg, fld in _OPTIONAL_FIELDS.items():
        value = getattr(args, arg)
        if value is None or value is False:
            continue
        if fld not in names:
            raise ValueError(f"--{arg.replace('_', '-')} does not apply to method {spec.name!r}")
        opts[fld] = value
    return opts


def _ppl(model, tok, src, seqlen, max_windows, data_dir, progress, device=None) -> dict:
    """Perplexity with the quantized modules' own inference path (the low-bit kernels on the CPU;
    no float copy of the weights is kept)."""
    from .data import bos_token_id, eval_tokens
    from .eval.perplexity import perplexity

    ids = eval_tokens(tok, src, data_dir=data_dir)
    return perplexity(
        model,
        ids,
        seqlen,
        max_windows=max_windows,
        progress=progress,
        device=device,
        bos_token_id=bos_token_id(tok),
    )


def _check_json_path(path: str | None) -> None:
    if path and Path(path).is_dir():
        from .errors import BitmosaicError

        raise BitmosaicError(f"--json {path} is a folder; give the path of a .json file")


def _write_json(path: str | None, obj: dict) -> None:
    if path:
        from .models.serialization import atomic_write_text

        atomic_write_text(path, json.dumps(obj, indent=2))
        print(f"report written to {path}")


def cmd_quantize(args) -> int:
    import torch

    from .data import bos_token_id, calibration_samples
    from .methods import get_method
    from .models import load_model, quantize_model, save_quantized
    from .models.loading import resolve_device, resolve_dtype
    from .models.pipeline import peak_rss_mb

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    spec = get_method(args.method)
    config = spec.make_config(**_method_options(args, spec))
    progress = not args.no_progress
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device, args.model)
    if args.out:  # refuse a bad --out (or --json) before hours of work, not after
        from .models.serialization import check_output_dir

        check_output_dir(args.out, args.overwrite)
    _check_json_path(args.json)
    t0 = time.perf_counter()
    model, tok = load_model(args.model, dtype=dtype)
    print(f"loaded {args.model} ({type(model).__name__}) in {time.perf_counter() - t0:.1f}s")
    results: dict = {}
    if args.eval_src and args.eval_float:
        results["float"] = _ppl(
            model, tok, args.eval_src, args.eval_seqlen, args.max_windows, args.data_dir, progress, device
        )
        print(f"float perplexity: {results['float']['ppl']:.3f}")
    calib = calibration_samples(
        tok, args.calib, args.nsamples, args.seqlen, args.seed, data_dir=args.data_dir
    )
    hdt = {"float32": torch.float32, "float64": torch.float64}[args.hessian_dtype]
    orders = tuple(o for o in args.bound_orders.split(",") if o) if args.bound_orders else None
    report = quantize_model(
        model,
        calib,
        spec,
        config,
        batch_size=args.batch_size,
        hessian_dtype=hdt,
        progress=progress,
        analyze_orders=orders,
        seed=args.seed,
        device=device,
    )
    report.calibration.update({"source": args.calib, "seed": args.seed, "bos": bos_token_id(tok) is not None})
    out = report.to_dict()
    out.update(model=args.model, device=str(device), dtype=str(dtype).removeprefix("torch."))
    print(
        f"quantized {len(report.layers)} linears with {spec.name} in {report.seconds:.1f}s, "
        f"{report.bits_per_weight:.3f} bits/weight, peak RSS {report.peak_rss_mb:.0f} MB"
    )
    if args.eval_src:
        results["quantized"] = _ppl(
            model, tok, args.eval_src, args.eval_seqlen, args.max_windows, args.data_dir, progress, device
        )
        out["eval"] = results
        rows = [("float", results["float"]["ppl"])] if "float" in results else []
        label = f"{spec.name} {config.scheme} g{config.group_size or 'ch'}"
        rows.append((label, results["quantized"]["ppl"]))
        print(f"\n{'model':<28} {'perplexity':>12}")
        for name, v in rows:
            print(f"{name:<28} {v:>12.3f}")
        print(f"({args.eval_src}, {results['quantized']['windows']} windows x {args.eval_seqlen} tokens)")
    if args.out:
        info = {
            "method": spec.name,
            "bits": config.bits,
            "group_size": config.group_size,
            "symmetric": config.symmetric,
            "order": getattr(config, "order", None),
            "scheme": config.scheme,
            "config": config.to_dict(),
            "source_model": args.model,
        }
        path = save_quantized(model, args.out, info, tokenizer=tok, overwrite=args.overwrite)
        out["saved_to"] = str(path)
        print(f"saved to {path}")
    out["peak_rss_mb"] = peak_rss_mb()
    _write_json(args.json, out)
    return 0


def cmd_eval(args) -> int:
    import torch

    from .errors import BitmosaicError
    from .models import load_model
    from .models.loading import resolve_device, resolve_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device, args.model)
    _check_json_path(args.json)
    model, tok = load_model(args.model, dtype=dtype)
    if tok is None:
        raise BitmosaicError(f"{args.model} has no tokenizer saved; cannot evaluate text")
    progress = not args.no_progress
    res = _ppl(model, tok, args.ppl, args.seqlen, args.max_windows, args.data_dir, progress, device)
    res.update(model=args.model, source=args.ppl, device=str(device), dtype=str(dtype).removeprefix("torch."))
    print(
        f"perplexity {res['ppl']:.4f} over {res['tokens']} tokens ({res['windows']} windows x {args.seqlen})"
    )
    _write_json(args.json, res)
    return 0


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def cmd_inspect(args) -> int:
    from .errors import CorruptModelError
    from .models.serialization import read_quant_config, stored_module_bits

    path = Path(args.dir)
    _, qc = read_quant_config(path)
    bits_by_module = stored_module_bits(path, list(qc["modules"]))
    rows, total_bits, total_w = [], 0.0, 0
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
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"model folder     {path}")
    print(f"method           {qc.get('method')} (format v{qc.get('format_version')})")
    print(
        f"bits / group     w{qc.get('bits')} g{qc.get('group_size') or 'per-channel'}"
        f" {'sym' if qc.get('symmetric') else 'asym'}, order {qc.get('order')}"
    )
    print(f"quantized layers {len(rows)} ({total_w / 1e6:.1f}M weights)")
    print(f"bits per weight  {total_bits / max(total_w, 1):.4f} (all stored tensors)")
    print(f"weights on disk  {size / 2**20:.1f} MiB; folder {_dir_size(path) / 2**20:.1f} MiB")
    if args.layers:
        print(f"\n{'layer':<44} {'shape':>12} {'kind':>10} {'bits':>4} {'group':>6} {'bpw':>7}")
        for name, lc, bpw in rows:
            shape = f"{lc['out_features']}x{lc['in_features']}"
            kind, bits, group = lc.get("kind", "packed"), lc.get("bits", "-"), lc.get("group_size", "-")
            cells = f"{kind:>10} {bits:>4} {group:>6} {bpw:>7.3f}"
            print(f"{name:<44} {shape:>12} {cells}")
    return 0


def cmd_methods(args) -> int:
    from .methods import get_method, list_methods

    for name in list_methods():
        print(f"{name:<10} {get_method(name).description}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"quantize": cmd_quantize, "eval": cmd_eval, "inspect": cmd_inspect, "methods": cmd_methods}
    from .algorithms.hessian import DampingError
    from .errors import BitmosaicError

    try:
        return handlers[args.command](args)
    except (BitmosaicError, DampingError, ValueError, FileNotFoundError, FileExistsError, OSError) as e:
        # documented errors: one line, exit 2 (internal bugs still show their traceback)
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
