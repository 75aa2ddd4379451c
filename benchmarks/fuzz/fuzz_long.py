"""The long fuzz run (issue 26, section 3): every property of ``benchmarks/fuzz/properties.py`` -- the test
suite's fuzzing of every parser of untrusted input -- for many more cases, each with its own random seed
unless ``--derandomize``.  Writes ``benchmarks/results/fuzz_long.{json,md}``: per property the cases run,
the seconds, and how the inputs ended (accepted, or refused with which one-line error); a property that
finds a defect records its exception and the run exits 1.  Each property runs in a process of its own, so
a crash is recorded as that property's defect and one property's failure cannot change the next.

    python -m benchmarks.fuzz.fuzz_long --examples 5000            # every property, 5000 cases each
    python -m benchmarks.fuzz.fuzz_long --examples 20000 --only grammars recipe
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.fuzz.properties import OUTCOMES, PROPERTIES, run
from benchmarks.harness import write_results
from benchmarks.harness.child import module_command


def describe(e: BaseException) -> str:
    """A defect in one line: the exception's type, its own first line and where it was raised.
    hypothesis appends the falsifying input as a note (which can be a 200 kB bytes repr), and wraps an
    exception that its replay did not raise again in a ``FlakyFailure`` (an exception group, raised in
    hypothesis's own code): that is named with what it wraps, so the defect's type, message and place
    are recorded, not hidden behind the wrapper."""
    inner = getattr(e, "exceptions", None)  # an exception group (the backport's too, on Python 3.10)
    if isinstance(inner, (list, tuple)) and inner:
        from hypothesis.errors import Flaky

        how = "its replay did not fail the same way" if isinstance(e, Flaky) else f"{len(inner)} failures"
        return f"{type(e).__name__} ({how}) of " + "; ".join(describe(x) for x in inner)
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    first = (str(e).splitlines() or [""])[0][:400]
    return f"{type(e).__name__}{': ' + first if first else ''}{where}"


def run_one(name: str, n: int, seed: int | None) -> dict:
    """Property ``name`` for ``n`` cases in this process: its row of the results."""
    OUTCOMES.clear()
    t0 = time.perf_counter()
    try:
        run(name, n, seed=seed)
        defect = None
    except Exception as e:  # a defect: recorded, the other properties still run
        defect = describe(e)
    return {
        "property": name,
        "what": PROPERTIES[name].what,
        "examples": n,
        "seconds": round(time.perf_counter() - t0, 1),
        "defect": defect,
        "outcomes": dict(sorted(OUTCOMES.items())),
    }


def in_child(name: str, n: int, seed: int | None, max_memory_gb: float) -> dict:
    """:func:`run_one` in a new process (this script with ``--no-isolate --row``); a child that dies
    without its row (a signal, the OOM killer) is a defect named by how it ended and, from
    faulthandler's dump, the Python line it was at."""
    with tempfile.TemporaryDirectory(prefix="fuzz-long-") as d:
        out, err = Path(d) / "row.json", Path(d) / "stderr"
        cmd = [*module_command("benchmarks.fuzz.fuzz_long"), "--only", name, "--examples", str(n),
               "--scale-slow", "--no-isolate", "--max-memory-gb", str(max_memory_gb),
               "--row", str(out)]  # fmt: skip
        cmd += ["--derandomize"] if seed is None else ["--seed", str(seed)]
        t0 = time.perf_counter()
        with open(err, "wb") as f:
            rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=f).returncode
        text = err.read_text(errors="replace")
        row = json.loads(out.read_text()) if out.is_file() else None
    if row is not None:
        if row["defect"]:  # hypothesis's report of it (the falsifying input, the traceback)
            sys.stderr.write(text[-6000:])
        return row
    sys.stderr.write(text[-3000:])
    fatal = re.search(r"Fatal Python error: ([^\n]*)", text)
    frame = re.search(r'File "([^"]+)", line (\d+)', text[fatal.start() :] if fatal else text)
    how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
    what = (fatal.group(1).strip() + ", " if fatal else "") + how
    where = f" (at {Path(frame.group(1)).name}:{frame.group(2)})" if frame else ""
    return {"property": name, "what": PROPERTIES[name].what, "examples": n,
            "seconds": round(time.perf_counter() - t0, 1),
            "defect": f"the process died: {what}, no result{where}", "outcomes": {}}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=5000, help="cases per property (default: %(default)s)")
    p.add_argument(
        "--scale-slow",
        action="store_true",
        help="give the slow properties (saved_config, gguf, gguf_load) the same count; by default they "
        "get the test suite's share of it (their cases take 0.3-3 s each)",
    )
    p.add_argument("--only", nargs="*", choices=sorted(PROPERTIES), help="these properties only")
    p.add_argument("--seed", type=int, default=None, help="the random seed (default: a new one)")
    p.add_argument("--derandomize", action="store_true", help="the test suite's fixed cases, only more")
    p.add_argument("--json", default=None, help="output JSON (default benchmarks/results/fuzz_long.json)")
    p.add_argument(
        "--max-memory-gb",
        type=float,
        default=8.0,
        help="address-space limit of this process (default %(default)s; 0: none), so that an input that "
        "makes a parser allocate without bound fails as a recorded defect (MemoryError) instead of "
        "the kernel killing the run (what a GGUF layer count of 2^32-1 once did, at 23.7 GB); where the "
        "allocation fails varies, so such a defect is often a FlakyFailure, recorded with what it wraps",
    )
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run each property in a process of its own (default): a crash (a segfault, the kernel's OOM "
        "kill) is recorded as that property's defect instead of ending the run unrecorded, and what a "
        "defect leaves behind (memory its failure still holds, caches) cannot change the next property",
    )
    p.add_argument("--row", help=argparse.SUPPRESS)  # a child of --isolate writes its row here
    args = p.parse_args()
    faulthandler.enable()  # a crash in C code (a failed allocation under the limit): where, not silence
    if args.max_memory_gb > 0:
        import resource

        lim = int(args.max_memory_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    if args.examples < 1:
        p.error(f"--examples {args.examples} must be at least 1")
    seed = None if args.derandomize else (args.seed if args.seed is not None else int(time.time()))
    most = max(prop.examples for prop in PROPERTIES.values())
    rows, failed = [], 0
    for name in args.only or sorted(PROPERTIES):
        prop = PROPERTIES[name]
        n = args.examples if args.scale_slow else max(1, round(args.examples * prop.examples / most))
        row = in_child(name, n, seed, args.max_memory_gb) if args.isolate else run_one(name, n, seed)
        if args.row:  # the child of --isolate: the parent prints and writes the results
            Path(args.row).write_text(json.dumps(row))
            return 0
        rows.append(row)
        failed += row["defect"] is not None
        defect, secs = row["defect"], row["seconds"]
        print(f"{name:14s} {n:7d} cases {secs:8.1f}s  {'DEFECT: ' + defect if defect else 'ok'}", flush=True)
    cmd = "python -m benchmarks.fuzz.fuzz_long " + " ".join(sys.argv[1:])
    md = [
        f"# Long fuzz run\n\n`{cmd}` (seed {seed if seed is not None else 'derandomized'})\n",
        "| property | parses | cases | seconds | accepted | refused (one line) | defect |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = sum(v for k, v in r["outcomes"].items() if k.endswith(": accepted"))
        ref = sum(r["outcomes"].values()) - acc
        md.append(
            f"| {r['property']} | {r['what']} | {r['examples']} | {r['seconds']} | {acc} | {ref} | "
            f"{r['defect'] or 'none'} |"
        )
    md.append("\naccepted/refused count parser calls (one case calls several parsers).")
    write_results(args.json, "fuzz_long", {"command": cmd, "seed": seed, "rows": rows}, "\n".join(md))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
