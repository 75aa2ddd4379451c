"""Before/after of the FP4 LUT GEMV reading its stored scale bytes (issue 75): the kernel as it was at a git
commit (float32 divisors precomputed at build time and handed in: 5 bits per weight for MXFP4, 6 for
NVFP4), compiled from that commit's ``csrc``, against the current one (the E8M0/E4M3 scale bytes decoded
inside the kernel: 4.25 / 4.5 bits), timed interleaved in one process so both see the same machine load
(the machine is shared: ``mx_gemv.py`` run once per version saw other jobs move its INT4 column 2x).

Per round and row (shape, format, rows of x): the median of calls of each kernel (pybind, no Python
wrapper), the two in alternating order; the table gives the median over rounds of each, the fastest round
of each, and the median over rounds of the per-round ratio after / before.  Both outputs are checked equal
bit for bit first (the divisors are the same values).  One thread; the load average (1 minute) at the
start and the end of the run is in the header.

    flock /tmp/locks/heavy python -m benchmarks.kernels.mx_gemv_ab [--before 51ddcd8] [--shapes 4096x4096]
        [--rounds 15] [--batches 1,8]
    (writes benchmarks/results/mx_gemv_ab.{json,md})
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.harness import cpu_name, write_results
from benchmarks.kernels import kernel_ab
from bitmosaic.formats.mx import element_divisor, mx_quantize
from bitmosaic.kernels import fp4lut
from bitmosaic.kernels.fp4lut import TILE, FP4LutWeight
from bitmosaic.kernels.isa import isa_number, kernel_isa

NAME = "mx_gemv_ab"


def measure(old, new, N: int, K: int, fmt: str, M: int, rounds: int, isa: int, g) -> dict:
    t = mx_quantize(torch.randn(N, K, generator=g) * 0.02, fmt, rule="round")
    w = FP4LutWeight.from_tensor(t)
    div = element_divisor(t.scale_values(), t.fmt, t.global_scale)  # what the old kernel was handed
    div_t = torch.nn.functional.pad(div.T, (0, w.data.shape[0] * TILE - N)).contiguous()
    x = torch.randn(M, K, generator=g)

    def before():
        return old.fp4_gemv(x, w.data, div_t, N, K, w.block, isa)

    def after():
        return new.fp4_gemv(x, w.data, w.scales_t, N, K, w.block, w.scale_kind, w.global_scale, isa)

    assert torch.equal(before(), after()), f"{fmt} {N}x{K} M={M}: outputs differ"
    row = {
        "shape": [N, K], "format": fmt, "batch": M, "rounds": rounds,
        **kernel_ab.interleaved(before, after, rounds, f"{N}x{K} {fmt} b{M}", 3, budget_s=0.25, max_reps=100),
        "before_bits_per_weight": (w.data.numel() + div_t.numel() * 4) * 8 / (N * K),
        "after_bits_per_weight": w.nbytes() * 8 / (N * K),
    }  # fmt: skip
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"FP4 LUT GEMV before/after reading the stored scale bytes (issue 75): before = the kernel at "
        f"{meta['before'][:10]} (float32 divisors handed in), after = this version (E8M0/E4M3 bytes decoded "
        f"in the kernel); ms per GEMV, {meta['threads']} thread, ISA {meta['isa']}, {meta['cpu']}, torch "
        f"{meta['torch']}; {meta['rounds']} interleaved rounds per row (median over rounds, fastest round, "
        f"median of the per-round ratio); outputs equal bit for bit. Load average (1 min) "
        f"{meta['load_start']:.2f} at the start, {meta['load_end']:.2f} at the end (2 cores shared with "
        "other jobs).",
        "",
        "| shape | format | batch | before ms | after ms | before min | after min | after/before | "
        "bits/weight before | bits/weight after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape'][0]}x{r['shape'][1]} | {r['format']} | {r['batch']} | {r['before_ms']:.3f} | "
            f"{r['after_ms']:.3f} | {r['before_min_ms']:.3f} | {r['after_min_ms']:.3f} | "
            f"{r['ratio_median']:.3f} | {r['before_bits_per_weight']:.3f} | "
            f"{r['after_bits_per_weight']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default="51ddcd8", help="git commit of the float-divisor kernel")
    p.add_argument("--shapes", default="4096x4096", help="comma-separated OUTxIN shapes")
    p.add_argument("--batches", default="1,8", help="comma-separated rows of x")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds per row")
    a = p.parse_args()
    new = fp4lut.extension()
    if new is None:
        raise SystemExit("the FP4 LUT extension is not compiled here")
    torch.set_num_threads(1)
    old, sha = kernel_ab.build_before(a.before, "fp4gemv")
    meta = {"before": sha, "threads": 1, "isa": kernel_isa(ext=new), "cpu": cpu_name(),
            "torch": torch.__version__, "rounds": a.rounds, "load_start": os.getloadavg()[0]}  # fmt: skip
    isa = isa_number(ext=new)
    g = torch.Generator().manual_seed(0)
    rows = []
    for s in a.shapes.split(","):
        N, K = (int(v) for v in s.split("x"))
        for fmt in ("mxfp4", "nvfp4"):
            for M in (int(b) for b in a.batches.split(",")):
                rows.append(measure(old, new, N, K, fmt, M, a.rounds, isa, g))
    meta["load_end"] = os.getloadavg()[0]
    md = markdown(rows, meta)
    print(md)
    write_results(None, NAME, {"meta": meta, "rows": rows}, md)


if __name__ == "__main__":
    main()
