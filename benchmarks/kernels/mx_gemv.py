"""Decode latency of the FP4 LUT GEMV (``kernels/fp4lut.py``, issue 75 item 5) on MXFP4 and NVFP4 weights,
against the ``mx`` kind's reference tiles, float ``F.linear`` (fp32 and bf16) and our INT4 g32 kernels on
the same shape, all measured in one run, with the machine's read-bandwidth bound beside.

Rows: SmolLM2-135M (576x576, 1536x576, 576x1536) and Llama-3-8B (4096x4096, 14336x4096, 4096x14336)
``[out, in]`` shapes; 1 and 2 threads; batch 1 (one decode token), and batch 8 at 4096x4096.  Columns (ms
per GEMV, median after a warm-up; a decode token costs the sum over a model's linears):

* ``MXFP4 LUT`` / ``NVFP4 LUT``: :class:`~bitmosaic.kernels.fp4lut.FP4LutWeight` (the ``mx`` kind's CPU
  choice), on the best ISA here; ``MXFP4 tiles``: the reference kernel
  (:class:`~bitmosaic.kernels.fp4lut.MXTiledWeight`: exact rows dequantized a tile at a time + ``torch.mm``,
  what the kind ran before), batch 1 on the SmolLM2 shapes and 4096x4096 only (it is slow);
* ``INT4 g32``: :class:`~bitmosaic.kernels.qmatmul.LowBitWeight` at 4 bits, group 32 (the packed kind's
  CPU choice at W4: the same bits per weight as MXFP4 with a float32 scale and zero-point per 32), and
  ``INT4 LUT``: the bit-plane LUT (:class:`~bitmosaic.kernels.lut.BitPlaneWeight`) on the same codes;
* ``fp32`` / ``bf16``: ``F.linear`` with a float weight;
* ``bound``: the bytes the MXFP4 kernel reads (its layout: codes plus the scale bytes it decodes; before
  the kernel read the scale bytes, codes plus float32 divisors) over the read bandwidth measured in the
  same run at the same thread count (``torch.sum`` over 512 MiB, best of 5); ``x bound`` = MXFP4 LUT ms /
  bound; ``MXFP4 B/w`` / ``NVFP4 B/w``: the kernels' resident bits per weight;
* ``load``: the machine's 1-minute load average when the row started (``os.getloadavg``: other jobs on a
  shared machine show there).

    flock /tmp/locks/heavy python -m benchmarks.kernels.mx_gemv [--shapes 576x576,...] [--threads 1,2]
        [--label NAME] [--name FILE]
    (writes benchmarks/results/mx_gemv.{json,md}; a run replaces only the rows it measured -- same shape,
    threads, batch and label -- so the 8B shapes can be measured in a separate, shorter run, and runs of
    two versions of the kernel side by side: ``--label`` names the version in a column of its own)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.nn import functional as F

from benchmarks.harness import RESULTS, cpu_name, machine_info, median_ms, read_bandwidth_gbs, write_results
from bitmosaic.formats.mx import mx_quantize
from bitmosaic.kernels import fp4lut
from bitmosaic.kernels.fp4lut import FP4LutWeight, MXTiledWeight
from bitmosaic.kernels.isa import kernel_isa
from bitmosaic.kernels.lut import BitPlaneWeight
from bitmosaic.kernels.qmatmul import LowBitWeight

SHAPES = [(576, 576), (1536, 576), (576, 1536), (4096, 4096), (14336, 4096), (4096, 14336)]
SMALL = {(576, 576), (1536, 576), (576, 1536), (4096, 4096)}  # where the reference tiles are timed
GS = 32
NAME = "mx_gemv"


def int4_weights(N: int, K: int, g: torch.Generator):
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32)
    scales = torch.rand(N, K // GS, generator=g) * 0.01 + 1e-3
    zeros = torch.randint(6, 10, (N, K // GS), generator=g).float()
    low = LowBitWeight.from_codes(codes, 4, scales, zeros, GS)
    lut = BitPlaneWeight.from_codes(codes, 4, scales, zeros, GS)
    return low, lut


def measure(N: int, K: int, threads_list: list[int], bw: dict, g: torch.Generator, label=None) -> list[dict]:
    W = torch.randn(N, K, generator=g) * 0.02
    torch.set_num_threads(1)  # building is single-threaded: quiet on a shared machine
    mx, nv = (FP4LutWeight.from_tensor(mx_quantize(W, f, rule="round")) for f in ("mxfp4", "nvfp4"))
    tiles = MXTiledWeight.from_tensor(mx_quantize(W, "mxfp4", rule="round"))
    low, lut = int4_weights(N, K, g)
    Wb = W.bfloat16()
    rows = []
    for threads in threads_list:
        torch.set_num_threads(threads)
        for M in (1, 8) if (N, K) == (4096, 4096) else (1,):
            x = torch.randn(M, K, generator=g)
            xb = x.bfloat16()
            r = {
                "shape": [N, K], "threads": threads, "batch": M, "label": label, "load": os.getloadavg()[0],
                "mxfp4_lut_ms": median_ms(lambda: mx.matmul(x)),  # noqa: B023
                "nvfp4_lut_ms": median_ms(lambda: nv.matmul(x)),  # noqa: B023
                "int4_g32_ms": median_ms(lambda: low.matmul(x)),  # noqa: B023
                "int4_g32_lut_ms": median_ms(lambda: lut.matmul(x)),  # noqa: B023
                "fp32_ms": median_ms(lambda: F.linear(x, W)),  # noqa: B023
                "bf16_ms": median_ms(lambda: F.linear(xb, Wb), budget_s=0.3, max_reps=10),  # noqa: B023
                "mxfp4_tiles_ms": None,
                "mxfp4_bytes": mx.nbytes(), "nvfp4_bytes": nv.nbytes(), "int4_g32_bytes": low.nbytes(),
                "read_gbs": bw[threads],
            }  # fmt: skip
            if (N, K) in SMALL and M == 1:
                r["mxfp4_tiles_ms"] = median_ms(lambda: tiles.matmul(x), budget_s=0.3, max_reps=10)  # noqa: B023
            r["bound_ms"] = mx.nbytes() / (bw[threads] * 1e9) * 1e3
            r["x_bound"] = r["mxfp4_lut_ms"] / r["bound_ms"]
            rows.append(r)
            print(
                f"{N}x{K} t{threads} b{M}: MXFP4 {r['mxfp4_lut_ms']:.3f}  NVFP4 {r['nvfp4_lut_ms']:.3f}  "
                f"INT4 {r['int4_g32_ms']:.3f}  INT4-LUT {r['int4_g32_lut_ms']:.3f}  fp32 {r['fp32_ms']:.3f}  "
                f"bf16 {r['bf16_ms']:.3f}  tiles {r['mxfp4_tiles_ms']}  bound {r['bound_ms']:.3f}",
                flush=True,
            )
    return rows


def _f(v) -> str:
    return "—" if v is None else f"{v:.3f}"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"FP4 LUT GEMV (issue 75), ms per GEMV (median); {meta['cpu']}; ISA {meta['isa']}; "
        f"torch {meta['torch']}. "
        "bound = the MXFP4 kernel's bytes / read bandwidth measured in the same run (GB/s column); "
        "B/w: the kernel's resident bits per weight; load: 1-minute load average at the row's start. "
        "INT4 g32: LowBitWeight (the packed kind's W4 kernel); INT4 LUT: the bit-plane LUT, same codes. "
        "MXFP4 tiles: the reference kernel (dequantized tiles + mm).",
        "",
        "| shape | threads | batch | kernel | MXFP4 LUT | NVFP4 LUT | MXFP4 tiles | INT4 g32 | INT4 LUT "
        "| fp32 | bf16 | bound | x bound | GB/s | MXFP4/INT4 | fp32/MXFP4 | MXFP4 B/w | NVFP4 B/w | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n_w = r["shape"][0] * r["shape"][1]
        load = r.get("load")
        lines.append(
            f"| {r['shape'][0]}x{r['shape'][1]} | {r['threads']} | {r['batch']} | {r.get('label') or '—'} | "
            f"{_f(r['mxfp4_lut_ms'])} | "
            f"{_f(r['nvfp4_lut_ms'])} | {_f(r['mxfp4_tiles_ms'])} | {_f(r['int4_g32_ms'])} | "
            f"{_f(r['int4_g32_lut_ms'])} | {_f(r['fp32_ms'])} | {_f(r['bf16_ms'])} | {_f(r['bound_ms'])} | "
            f"{r['x_bound']:.2f} | {r['read_gbs']:.1f} | {r['mxfp4_lut_ms'] / r['int4_g32_ms']:.2f} | "
            f"{r['fp32_ms'] / r['mxfp4_lut_ms']:.2f} | {r['mxfp4_bytes'] * 8 / n_w:.3f} | "
            f"{r['nvfp4_bytes'] * 8 / n_w:.3f} | {'—' if load is None else f'{load:.2f}'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None, help="comma-separated OUTxIN shapes (default: all six)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--name", default=NAME, help="results file name (benchmarks/results/NAME.{json,md})")
    p.add_argument("--label", default=None, help="the kernel version measured (a column)")
    a = p.parse_args()
    if fp4lut.extension() is None:
        print("the FP4 LUT extension is not compiled here: the rows would time the reference tiles")
        sys.exit(2)
    shapes = SHAPES
    if a.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    threads_list = [int(t) for t in a.threads.split(",")]
    bw = {}
    for t in threads_list:
        torch.set_num_threads(t)
        bw[t] = read_bandwidth_gbs()
        print(f"{t} thread(s): read bandwidth {bw[t]:.1f} GB/s", flush=True)
    g = torch.Generator().manual_seed(0)
    rows = [r for N, K in shapes for r in measure(N, K, threads_list, bw, g, a.label)]
    out = RESULTS / f"{a.name}.json"

    def key(r):
        return tuple(r["shape"]), r["threads"], r["batch"], r.get("label")

    if out.exists():  # keep the rows not measured in this run (stable sort: runs in their order)
        new = {key(r) for r in rows}
        rows = [r for r in json.loads(out.read_text()).get("rows", []) if key(r) not in new] + rows
    rows.sort(key=lambda r: (SHAPES.index(tuple(r["shape"])) if tuple(r["shape"]) in SHAPES else 99,
                             r["threads"], r["batch"]))  # fmt: skip
    meta = {"cpu": cpu_name(), "isa": kernel_isa(ext=fp4lut.extension()), "torch": torch.__version__,
            "cpus": os.cpu_count(), "group_size_int4": GS}  # fmt: skip
    md = markdown(rows, meta)
    print(md)
    write_results(out, a.name, {"meta": meta, "machine": machine_info(), "rows": rows}, md)


if __name__ == "__main__":
    main()
