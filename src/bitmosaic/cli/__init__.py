"""The ``bitmosaic`` command: ``quantize``, ``eval``, ``inspect``, ``methods``, ``generate``, ...

Each subcommand's handler lives in its own module of this package (``commands.py``; new
subcommands add a module and one line in ``_HANDLERS``); shared flags are in ``args.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading

from . import compare as _compare
from .args import (
    DEFAULT_MODEL,
    act_spec_from_args,
    add_act_args,
    add_cache_args,
    add_device_args,
    add_eval_extras,
)
from .commands import cmd_eval, cmd_inspect, cmd_methods
from .eval_options import add_runtime_act_argument
from .export import add_export_parser, cmd_export
from .generate import add_generate_parser, cmd_generate
from .method_flags import add_method_args, method_options
from .quantize import cmd_quantize
from .reproduce import add_reproduce_parser, cmd_reproduce
from .settings_flags import add_settings_flags

__all__ = ["main", "build_parser", "act_spec_from_args", "method_options"]


class _Help(argparse.HelpFormatter):
    """Shows ``(default: X)`` after a flag's help when it has a default and does not say it."""

    def _get_help_string(self, action):
        h = action.help or ""
        no_default = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if "default" in h or no_default or action.nargs == 0 or not action.option_strings:
            return h
        return h + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """``--help`` leaves out the actions marked rare (``action.rare = True``: method-specific and seldom
    used flags, still accepted); ``format_help(full=True)`` (``--help-all``) shows every one."""

    def format_help(self, full: bool = False) -> str:
        hidden = [] if full else [a for a in self._actions if getattr(a, "rare", False)]
        saved = [a.help for a in hidden]
        for a in hidden:
            a.help = argparse.SUPPRESS
        try:
            return super().format_help()
        finally:
            for a, h in zip(hidden, saved, strict=True):
                a.help = h


class _HelpAll(argparse.Action):
    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        parser._print_message(parser.format_help(full=True), sys.stdout)
        parser.exit()


