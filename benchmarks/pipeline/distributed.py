"""Data-parallel calibration: ``torchrun --nproc-per-node 2 -m bitmosaic quantize`` against one process.

Protocol: SmolLM2-135M, GPTQ w4 g128 (the defaults: act-order, MSE scales), calibration 16 x 512
tokens of WikiText-2 valid (seed 0), the calibration cache off.  Three command lines, each in
fresh processes, in turn, ``--reps`` times:

- ``1 process x 1 thread``   ``python -m bitmosaic quantize ... --threads 1``
- ``1 process x 2 threads``  ``python -m bitmosaic quantize ... --threads 2``
- ``2 processes x 1 thread`` ``torchrun --standalone --nproc-per-node 2 -m bitmosaic quantize ...``
  (no ``--threads``: each rank takes the machine's cores / its local ranks = 1)

Reported: the command's wall time (start-up, model load and save included), the quantization
time (``seconds`` of rank 0's report), the peak RSS of each process (``ru_maxrss`` at the end of
the quantization, before saving; every rank's, from the report's ``distributed`` entry), the
fraction of identical integer codes against ``1 process x 2 threads`` (every quantized linear),
and the perplexity of each saved model on the first ``--max-windows`` x 512 windows of WikiText-2
test (``bitmosaic eval``).  Timings are medians over the reps; codes and perplexity from the first.
The commands run the ``bitmosaic`` this script imports (its folder goes first on ``PYTHONPATH``).

    flock /tmp/bitmosaic-heavy.lock python -m benchmarks.pipeline.distributed
    (benchmarks/results/distributed_smollm2.{json,md})
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import bitmosaic
from benchmarks.harness import machine_info, write_results
from bitmosaic.io import load_quantized, quantized_modules

PY = [sys.executable, "-m"]
CONFIGS = {
    "1 process x 1 thread": [*PY, "bitmosaic", "quantize", "--threads", "1"],
    "1 process x 2 threads": [*PY, "bitmosaic", "quantize", "--threads", "2"],
    "2 processes x 1 thread": [*PY, "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "-m", "bitmosaic", "quantize"],  # fmt: skip
}
REFERENCE = "1 process x 2 threads"
SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    [str(Path(bitmosaic.__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]
)}  # fmt: skip


def _data(a) -> list[str]:
    return ["--data-dir", a.data_dir] if a.data_dir else []


def _flags(a) -> list[str]:
    return ["--model", a.model, "--method", "gptq", "--bits", "4", "--group-size", "128",
            "--nsamples", str(a.nsamples), "--seqlen", str(a.seqlen), "--seed", "0",
            "--no-cache", "--no-progress", "--overwrite", *_data(a)]  # fmt: skip


def _quantize(cmd: list[str], out: Path) -> dict:
    t0 = time.perf_counter()
    js = Path(str(out) + ".json")
    argv = [*cmd, "--out", str(out), "--json", str(js)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=ENV)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rep = json.loads(js.read_text())
    dp = rep["calibration"].get("distributed")
    rss = [rep["peak_rss_mb"]] + (dp["peak_rss_mb_per_rank"][1:] if dp else [])
    return {"wall_seconds": wall, "quantize_seconds": rep["seconds"], "peak_rss_mb": rss, "distributed": dp}


def _codes(path: Path) -> dict[str, torch.Tensor]:
    model, _ = load_quantized(path)
    return {n: m.codes() for n, m in sorted(quantized_modules(model).items())}


def _same(a: dict, b: dict) -> tuple[int, int]:
    assert a.keys() == b.keys() and a, "the two runs quantized different linears"
    return sum(int((a[n] == b[n]).sum()) for n in a), sum(a[n].numel() for n in a)


def _ppl(path: Path, a) -> float:
    js = Path(str(path) + ".ppl.json")
    cmd = [*PY, "bitmosaic", "eval", str(path), "--ppl", "wikitext2", "--seqlen", "512", "--max-windows",
           str(a.max_windows), "--no-progress", "--threads", "2", "--json", str(js), *_data(a)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, env=ENV)
    return json.loads(js.read_text())["ppl"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--nsamples", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--max-windows", type=int, default=20)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--work", default="runs/distributed", help="folder for the quantized models")
    p.add_argument("--data-dir", default=str(SHARED_DATA) if SHARED_DATA.is_dir() else None,
                   help="WikiText-2 folder (default: ../shared/data when present, else $BITMOSAIC_DATA)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for rep in range(a.reps):
        for name, cmd in CONFIGS.items():
            out = work / name.replace(" ", "")
            r = _quantize([*cmd, *_flags(a)], out if rep == 0 else work / "scratch")
            runs[name].append(r)
            rss = ", ".join(f"{v:.0f}" for v in r["peak_rss_mb"])
            print(f"rep {rep} {name:<24} wall {r['wall_seconds']:6.1f}s "
                  f"quantize {r['quantize_seconds']:6.1f}s peak RSS {rss} MB", flush=True)  # fmt: skip
    ref = _codes(work / REFERENCE.replace(" ", ""))
    rows = []
    for name in CONFIGS:
        out = work / name.replace(" ", "")
        same, total = _same(_codes(out), ref)
        rs = runs[name]
        rows.append({
            "config": name,
            "wall_seconds": statistics.median(r["wall_seconds"] for r in rs),
            "quantize_seconds": statistics.median(r["quantize_seconds"] for r in rs),
            "wall_seconds_all": [r["wall_seconds"] for r in rs],
            "quantize_seconds_all": [r["quantize_seconds"] for r in rs],
            "peak_rss_mb_per_process": rs[0]["peak_rss_mb"],
            "identical_codes_vs_reference": same / total,
            "codes_compared": total,
            "ppl": _ppl(out, a),
            "distributed": rs[0]["distributed"],
        })  # fmt: skip
    base = next(r for r in rows if r["config"] == REFERENCE)
    for r in rows:
        r["ppl_rel_diff_vs_reference"] = r["ppl"] / base["ppl"] - 1.0
        r["speedup_vs_reference"] = base["quantize_seconds"] / r["quantize_seconds"]
        r["wall_speedup_vs_reference"] = base["wall_seconds"] / r["wall_seconds"]
    mi = machine_info()
    head = (f"SmolLM2-135M GPTQ w4 g128, calibration {a.nsamples} x {a.seqlen}; WikiText-2 perplexity on "
            f"{a.max_windows} x 512 windows; medians of {a.reps} runs; reference: {REFERENCE}; "
            f"{mi['cpu']}, {mi['cpus']} cores, torch {mi['torch']}")  # fmt: skip
    cols = ["config", "quantize s", "wall s", "speed-up (quantize / wall)", "peak RSS per process MB",
            "identical codes", "perplexity", "ppl vs reference"]  # fmt: skip
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        rss = " / ".join(f"{v:.0f}" for v in r["peak_rss_mb_per_process"])
        lines.append(
            f"| {r['config']} | {r['quantize_seconds']:.1f} | {r['wall_seconds']:.1f} | "
            f"{r['speedup_vs_reference']:.2f}x / {r['wall_speedup_vs_reference']:.2f}x | {rss} | "
            f"{100 * r['identical_codes_vs_reference']:.3f}% | {r['ppl']:.3f} | "
            f"{100 * r['ppl_rel_diff_vs_reference']:+.3f}% |"
        )
    print("\n" + "\n".join(lines))
    write_results(a.json, "distributed_smollm2", {"args": vars(a), "rows": rows, "machine": mi},
                  "\n".join(lines))  # fmt: skip


if __name__ == "__main__":
    main()
