"""The benchmarks' shared flags and the project's two protocols (*fast*, *verdict*): the parser every
SmolLM2 benchmark starts from, how ``--protocol`` settles the calibration and test windows, the label
a run's settings earn, and how rows of an ``--only`` run join an earlier run's."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks.harness.float_reference import default_store

# the two protocols of the project (README, "Data, models, machines"): calibration samples x 512
# tokens, and test windows (None: the whole WikiText-2 test set); verdict rows also get KL and top-1
PROTOCOLS = {"fast": {"nsamples": 16, "max_windows": 20}, "verdict": {"nsamples": 128, "max_windows": None}}


class _Parser(argparse.ArgumentParser):
    def parse_args(self, *a, **kw):  # type: ignore[override]
        args = super().parse_args(*a, **kw)
        settle_protocol(args)
        return args


def base_parser(description: str) -> argparse.ArgumentParser:
    """The flags every SmolLM2 benchmark shares; ``parse_args`` settles ``--protocol``
    (:func:`settle_protocol`)."""
    p = _Parser(description=description)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--nsamples", type=int, default=None, help="calibration samples (default: the protocol's, else 32)"
    )
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument(
        "--max-windows", type=int, default=None,
        help="test windows scored, 0 = the whole test set (default: the protocol's, else 40)",
    )  # fmt: skip
    p.add_argument(
        "--protocol", choices=sorted(PROTOCOLS), default=None,
        help="fast: 16x512 calibration, 20 windows; verdict: 128x512, the whole test set, KL and top-1 "
        "to the float model from the same pass (explicit --nsamples/--max-windows still win)",
    )  # fmt: skip
    p.add_argument("--fidelity", action="store_true", help="KL and top-1 to the float model in every row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="where quantization and evaluation run (cpu, cuda)")
    p.add_argument("--json", default=None, help="output JSON (default benchmarks/results/<name>.json)")
    p.add_argument("--only", default=None, help="comma list of row names to run (default: every row)")
    p.add_argument(
        "--progress", action="store_true",
        help="quantization and evaluation progress bars (with an ETA) on stderr even where it is not a "
        "terminal, such as a log file (default: only on a terminal)",
    )  # fmt: skip
    p.add_argument(
        "--reference-cache", default=None, metavar="DIR",
        help="where KL/top-1 runs keep the float reference's hidden states across runs (default "
        f"{default_store()}; 'none': in memory only)",
    )  # fmt: skip
    return p


def settle_protocol(args) -> None:
    """Fill ``--nsamples``/``--max-windows`` from ``--protocol`` (explicit values win; without a
    protocol: 32 and 40, the benchmarks' historical defaults); ``max_windows`` 0 means every window."""
    want = PROTOCOLS.get(getattr(args, "protocol", None) or "", {"nsamples": 32, "max_windows": 40})
    if getattr(args, "nsamples", None) is None:
        args.nsamples = want["nsamples"]
    if getattr(args, "max_windows", None) is None:
        args.max_windows = want["max_windows"]
    if args.max_windows == 0:
        args.max_windows = None
    if getattr(args, "protocol", None) == "verdict":
        args.fidelity = True


def protocol_label(args) -> str:
    """``fast``/``verdict`` when the settings are that protocol's, else ``custom``."""
    if args.nsamples == 16 and args.max_windows == 20:
        return "fast"
    if args.nsamples >= 128 and args.max_windows is None and getattr(args, "fidelity", False):
        return "verdict"  # at least 128 samples, every window, KL and top-1
    return "custom"


# the settings that make two runs' rows comparable (so rows of an --only run can join an earlier run's)
SAME_RUN = ("model", "nsamples", "seqlen", "max_windows", "seed", "fidelity", "device")


def merged_rows(path: str | os.PathLike, args, rows: list[dict]) -> list[dict]:
    """``rows``, joined -- when ``--only`` picked them -- to the rows of the run already at ``path`` if
    that run had the same settings (:data:`SAME_RUN`): its rows keep their places, a row measured again
    replaces its old self, new rows follow.  So a long run (a verdict on the CPU) can be done a few rows
    per command, even across sessions (on one device: GPTQ's decisions follow float rounding, so rows
    of two devices do not mix)."""
    path = Path(path)
    if not getattr(args, "only", None) or not path.is_file():
        return rows
    try:
        old = json.loads(path.read_text())
    except ValueError:
        return rows
    theirs = {"fidelity": False, "device": "cpu", **(old.get("args") or {})}  # older runs lack these two
    if any(theirs.get(k) != getattr(args, k, None) for k in SAME_RUN):
        print(f"note: {path} holds a run of other settings; it is replaced", flush=True)
        return rows
    new = {r["name"]: r for r in rows}
    kept = [new.pop(r["name"], r) for r in old.get("rows", [])]
    return kept + list(new.values())
