"""Resume inside a MoE layer at a real shape (issue 71, item 4: "resume after kill -9 works per expert").

One streamed GPTQ w4 g128 run of a MoE checkpoint (e.g. the one-layer cut of the Qwen3-30B-A3B-shaped
FP8 checkpoint, ``benchmarks.scale.real_shapes write --shape qwen3-30b-a3b --fp8 --write-layers 1``) is
run three times with the CLI: uninterrupted (the reference), then killed with ``kill -9`` once ``--kill-at``
solves of the layer are journaled (``.OUT.partial/layer-00000/unit-*.safetensors``, pipeline/journal.py),
then the same command again.  Reported: the wall time of each, the solves kept, and whether every tensor of
the resumed output equals the reference's bit for bit.  The machine's load average is printed beside the
times (they are wall times on a shared 2-core machine unless it was quiet).

    python -m benchmarks.scale.moe_resume --dir /path/q30_fp8_1l --threads 2 --kill-at 150
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.harness import RESULTS, machine_info, write_results
from benchmarks.scale.real_shapes import quantize_argv, run
from bitmosaic.pipeline.journal import journal_dir
from bitmosaic.pipeline.stream import partial_dir


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _same(a: Path, b: Path) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)


def killed_run(folder: Path, out: Path, threads, nsamples: int, kill_at: int, layer: int = 0) -> dict:
    """Start the CLI and ``kill -9`` it once ``kill_at`` solves of ``layer`` are journaled."""
    units = journal_dir(partial_dir(out), layer)
    t0 = time.perf_counter()
    p = subprocess.Popen(quantize_argv(folder, out, threads, nsamples))
    n = 0
    while p.poll() is None and n < kill_at:
        time.sleep(0.2)
        n = len(list(units.glob("unit-*.safetensors")))
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    kept = len(list(units.glob("unit-*.safetensors")))
    return {"killed_after_s": time.perf_counter() - t0, "units_kept": kept}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="the MoE checkpoint folder (with calib.txt)")
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nsamples", type=int, default=16)
    ap.add_argument("--kill-at", type=int, default=150, help="journaled solves of layer 0 before kill -9")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ref, out = (args.dir.with_name(f"{args.dir.name}-{s}") for s in ("resume-ref", "resume-out"))
    for d in (ref, out, partial_dir(ref), partial_dir(out)):
        shutil.rmtree(d, ignore_errors=True)
    whole = run(args.dir, args.shape, 0, ref, args.threads, args.nsamples)
    load_whole = os.getloadavg()
    kill = killed_run(args.dir, out, args.threads, args.nsamples, args.kill_at)
    load_kill = os.getloadavg()
    again = run(args.dir, args.shape, 0, out, args.threads, args.nsamples)
    load_again = os.getloadavg()
    same = whole["finished"] and again["finished"] and _same(ref, out)
    row = {"shape": args.shape, "checkpoint": args.dir.name, "calibration": f"{args.nsamples} x 512",
           "threads": args.threads, "uninterrupted_s": whole["wall_s"], **kill, "resumed_s": again["wall_s"],
           "peak_rss_mb": {"uninterrupted": whole["peak_rss_mb"], "resumed": again["peak_rss_mb"]},
           "identical_bytes": bool(same), "load_avg_1m": {"uninterrupted": load_whole[0],
           "killed": load_kill[0], "resumed": load_again[0]}}  # fmt: skip
    md = ["# Resume inside a MoE layer after kill -9 (issue 71)", "",
          f"`python -m benchmarks.scale.moe_resume --dir {args.dir.name} --threads {args.threads} "
          f"--kill-at {args.kill_at}`: streamed GPTQ w4 g128, {args.nsamples} x 512 calibration; wall times "
          "with the 1-minute load average after each (a shared 2-core machine).", "",
          "| run | wall s | load | note |", "|---|---|---|---|",
          f"| uninterrupted | {whole['wall_s']:.0f} | {load_whole[0]:.1f} | reference |",
          f"| killed (kill -9) | {kill['killed_after_s']:.0f} | {load_kill[0]:.1f} | "
          f"{kill['units_kept']} solves journaled |",
          f"| same command again | {again['wall_s']:.0f} | {load_again[0]:.1f} | statistics redone, only "
          f"unjournaled solves run |", "",
          f"Resumed output identical to the uninterrupted one, every tensor: **{same}**."]  # fmt: skip
    path = Path(args.json or RESULTS / "moe_resume.json")
    write_results(path, "moe_resume", {"runs": {args.shape: row}, "machine": machine_info()}, "\n".join(md))
    print("\n".join(md))
    for d in (ref, out):
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
