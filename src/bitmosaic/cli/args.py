"""Flags shared by the subcommands: the activation quantizer, evaluation, cache and device flags.

The method flags are generated from the configs' fields (:mod:`.method_flags`).
"""

from __future__ import annotations

import argparse

DEFAULT_MODEL = "smollm2-135m"


# the dests of the activation flags (one ``act`` field of every config)
ACT_DESTS = (
    "scheme", "abits", "afmt", "a_granularity", "a_group_size", "a_static", "a_pow2", "a_calib",
    "a_percentile", "a_clip",
)  # fmt: skip


def add_act_args(q: argparse.ArgumentParser) -> None:
    a = q.add_argument_group("activation quantization (default: 16-bit activations)")
    a.add_argument(
        "--scheme",
        default=None,
        help="W4A16 | W4A8 | W4A4 | W8A8 | W4A8-FP8: sets --bits/--abits/--afmt (default: none, W?A16)",
    )
    a.add_argument("--abits", type=int, default=None, help="activation bits (default 16 = off)")
    a.add_argument(
        "--afmt",
        default=None,
        help="activation format: int | fp8 (=fp8-e4m3) | fp8-e4m3-240 | fp8-e5m2 | fp4 (e2m1) (default int)",
    )
    a.add_argument(
        "--a-granularity", choices=["token", "tensor", "group"], default=None,
        help="one activation scale per token, per tensor or per hidden-dim group (default: the scheme's)",
    )  # fmt: skip
    a.add_argument(
        "--a-group-size",
        type=int,
        default=None,
        help="hidden-dim group for --a-granularity group (default 128)",
    )
    st = a.add_mutually_exclusive_group()
    st.add_argument(
        "--a-static", dest="a_static", action="store_true", default=None, help="calibrated scales"
    )
    st.add_argument("--a-dynamic", dest="a_static", action="store_false", help="scales computed per input")
    a.add_argument(
        "--a-pow2", action="store_true", default=None, help="power-of-two activation scales (default off)"
    )
    a.add_argument(
        "--a-calib", choices=["max", "percentile"], default=None, help="static scale statistic (default max)"
    )
    a.add_argument(
        "--a-percentile", type=float, default=None, help="with --a-calib percentile (default 99.99)"
    )
    a.add_argument(
        "--a-clip",
        type=float,
        default=None,
        help="activation clip ratio in (0, 1]: scale = ratio x max (QuaRot uses 0.9 at A4; default 1)",
    )


def act_spec_from_args(args):
    """The activation quantizer the flags ask for (None = 16-bit); also settles ``args.bits``."""
    import dataclasses

    from ..formats.act import ActQuantSpec, normalize_fmt, parse_scheme

    spec = None
    abits, afmt = args.abits, args.afmt
    if args.scheme:
        wbits, spec = parse_scheme(args.scheme)
        if args.bits_given and args.bits != wbits:
            raise ValueError(f"--scheme {args.scheme} says {wbits}-bit weights but --bits is {args.bits}")
        args.bits = wbits
        _check_scheme_act(args.scheme, spec, abits, afmt)
        if afmt is None:  # a matching --abits adds nothing to the scheme
            abits = None
    if abits is not None or afmt is not None:
        fmt = normalize_fmt(afmt or "int")
        if abits is not None and abits >= 16:
            if afmt:
                raise ValueError("--afmt needs --abits below 16")
            return None
        bits = abits if abits is not None else (8 if fmt == "int" else None)
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
        "clip_ratio": args.a_clip,
    }
    extra = {k: v for k, v in extra.items() if v is not None}
    if extra and spec is None:
        raise ValueError(f"activation options {sorted(extra)} need --abits/--afmt or --scheme")
    if spec is not None and extra:
        if extra.get("granularity") == "token" and "static" not in extra:
            extra["static"] = False
        spec = dataclasses.replace(spec, **extra)
    return spec


def _check_scheme_act(scheme: str, spec, abits: int | None, afmt: str | None) -> None:
    """``--abits``/``--afmt`` next to ``--scheme`` may repeat the scheme's activations or pick a variant
    of its float format (``W4A8-FP8 --afmt fp8-e4m3-240``), never contradict it."""
    from ..errors import OptionError
    from ..formats.act import normalize_fmt

    sbits = 16 if spec is None else spec.bits
    if abits is not None and abits != sbits:
        raise OptionError(
            f"--scheme {scheme} says {sbits}-bit activations but --abits {abits} says otherwise; "
            "give only one"
        )
    if afmt is not None:
        sfmt = "none" if spec is None else spec.fmt
        if spec is None or (normalize_fmt(afmt) == "int") != (sfmt == "int"):
            raise OptionError(
                f"--scheme {scheme} says {sfmt} activations but --afmt {afmt} says otherwise; give only one"
            )


def add_eval_extras(p: argparse.ArgumentParser, quantize: bool) -> None:
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


def add_device_args(p: argparse.ArgumentParser) -> None:
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
