"""Before/after of a CPU decode kernel (issues 74 and 75): the extension compiled from a git commit's
``csrc`` against the current one, timed interleaved in one process so both see the same machine load, at
batch 1 (decode).  Both outputs are checked equal bit for bit first.

* ``--kernel qmatmul`` (``csrc/qmatmul_simd.h``, the integer-weight GEMV of every ``packed`` layer):
  SmolLM2-135M's linear shapes (q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536) and an 8B
  model's (4096x4096), group 128, at 4 and 2 bits.  The change first measured with it: codes of 1-4 bits
  on AVX-512 turned into floats by one ``vpermps`` from a 16-entry table instead of shift-mask-convert.
  ``--shapes smollm2``: one pass over SmolLM2-135M's 210 decoder linears, each its own weight, so the
  weights stream from memory as in a decode step (a single matrix called again and again sits in the
  cache); measured with it: the GEMV's software prefetch, 4 KB ahead of the row being read.
* ``--kernel fp4gemv`` (``csrc/fp4gemv_simd.h``, the MXFP4 / NVFP4 LUT GEMV): the same shapes, both
  formats.  Tried with it and not kept (2026-12-07, under load, 5 rounds): NVFP4's E4M3 block divisors
  looked up by four two-register permutes over eight table registers instead of a 16-lane gather made
  NVFP4 9-11% *slower* at batch 1 (1536x576, 4096x4096) and MXFP4, whose path it did not touch, 3-9%
  slower: the eight table registers held across the tile crowd the accumulators.

Per round and row: the median of calls of each kernel (pybind, no Python wrapper), the two in alternating
order; the table gives the median over rounds of each, the fastest round of each, and the median of the
per-round ratio after / before, with the bytes read per call and the GB/s they make.

    flock /tmp/locks/heavy python -m benchmarks.kernels.kernel_ab --kernel qmatmul --before COMMIT
        [--threads 1,2] [--rounds 15] [--bits 4,2]     (writes benchmarks/results/qmatmul_ab.{json,md})
    flock /tmp/locks/heavy python -m benchmarks.kernels.kernel_ab --kernel fp4gemv --before COMMIT
        (writes benchmarks/results/fp4gemv_ab.{json,md})
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import cpu_name, machine_bounds, median_ms, write_results
from bitmosaic.formats.mx import mx_quantize
from bitmosaic.kernels import build, fp4lut, qmatmul
from bitmosaic.kernels.fp4lut import FP4LutWeight
from bitmosaic.kernels.isa import isa_number, kernel_isa
from bitmosaic.kernels.qmatmul import LowBitWeight

SOURCES = {"qmatmul": "qmatmul.cpp", "fp4gemv": "fp4gemv.cpp"}
CSRC = "src/bitmosaic/kernels/csrc"
ROOT = Path(__file__).resolve().parents[2]
SHAPES = "576x576,192x576,1536x576,576x1536,4096x4096"


def build_before(commit: str, kernel: str):
    """The ``kernel`` extension of ``commit`` (its ``csrc`` in a temporary folder, built by torch under a
    name of its own, cached by torch across runs)."""
    from torch.utils import cpp_extension

    def git(*args: str) -> bytes:
        return subprocess.check_output(["git", "-C", str(ROOT), *args])

    sha = git("rev-parse", commit).decode().strip()
    tmp = Path(tempfile.mkdtemp(prefix=f"{kernel}_before_"))
    for f in git("ls-tree", "--name-only", sha, CSRC + "/").decode().split():
        (tmp / Path(f).name).write_bytes(git("show", f"{sha}:{f}"))
    # its torch.library operator under a namespace of its own (the current build registers bitmosaic::)
    src = tmp / SOURCES[kernel]
    src.write_text(re.sub(r"TORCH_LIBRARY(_FRAGMENT|_IMPL)\(bitmosaic,", r"TORCH_LIBRARY\1(bitmosaic_before,",
                          src.read_text()))  # fmt: skip
    return cpp_extension.load(
        name=f"bitmosaic_{kernel}_at_{sha[:10]}", sources=[str(src)],
        extra_cflags=build._CFLAGS, extra_ldflags=["-fopenmp"], verbose=False,
    ), sha  # fmt: skip


def interleaved(before, after, rounds: int, label: str, digits: int = 4, **timer) -> dict:
    """``before`` and ``after`` timed in alternating order, ``rounds`` times (``median_ms`` of each per
    round): the median over rounds of each, the fastest round of each, the median per-round ratio
    after / before, and every round's time; printed on one line after ``label``."""
    tb, ta = [], []
    for r in range(rounds):
        for f in (before, after) if r % 2 == 0 else (after, before):
            (tb if f is before else ta).append(median_ms(f, **timer))
    ratios = [a / b for a, b in zip(ta, tb, strict=True)]
    out = {"before_ms": statistics.median(tb), "after_ms": statistics.median(ta), "before_min_ms": min(tb),
           "after_min_ms": min(ta), "ratio_median": statistics.median(ratios), "before_rounds_ms": tb,
           "after_rounds_ms": ta}  # fmt: skip
    f = f".{digits}f"
    print(f"{label}: before {out['before_ms']:{f}} (min {out['before_min_ms']:{f}})  after "
          f"{out['after_ms']:{f}} (min {out['after_min_ms']:{f}})  after/before {out['ratio_median']:.3f}",
          flush=True)  # fmt: skip
    return out


