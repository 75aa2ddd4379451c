"""Checks a command runs on its arguments before any work: counts in range, the input model is not a
quantized folder, output paths can be written.  Each failure is one line (a
:class:`~bitmosaic.errors.BitmosaicError`, exit status 2), not a usage text or a traceback hours later."""

from __future__ import annotations

import sys

from ..errors import OptionError

__all__ = ["check_counts", "check_float_model", "warn_positions"]

# dest -> (flag, smallest value) of the integer flags the subcommands share
_MINIMUM = {
    "threads": ("--threads", 1),
    "batch_size": ("--batch-size", 1),
    "nsamples": ("--nsamples", 1),
    "seqlen": ("--seqlen", 1),
    "eval_seqlen": ("--eval-seqlen", 2),  # one token of context, one predicted
    "max_windows": ("--max-windows", 1),
}


def check_counts(args, **minimum: int) -> None:
    """Every integer flag of ``args`` that ``_MINIMUM`` knows (or ``minimum`` overrides, by dest) and that
    was given is at least its smallest value; else a one-line :class:`OptionError`."""
    for dest, (flag, lo) in _MINIMUM.items():
        lo = minimum.get(dest, lo)
        value = getattr(args, dest, None)
        if value is not None and value < lo:
            raise OptionError(f"{flag} {value} is out of range: it must be at least {lo}")


def check_float_model(spec: str) -> None:
    """``quantize --model`` must be a float model: a saved bitmosaic folder is refused, naming the float
    model it records (its provenance) when it does."""
    import json
    from pathlib import Path

    from ..io.sources.loading import resolve_model_spec

    kind, info = resolve_model_spec(spec)
    if kind != "bitmosaic":
        return
    try:
        raw = json.loads((Path(info["path"]) / "config.json").read_text(encoding="utf-8"))
        qc = raw["quantization_config"]
        source = (qc.get("provenance") or {}).get("model")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        source = None
    made_from = f" (it was made from {source})" if isinstance(source, str) and source else ""
    raise OptionError(
        f"--model {spec} is a bitmosaic model folder, already quantized{made_from}; give the float model to "
        "quantize (bitmosaic eval/inspect/export take the quantized folder)"
    )


def warn_positions(model, seqlen: int | None, flag: str) -> None:
    """One warning line when ``seqlen`` tokens exceed the model's ``max_position_embeddings``."""
    cfg = getattr(model, "config", None)
    limit = getattr(cfg, "max_position_embeddings", None) if cfg is not None else None
    if isinstance(limit, int) and seqlen is not None and seqlen > limit:
        print(
            f"bitmosaic: warning: {flag} {seqlen} is beyond the model's {limit} positions "
            "(max_position_embeddings): positions past them were never trained, so the results mean little",
            file=sys.stderr,
        )
