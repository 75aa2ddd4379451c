"""Flags shared by the subcommands and their translation into method configs.

A method-specific flag is declared in ``build_quantize_args``' groups and mapped to its config
field in ``_OPTIONAL_FIELDS``; a flag the chosen method does not use is an error.
"""

from __future__ import annotations

import argparse

from .sfmp_args import sfmp_options

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
    sq = q.add_argument_group("SQ-format (sq-weights: Algorithm 1; sq-acts: Algorithm 2)")
    sq.add_argument("--sq", default=None, help="bank-(high/low)-sparsity: 16-(8/4)-0.5, 64-(fp8/fp4)-0.875")
    sq.add_argument("--strategy", choices=["dynamic", "static"], default=None, help="sq-acts mask strategy")
    sq.add_argument("--sq-importance", choices=["obs", "paper"], default=None, help="sq-weights importance")
    sq.add_argument("--mask-timing", choices=["lazy", "upfront"], default=None, help="sq-weights mask timing")
    sq.add_argument(
        "--static-importance", choices=["aw", "a", "abs-aw"], default=None, help="sq-acts static mask score"
    )
    sq.add_argument("--sq-act-scale", choices=["token", "bank"], default=None, help="sq-acts dynamic scales")
    mq = q.add_argument_group("mosaic (dense 4-bit base + sparse 4-bit residual blocks)")
    mq.add_argument("--budget", type=float, default=None, help="mosaic: fraction of blocks compensated (0.1)")
    mq.add_argument(
        "--block", default=None, help="ROWSxCOLS: mosaic residual block (64x64), sfmp block (512xgroup)"
    )
    mq.add_argument(
        "--selection",
        choices=["delta-hessian", "magnitude", "residual-norm", "random", "channel", "oracle", "none"],
        default=None,
        help="mosaic: block selection criterion (delta-hessian; the others are ablations)",
    )
    mq.add_argument("--mosaic-base", choices=["rtn", "gptq"], default=None, help="mosaic: dense base (rtn)")
    mq.add_argument("--clip-search", action="store_true", help="mosaic: clip search for the dense base")
    mq.add_argument("--search-budget", type=float, default=None, help="mosaic: budget in the alpha search")


def act_spec_from_args(args):
    """The activation quantizer the flags ask for (None = 16-bit); also settles ``args.bits``."""
    import dataclasses

    from ..formats.act import ActQuantSpec, normalize_fmt, parse_scheme

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
            from ..formats.fp import get_float_format

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


def _add_eval_extras(p: argparse.ArgumentParser, quantize: bool) -> None:
    """Fidelity against the float model and lm-eval zero-shot tasks (``quantize`` and ``eval``)."""
    if quantize:
        p.add_argument(
            "--fidelity",
            action="store_true",
            help="with --eval: also KL divergence (mean, p99) and top-1 agreement against the float model "
            "on the same windows (keeps a float copy in memory)",
        )
    p.add_argument(
        "--tasks", default=None, help="comma list of lm-eval tasks (arc_easy,piqa; 'zero-shot' = the set)"
    )
    p.add_argument("--tasks-limit", type=float, default=None, help="documents per task (lm-eval --limit)")
    p.add_argument("--tasks-dir", default=None, help="folder of lm-eval task YAMLs with local data (offline)")


def task_list(text: str | None) -> list[str]:
    from ..eval.tasks import ZERO_SHOT

    if not text:
        return []
    names = [t.strip() for t in text.split(",") if t.strip()]
    return [t for n in names for t in (ZERO_SHOT if n == "zero-shot" else (n,))]


def add_cache_args(p: argparse.ArgumentParser) -> None:
    """``--cache-dir`` / ``--no-cache``: the calibration statistics cache (bitmosaic.pipeline.calib_cache)."""
    c = p.add_mutually_exclusive_group()
    c.add_argument(
        "--cache-dir",
        default=None,
        help="cache of float-model calibration statistics shared between runs (layer-0 inputs, Fisher; "
        "default: $BITMOSAIC_CACHE or ~/.cache/bitmosaic)",
    )
    c.add_argument("--no-cache", action="store_true", help="read and write no calibration cache")


def calib_cache_from_args(args):
    from ..pipeline.calib_cache import CalibCache

    if getattr(args, "no_cache", False):
        return CalibCache(None)
    return CalibCache(getattr(args, "cache_dir", None) or "auto")


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
    "sq": "sq",
    "strategy": "strategy",
    "sq_importance": "importance",
    "mask_timing": "mask_timing",
    "static_importance": "static_importance",
    "sq_act_scale": "act_scale",
    "budget": "budget",
    "block": "block",
    "selection": "selection",
    "mosaic_base": "base",
    "clip_search": "clip_search",
    "search_budget": "search_budget",
}


# flags shared by every method -> the config field they set
_COMMON_FLAGS = {"bits": "--bits", "group_size": "--group-size", "scale_method": "--scale"}


def _refuse_ignored_flags(args, spec) -> None:
    """A flag the user gave for a field the method does not use is an error, not a silent no-op
    (only flags actually given are checked: defaults are not the user's words)."""
    from ..errors import OptionError

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
        if arg == "block" and "block_rows" in names:  # sfmp takes --block as rows x columns
            continue
        if fld not in names:
            raise ValueError(f"--{arg.replace('_', '-')} does not apply to method {spec.name!r}")
        opts[fld] = value
    opts.update(sfmp_options(args, names, spec.name))
    return opts
