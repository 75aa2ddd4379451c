"""Flags of method ``sfmp`` (SFMP: budget, blocks, reordering ablation, solver, Fisher samples)."""

from __future__ import annotations

import argparse

__all__ = ["add_sfmp_args", "sfmp_options"]


def _block(text: str) -> tuple[int, int]:
    try:
        mb, nb = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError("--block must look like 512x128 (rows x columns)") from None
    if mb < 1 or nb < 1:
        raise argparse.ArgumentTypeError("--block sizes must be positive")
    return mb, nb


def add_sfmp_args(q: argparse.ArgumentParser) -> None:
    s = q.add_argument_group("sfmp (block-wise mixed precision; exactly one budget flag)")
    s.add_argument("--avg-bits", type=float, default=None, help="average code bits b (e.g. 2.75)")
    s.add_argument("--bpw", type=float, default=None, help="total stored bits per weight (b + overhead)")
    s.add_argument("--budget-mb", type=float, default=None, help="MiB of stored quantized linears")
    s.add_argument("--no-row-reorder", action="store_true", help="keep the natural row order")
    s.add_argument("--no-col-reorder", action="store_true", help="keep the natural column order")
    s.add_argument("--sfmp-solver", choices=["awq", "gptq"], default=None, help="block quantizer (awq)")
    s.add_argument(
        "--rank",
        choices=["mean", "sum"],
        default=None,
        help="block ranking: mean (default) | the paper's sum",
    )
    s.add_argument("--fisher-samples", type=int, default=None, help="samples for the Fisher salience")
    s.add_argument("--fisher-cache", default=None, help="Fisher cache folder ('none' = off)")


_SFMP_FLAGS = {
    "avg_bits": "avg_bits",
    "bpw": "bpw",
    "budget_mb": "budget_mb",
    "sfmp_solver": "solver",
    "rank": "rank",
    "fisher_samples": "fisher_samples",
}


def sfmp_options(args, names: set[str], method: str) -> dict:
    """Config fields from the sfmp flags that were given (an error for another method)."""
    opts: dict = {}
    for arg, fld in _SFMP_FLAGS.items():
        if getattr(args, arg, None) is not None:
            opts[fld] = getattr(args, arg)
    if getattr(args, "block", None) is not None and "block_rows" in names:  # --block is shared with mosaic
        try:
            opts["block_rows"], opts["block_cols"] = _block(args.block)
        except argparse.ArgumentTypeError as e:
            raise ValueError(str(e)) from None
    if getattr(args, "no_row_reorder", False):
        opts["row_reorder"] = False
    if getattr(args, "no_col_reorder", False):
        opts["col_reorder"] = False
    if getattr(args, "fisher_cache", None) is not None:
        opts["fisher_cache"] = None if args.fisher_cache.lower() == "none" else args.fisher_cache
    bad = sorted(k for k in opts if k not in names)
    if bad:
        raise ValueError(f"sfmp flags ({', '.join(bad)}) do not apply to method {method!r}")
    return opts
