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


def run_streaming(args, recipe, spec, config, device, dtype, progress: bool) -> tuple[object, dict]:
    """The streamed ``quantize`` run: ``(report, json dict)``; evaluation reads the saved folder."""
    import torch

    from ..data import calibration_samples
    from ..io.sources.opener import open_checkpoint
    from ..pipeline.stream import partial_dir, quantize_streaming

    t0 = time.perf_counter()
    ckpt, tok = open_checkpoint(args.model)
    warn_positions(SimpleNamespace(config=ckpt.config()), args.seqlen, "--seqlen")  # as the in-memory run
    resuming = (partial_dir(args.out) / "progress.json").is_file()
    print(f"streaming {args.model} layer by layer into {args.out}" + (" (resuming)" if resuming else ""))
    calib = calibration_samples(tok, args.calib, args.nsamples, args.seqlen, args.seed,
                                data_dir=args.data_dir)  # fmt: skip
    hdt = {"float32": torch.float32, "float64": torch.float64}[args.hessian_dtype]
    orders = tuple(o for o in args.bound_orders.split(",") if o) if args.bound_orders else None
    torch.manual_seed(args.seed)
    settings = {"batch_size": args.batch_size, "seed": args.seed, "hessian_dtype": args.hessian_dtype,
                "device": str(device), "bound_orders": orders}  # fmt: skip
    report = quantize_streaming(
        ckpt, tok, args.out, recipe, calib, dtype=dtype, overwrite=args.overwrite, settings=settings,
        calib_source=args.calib, batch_size=args.batch_size, hessian_dtype=hdt, progress=progress,
        analyze_orders=orders, seed=args.seed, device=device, max_memory=getattr(args, "max_memory", None),
        source_model=str(Path(args.model).resolve()) if Path(args.model).exists() else args.model,
    )  # fmt: skip
    report.seconds = time.perf_counter() - t0
    return report, {"saved_to": str(Path(args.out))}