def _int_case(N: int, K: int, bits: int, g):
    gs = 128
    G = -(-K // gs)
    codes = torch.randint(0, 2**bits, (N, K), generator=g)
    w = LowBitWeight.from_codes(codes, bits, torch.rand(N, G, generator=g) * 0.01 + 1e-3,
                                torch.randint(0, 2**bits, (N, G), generator=g).float(), gs)  # fmt: skip
    x = torch.randn(1, K, generator=g)
    args = (x, *w._args(), 8)
    return args, w.nbytes()


def _fp4_case(N: int, K: int, fmt: str, g):
    t = mx_quantize(torch.randn(N, K, generator=g) * 0.02, fmt, rule="round")
    w = FP4LutWeight.from_tensor(t)
    x = torch.randn(1, K, generator=g)
    return (x, *w._args()), w.nbytes()


def measure(kernel: str, old, new, N: int, K: int, variant, rounds: int, isa: int, g) -> dict:
    args, wbytes = (_int_case if kernel == "qmatmul" else _fp4_case)(N, K, variant, g)
    call = "qmatmul" if kernel == "qmatmul" else "fp4_gemv"

    def before():
        return getattr(old, call)(*args, isa)

    def after():
        return getattr(new, call)(*args, isa)

    assert torch.equal(before(), after()), f"{N}x{K} {variant}: outputs differ"
    nbytes = wbytes + K * 4
    threads = torch.get_num_threads()
    t = interleaved(before, after, rounds, f"{N}x{K} {variant} t{threads}", budget_s=0.2, max_reps=400)
    return {"shape": [N, K], "variant": variant, "threads": threads, "rounds": rounds, **t, "bytes": nbytes,
            "after_gbs": nbytes / t["after_ms"] / 1e6}  # fmt: skip


# one SmolLM2-135M decoder layer's linears (out x in), 30 layers: a decode token's whole weight stream
SMOLLM2_LAYER = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))


def measure_stream(old, new, bits: int, rounds: int, isa: int, g) -> dict:
    """``--shapes smollm2``: one pass over SmolLM2-135M's 210 decoder linears as a token reads them, each
    its own weight (57 MB at 4 bits, beyond the caches: the weights come from memory as at decode, where
    a single-matrix row reads them from cache after its first call), before and after interleaved."""
    cases = [_int_case(N, K, bits, g) for _ in range(30) for N, K in SMOLLM2_LAYER]
    for args, _ in cases[:7]:
        assert torch.equal(old.qmatmul(*args, isa), new.qmatmul(*args, isa)), "outputs differ"

    def before():
        for args, _ in cases:
            old.qmatmul(*args, isa)

    def after():
        for args, _ in cases:
            new.qmatmul(*args, isa)

    nbytes = sum(b + a[0].shape[1] * 4 for a, b in cases)
    threads = torch.get_num_threads()
    _, read_gbs = machine_bounds(threads)  # the machine's read bandwidth at these threads, this run
    t = interleaved(before, after, rounds, f"smollm2 stream {bits}-bit t{threads}", budget_s=1.0, max_reps=50)
    return {"shape": ["smollm2", "210 linears"], "variant": bits, "threads": threads, "rounds": rounds, **t,
            "bytes": nbytes, "after_gbs": nbytes / t["after_ms"] / 1e6, "read_gbs": read_gbs}  # fmt: skip


