"""The ``bitmosaic`` command: ``quantize``, ``eval``, ``inspect``, ``methods``.

Each subcommand's handler lives in its own module of this package (``commands.py``; new
subcommands add a module and one line in ``_HANDLERS``); shared flags are in ``args.py``.
"""

from __future__ import annotations

import argparse
import sys

from . import compare as _compare
from .args import (
    DEFAULT_MODEL,
    _add_act_args,
    _add_device_args,
    _add_eval_extras,
    _group_size,
    _method_options,
    act_spec_from_args,
    add_cache_args,
)
from .commands import cmd_eval, cmd_inspect, cmd_methods, cmd_quantize
from .export import add_export_parser, cmd_export
from .reproduce import add_reproduce_parser, cmd_reproduce
from .sfmp_args import add_sfmp_args

__all__ = ["main", "build_parser", "act_spec_from_args", "_method_options"]

_HANDLERS = {
    "quantize": cmd_quantize,
    "eval": cmd_eval,
    "inspect": cmd_inspect,
    "methods": cmd_methods,
    "compare": _compare.cmd_compare,
    "export": cmd_export,
    "reproduce": cmd_reproduce,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bitmosaic", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    q = sub.add_parser("quantize", help="quantize a model with calibration data")
    q.add_argument("--model", default=DEFAULT_MODEL, help="HF dir, hub id, gguf:PATH or alias (smollm2-135m)")
    q.add_argument(
        "--method", default="gptq", help="rtn | gptq | awq | smoothquant | ... (`bitmosaic methods`)"
    )
    q.add_argument("--recipe", default=None, help="YAML/JSON recipe: method, settings, overrides, skip")
    q.add_argument("--bits", "--wbits", dest="bits", type=int, default=None, help="weight bits (2-8; 4)")
    q.add_argument(
        "--group-size", type=_group_size, default=None, help="group size; -1 = per-channel (default 128)"
    )
    sym = q.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="symmetric", action="store_true", default=None, help="symmetric grid")
    sym.add_argument("--asym", dest="symmetric", action="store_false", help="asymmetric grid (default)")
    _add_act_args(q)
    add_sfmp_args(q)
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
    add_cache_args(q)
    q.add_argument("--data-dir", default=None, help="shared data folder (else $BITMOSAIC_DATA, else the hub)")
    q.add_argument("--out", default=None, help="save the quantized model to this folder")
    q.add_argument("--json", default=None, help="write the run report (per layer + totals) here")
    q.add_argument("--eval", dest="eval_src", default=None, help="also measure perplexity on this source")
    q.add_argument("--eval-float", action="store_true", help="with --eval, also measure the float model")
    q.add_argument("--eval-seqlen", type=int, default=512)
    q.add_argument("--max-windows", type=int, default=None, help="with --eval: first K windows only")
    q.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    q.add_argument("--no-progress", action="store_true")
    _add_eval_extras(q, quantize=True)
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
    _add_eval_extras(e, quantize=False)
    _add_device_args(e)

    i = sub.add_parser("inspect", help="describe a saved quantized model folder")
    i.add_argument("dir")
    i.add_argument("--layers", action="store_true", help="print the per-layer table")

    sub.add_parser("methods", help="list registered methods")
    _compare.add_parser(sub)
    add_export_parser(sub)
    add_reproduce_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..algorithms.hessian import DampingError
    from ..errors import BitmosaicError

    try:
        return _HANDLERS[args.command](args)
    except (BitmosaicError, DampingError, ValueError, FileNotFoundError, FileExistsError, OSError) as e:
        # documented errors: one line, exit 2 (internal bugs still show their traceback)
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2

