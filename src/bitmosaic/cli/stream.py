"""``quantize --stream``: when a run streams the model layer by layer from disk, and that run.

``--stream auto`` (the default) streams when ``--out`` is given and either the model's float weights
would take more than half of the memory budget (``--max-memory``, default: the memory available now),
or an unfinished streaming run into that ``--out`` is waiting to be resumed; ``on`` always streams
(and so always records progress for a resume); ``off`` never does.  A streamed run gives the same
saved bytes as the in-memory run (:mod:`bitmosaic.pipeline.stream`).
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from .checks import warn_positions

STREAM_CHOICES = ("auto", "on", "off")


def _float_bytes(model_spec: str, dtype) -> int | None:
    """Bytes the model's weights take in ``dtype``, from the safetensors headers (``None``: unknown)."""
    from ..io.sources.loading import resolve_model_spec

    try:
        kind, info = resolve_model_spec(model_spec)
    except Exception:
        return None
    if kind != "hf-dir":
        return None
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(info["path"]).glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    n = 1
                    for d in h.get_slice(k).get_shape():
                        n *= d
                    total += n
        except Exception:
            return None
    return total * dtype.itemsize if total else None


def should_stream(args, recipe, dtype) -> bool:
    """Whether this ``quantize`` command streams (module doc); ``on`` with a method that cannot stream
    is a one-line error."""
    from ..errors import OptionError
    from ..pipeline.spill import available_bytes, parse_size
    from ..pipeline.stream import partial_dir, streamable

    mode = getattr(args, "stream", "auto")
    if mode == "off":
        return False
    why = streamable(recipe)
    if mode == "on":
        if not args.out:
            raise OptionError("--stream on writes the model layer by layer to --out; give --out DIR")
        if why:
            raise OptionError(why)
        return True
    if not args.out or why:
        return False
    if (partial_dir(args.out) / "progress.json").is_file():
        return True
    need = _float_bytes(args.model, dtype)
    budget = parse_size(getattr(args, "max_memory", None))
    return need is not None and need > 0.5 * (budget if budget is not None else available_bytes())


def run_streaming(args, recipe, settings, dtype):
    """The streamed ``quantize`` run (its output saved to ``--out``): the report; evaluation reads the
    saved folder.  No calibration cache (its entries are keyed by a model held whole) and no spill
    folder beside ``--out`` (the run's work folder holds it)."""
    import torch

    from ..io.sources.opener import open_checkpoint
    from ..pipeline.stream import partial_dir, quantize_streaming
    from .settings_flags import calibration_from_args

    t0 = time.perf_counter()
    ckpt, tok = open_checkpoint(args.model)
    warn_positions(SimpleNamespace(config=ckpt.config()), args.seqlen, "--seqlen")  # as the in-memory run
    print(f"streaming {args.model} layer by layer into {args.out}{_resuming(partial_dir(args.out))}")
    calibration = calibration_from_args(args, tok)
    torch.manual_seed(args.seed)
    settings = settings.replace(calib_cache=None, spill_dir=None)
    report = quantize_streaming(ckpt, tok, args.out, recipe, calibration, settings, dtype=dtype,
                                overwrite=args.overwrite)  # fmt: skip
    report.seconds = time.perf_counter() - t0
    return report


def _resuming(work) -> str:
    """What an unfinished run in ``work`` left: finished layers, and the units of the layer it was in."""
    from ..pipeline.journal import journal_dir
    from ..pipeline.stream import finished_layers

    done = finished_layers(work)
    if done is None:
        return ""
    units = len(list(journal_dir(work, done).glob("unit-*.safetensors")))
    inside = f", {units} solves of layer {done} kept" if units else ""
    return f" (resuming after {done} finished layers{inside})"