def _shape(r: dict) -> str:
    if r["shape"][0] == "smollm2":
        return f"SmolLM2-135M decode stream, 210 linears (memory read {r['read_gbs']:.1f} GB/s)"
    return f"{r['shape'][0]}x{r['shape'][1]}"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Decode kernel before/after: before = the `{meta['kernel']}` kernel at "
        f"{meta['before'][:10]}, after = this version; ms per call at batch 1{meta['what']}, "
        f"ISA {meta['isa']}, {meta['cpu']}, torch "
        f"{meta['torch']}; {meta['rounds']} interleaved rounds per row (median over rounds, fastest round, "
        f"median of the per-round ratio); outputs equal bit for bit. Load average (1 min) "
        f"{meta['load_start']:.2f} at the start, {meta['load_end']:.2f} at the end.",
        "",
        f"| shape | {meta['variant']} | threads | before ms | after ms | before min | after min | "
        "after/before | GB/s after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {_shape(r)} | {r['variant']} | {r['threads']} | {r['before_ms']:.4f} | "
            f"{r['after_ms']:.4f} | {r['before_min_ms']:.4f} | {r['after_min_ms']:.4f} | "
            f"{r['ratio_median']:.3f} | {r['after_gbs']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=sorted(SOURCES), default="qmatmul", help="which extension")
    p.add_argument("--before", required=True, help="git commit of the kernel to compare with")
    p.add_argument(
        "--shapes",
        default=SHAPES,
        help="comma-separated OUTxIN shapes; smollm2: the decode "
        "weight stream, all 210 of SmolLM2-135M's linears in one pass (qmatmul)",
    )
    p.add_argument("--bits", default="4,2", help="qmatmul: comma-separated code widths")
    p.add_argument("--threads", default="1", help="comma-separated thread counts")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds per row")
    p.add_argument("--json", default=None, help="results file (default benchmarks/results/<kernel>_ab.json)")
    a = p.parse_args()
    new = (qmatmul if a.kernel == "qmatmul" else fp4lut).extension()
    if new is None:
        raise SystemExit(f"the {a.kernel} extension is not compiled here")
    old, sha = build_before(a.before, a.kernel)
    variants = [int(b) for b in a.bits.split(",")] if a.kernel == "qmatmul" else ["mxfp4", "nvfp4"]
    meta = {"kernel": a.kernel, "before": sha, "isa": kernel_isa(ext=new), "cpu": cpu_name(),
            "torch": torch.__version__, "rounds": a.rounds, "load_start": os.getloadavg()[0],
            "what": ", group 128" if a.kernel == "qmatmul" else "",
            "variant": "bits" if a.kernel == "qmatmul" else "format"}  # fmt: skip
    isa = isa_number(ext=new)
    g = torch.Generator().manual_seed(0)
    rows = []
    for t in (int(v) for v in a.threads.split(",")):
        torch.set_num_threads(t)
        for s in a.shapes.split(","):
            if s == "smollm2":
                if a.kernel != "qmatmul":
                    raise SystemExit("--shapes smollm2 (the decode weight stream) is a qmatmul row")
                rows.extend(measure_stream(old, new, v, a.rounds, isa, g) for v in variants)
                continue
            N, K = (int(v) for v in s.split("x"))
            for v in variants:
                rows.append(measure(a.kernel, old, new, N, K, v, a.rounds, isa, g))
    meta["load_end"] = os.getloadavg()[0]
    md = markdown(rows, meta)
    print(md)
    name = f"{a.kernel}_ab"
    write_results(Path(a.json) if a.json else None, name, {"meta": meta, "rows": rows}, md)


if __name__ == "__main__":
    main()