class _HelpMethod(argparse.Action):
    """``--help-method NAME``: one method's options (``bitmosaic methods NAME``), then exit 0; an unknown
    NAME is one line on stderr and exit 2."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, metavar="NAME", **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        from .method_flags import method_help

        try:
            text = method_help(values)
        except ValueError as e:
            parser.exit(2, f"error: {e}\n")
        parser._print_message(text + "\n", sys.stdout)
        parser.exit()


def _rare(*actions) -> None:
    for a in actions:
        a.rare = True


# quantize flags left out of the short --help (still accepted; --help-all shows them)
_RARE_QUANTIZE = {
    "bound_orders", "hessian_dtype", "batch_size", "cache_dir", "no_cache", "tasks_limit", "tasks_dir",
    "max_memory", "a_granularity", "a_group_size", "a_static", "a_pow2", "a_calib", "a_percentile", "a_clip",
    "rotate_block", "moe_fallback", "eval_seqlen",
}  # fmt: skip

_HANDLERS = {
    "quantize": cmd_quantize,
    "eval": cmd_eval,
    "inspect": cmd_inspect,
    "methods": cmd_methods,
    "compare": _compare.cmd_compare,
    "export": cmd_export,
    "reproduce": cmd_reproduce,
    "generate": cmd_generate,
}


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="bitmosaic", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    _add_quantize_parser(sub)
    _add_eval_parser(sub)
    _add_inspect_and_methods_parsers(sub)
    _compare.add_parser(sub)
    add_export_parser(sub)
    add_reproduce_parser(sub)
    add_generate_parser(sub)
    return p


def _add_quantize_parser(sub) -> None:
    from ..methods import DEFAULT_METHOD

    q = sub.add_parser(
        "quantize", help="quantize a model with calibration data", formatter_class=_Help,
        usage="%(prog)s [--model MODEL] [--method NAME] [METHOD FLAGS] [--out DIR] [--eval SOURCE] [...]",
        epilog="Shown: the common flags and the default method's. Every flag (each method's own, the "
        "activation and the rarer ones): --help-all; one method's options with defaults and ranges: "
        "--help-method NAME or `bitmosaic methods NAME`.",
    )  # fmt: skip
    q.add_argument(
        "--help-all", action=_HelpAll, help="show every flag, each method's own included, and exit"
    )
    q.add_argument("--help-method", action=_HelpMethod, help="show one method's options and exit")
    q.add_argument("--model", default=DEFAULT_MODEL, help="HF dir, hub id, gguf:PATH or alias")
    q.add_argument(
        "--method", default=DEFAULT_METHOD, help="a registered method (`bitmosaic methods` lists them)"
    )
    q.add_argument("--recipe", default=None, help="YAML/JSON recipe: method, settings, overrides, skip")
    add_method_args(q)
    add_act_args(q)
    q.add_argument("--calib", default="wikitext2", help="calibration data: wikitext2 or a text file")
    q.add_argument("--nsamples", type=int, default=32, help="calibration samples")
    q.add_argument("--seqlen", type=int, default=512, help="tokens per calibration sample")
    q.add_argument(
        "--rotate", default=None, metavar="{none,hadamard,random,spinquant[:steps=N,lr=X,batch=B],block}",
        help="QuaRot rotation folded into the float model before any method (norm scales folded, residual "
        "stream rotated, per-head value/output rotation, online Hadamards before o_proj and down_proj): "
        "4-bit activations without outlier collapse; random = random orthogonal matrices; spinquant = R1 "
        "and R2 learned from the Hadamard ones by Cayley SGD against the activation quantizer on the "
        "calibration data (100 steps, lr 1.5, 1 sample a step; needs --abits); block = Hadamards per "
        "scale block (default: none)",
    )  # fmt: skip
    q.add_argument(
        "--rotate-block", type=int, default=None, metavar="N",
        help="with --rotate block: the order of the block Hadamards (default: the weights' block/group size)",
    )  # fmt: skip
    add_settings_flags(q)  # --batch-size, --hessian-dtype, --seed, --bound-orders, --no-progress
    add_cache_args(q)
    q.add_argument("--data-dir", default=None, help="shared data folder (else $BITMOSAIC_DATA, else the hub)")
    q.add_argument("--out", default=None, help="save the quantized model to this folder")
    q.add_argument("--json", default=None, help="write the run report (per layer + totals) here")
    q.add_argument("--eval", dest="eval_src", default=None, help="also measure perplexity on this source")
    q.add_argument("--eval-float", action="store_true", help="with --eval, also measure the float model")
    q.add_argument("--eval-seqlen", type=int, default=512, help="tokens per evaluation window")
    q.add_argument("--max-windows", type=int, default=None, help="with --eval: first K windows only")
    q.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_eval_extras(q, quantize=True)
    add_device_args(q)
    q.add_argument(
        "--overwrite", action="store_true", help="replace an existing bitmosaic model folder at --out"
    )
    q.add_argument(
        "--stream", choices=("auto", "on", "off"), default="auto",
        help="read, quantize and write one decoder layer at a time, resumable after a crash (auto: when "
        "--out is given and the model would take over half of --max-memory, or a run into --out was "
        "interrupted; default: %(default)s)",
    )  # fmt: skip
    q.add_argument(
        "--max-memory", default="auto", metavar="SIZE",
        help="host-memory budget, e.g. 8GB, 512MB, 1.5TB (powers of 1024) or auto (the memory available "
        "now): one layer's calibration activations spill to a temporary folder beside --out when they "
        "would take over 40%% of it, and --stream auto streams when the float weights would take over "
        "half of it; default: %(default)s",
    )  # fmt: skip

    _rare(*(a for a in q._actions if a.dest in _RARE_QUANTIZE))


def _add_eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="perplexity of a model or a saved quantized folder")
    e.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    e.add_argument("--ppl", default="wikitext2", help="wikitext2, a text file, or none (skip perplexity)")
    e.add_argument(
        "--fidelity", nargs="?", const="source", default=None, metavar="REF",
        help="also KL divergence (mean, p99) and top-1 agreement against the float model REF on the "
        "same windows; without REF, the model a saved folder was quantized from (its provenance)",
    )  # fmt: skip
    add_runtime_act_argument(e)
    e.add_argument(
        "--runtime-head", choices=("none", "int8", "q8_0"), default=None,
        help="int8: the output head runs an 8-bit copy of its weight (blocks of 32, llama.cpp's Q8_0); q8_0: "
        "its inputs too are quantized per block of 32 and multiplied in integers, as llama.cpp does (faster "
        "decode, not saved); default none, or $BITMOSAIC_RUNTIME_HEAD",
    )  # fmt: skip
    e.add_argument("--seqlen", type=int, default=512)
    e.add_argument("--max-windows", type=int, default=None)
    e.add_argument("--data-dir", default=None)
    e.add_argument("--json", default=None)
    e.add_argument("--threads", type=int, default=None)
    e.add_argument("--no-progress", action="store_true")
    add_eval_extras(e, quantize=False)
    add_device_args(e)


def _add_inspect_and_methods_parsers(sub) -> None:
    i = sub.add_parser("inspect", help="describe a saved quantized model folder")
    i.add_argument("dir")
    i.add_argument("--layers", action="store_true", help="print the per-layer table")
    i.add_argument(
        "--verify", action="store_true",
        help="hash every file again and compare with the SHA-256 recorded when it was saved (SHA256SUMS); "
        "exit 2 naming the first file that differs",
    )  # fmt: skip

    ms = sub.add_parser("methods", help="list registered methods and their flags, or one method's options")
    ms.add_argument(
        "name", nargs="?", default=None,
        help="one method: its options with help, defaults and ranges (= quantize --help-method NAME)",
    )  # fmt: skip
    ms.add_argument(
        "--markdown", action="store_true",
        help="as a Markdown table (the README's, from scripts/readme_methods.py, adds the saved kind)",
    )  # fmt: skip


@contextlib.contextmanager
def _signals_stop():
    """SIGINT and SIGTERM raise :class:`~bitmosaic.errors.Interrupted` while a command runs, so the
    ``finally`` and ``except BaseException`` blocks on the way remove temporaries and release locks
    (SIGTERM would otherwise end the process at once).  The previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from ..errors import Interrupted

    def stop(signum, frame):
        raise Interrupted(signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..algorithms.hessian import DampingError
    from ..errors import BitmosaicError

    try:
        with _signals_stop():
            return _HANDLERS[args.command](args)
    except KeyboardInterrupt as e:  # SIGINT or SIGTERM: stopped cleanly, exit 128 + the signal
        signum = getattr(e, "signum", signal.SIGINT)
        note = getattr(e, "bitmosaic_note", None) or "temporary files removed, nothing half-written is left"
        print(f"error: interrupted by {signal.Signals(signum).name}; {note}", file=sys.stderr)
        return 128 + signum
    except (BitmosaicError, DampingError, ValueError, FileNotFoundError, FileExistsError, OSError) as e:
        # documented errors: one line, exit 2 (internal bugs still show their traceback)
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2
