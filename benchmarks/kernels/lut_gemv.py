"""Batch-1 latency of the bit-plane LUT GEMV (``kernels/lut.py``, SFMP §4.5 / T-MAC) against the
unpack-in-register + FMA GEMV (``kernels/qmatmul.py``, ``LowBitWeight``) on the same codes and bit
map, and against ``F.linear`` on a float32 weight, all measured in one run.

Rows: SmolLM2 (576x576, 1536x576, 576x1536) and Llama-3-8B (4096x4096, 14336x4096) shapes
``[out, in]``; 1 and 2 threads; code widths 1, 2, 3, 4, 8 and the mixes 2.5 / 3.5 (blocks of 512 rows
x 128 columns, half of them at each neighbouring width, interleaved); g128, asymmetric, float32
scales and zero-points.  Columns: the LUT GEMV on its default path (AVX-512 here) and on the AVX2
path, LowBitWeight, fp32 ``F.linear``, their ratios, and the bytes each weight holds.  Times are
medians over repeats after a warm-up.  The linearity check fits ``ms = a + b * bits`` over the
integer widths of each (shape, threads) by least squares and reports ``a / ms(4 bits)`` (0 =
proportional to bits) and R².

    flock /tmp/bitmosaic-heavy.lock python -m benchmarks.kernels.lut_gemv [--quick]
    (writes benchmarks/results/lut_gemv.{json,md})

``--batch``: instead, the LUT kernel at 1-128 rows of ``x`` (speculative decode, small batches,
prefill): up to 64 rows it runs the LUT GEMV once per row, above that a tiled dequantize + mm;
against LowBitWeight (its own multi-row GEMV up to 8 rows, then tiles) and fp32 ``F.linear``, on a
SmolLM2 and an 8B shape at 2, 3 and 4 bits (writes ``lut_gemv_batch.{json,md}``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

from benchmarks.harness import RESULTS, cpu_name, machine_info, median_ms, write_results
from bitmosaic.kernels import lut
from bitmosaic.kernels.isa import available_isas
from bitmosaic.kernels.lut import BitPlaneWeight
from bitmosaic.kernels.qmatmul import LowBitWeight
from bitmosaic.kernels.qmatmul import extension as fma_extension

SHAPES = [(576, 576), (1536, 576), (576, 1536), (4096, 4096), (14336, 4096)]
BITS = [1, 2, 3, 4, 8, 2.5, 3.5]
GS, RB = 128, 512


def make_codes(N: int, K: int, bits: float, g: torch.Generator):
    """codes, bit map [n_rb, G], scales, zeros: half the blocks at each neighbouring width for a mix."""
    G, n_rb = -(-K // GS), -(-N // RB)
    lo = int(bits)
    bmap = torch.full((n_rb, G), lo, dtype=torch.int64)
    if bits != lo:
        bmap += torch.arange(n_rb * G).reshape(n_rb, G) % 2
    hi = (1 << bmap).repeat_interleave(RB, 0)[:N].repeat_interleave(GS, 1)[:, :K]
    codes = (torch.rand(N, K, generator=g) * hi).to(torch.int32)
    scales = torch.rand(N, G, generator=g) * 0.01 + 1e-3
    zeros = torch.randint(0, 4, (N, G), generator=g).float()
    return codes, bmap, scales, zeros


def linearity(rows: list[dict]) -> list[dict]:
    out = []
    for key in sorted({(tuple(r["shape"]), r["threads"]) for r in rows}):
        pts = [r for r in rows if (tuple(r["shape"]), r["threads"]) == key and r["bits"] == int(r["bits"])]
        for col in ("lut_ms", "fma_ms"):
            x = torch.tensor([float(r["bits"]) for r in pts], dtype=torch.float64)
            y = torch.tensor([r[col] for r in pts], dtype=torch.float64)
            A = torch.stack([torch.ones_like(x), x], 1)
            a, b = torch.linalg.lstsq(A, y.unsqueeze(1)).solution.squeeze(1).tolist()
            r2 = 1 - float(((A @ torch.tensor([a, b], dtype=torch.float64) - y) ** 2).sum()) / float(
                ((y - y.mean()) ** 2).sum()
            )
            at4 = next(r[col] for r in pts if r["bits"] == 4)
            ms = {int(r["bits"]): r[col] for r in pts}
            out.append(
                {
                    "shape": list(key[0]), "threads": key[1], "kernel": col[:-3], "intercept_ms": a,
                    "ms_per_bit": b, "intercept_over_w4": a / at4, "r2": r2,
                    "w1_over_w4": ms[1] / at4, "w2_over_w4": ms[2] / at4, "w8_over_w4": ms[8] / at4,
                }
            )  # fmt: skip
    return out


def markdown(rows: list[dict], lin: list[dict], meta: dict) -> str:
    lines = [
        f"Batch-1 GEMV, g{GS}, blocks {RB}x{GS}; {meta['cpu']}; ISA paths {meta['isas']}; "
        f"torch {meta['torch']}.",
        "",
        "| shape | threads | bits | LUT ms | LUT avx2 ms | FMA ms | fp32 ms | LUT/FMA | fp32/LUT "
        "| LUT MiB | FMA MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape'][0]}x{r['shape'][1]} | {r['threads']} | {r['bits']} | {r['lut_ms']:.3f} | "
            f"{r['lut_avx2_ms']:.3f} | {r['fma_ms']:.3f} | {r['fp32_ms']:.3f} | {r['lut_over_fma']:.2f} | "
            f"{r['fp32_over_lut']:.2f} | {r['lut_bytes'] / 2**20:.2f} | {r['fma_bytes'] / 2**20:.2f} |"
        )
    lines += [
        "",
        "Linearity in bits (integer widths 1, 2, 3, 4, 8): least-squares `ms = a + b·bits`.",
        "",
        "| shape | threads | kernel | a ms | b ms/bit | a / ms(W4) | R² | W1/W4 | W2/W4 | W8/W4 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in lin:
        lines.append(
            f"| {r['shape'][0]}x{r['shape'][1]} | {r['threads']} | {r['kernel']} | {r['intercept_ms']:.3f} | "
            f"{r['ms_per_bit']:.3f} | {r['intercept_over_w4']:.2f} | {r['r2']:.3f} | {r['w1_over_w4']:.2f} | "
            f"{r['w2_over_w4']:.2f} | {r['w8_over_w4']:.2f} |"
        )
    return "\n".join(lines) + "\n"


BATCH_SHAPES = [(1536, 576), (4096, 4096)]
BATCH_ROWS = [1, 2, 8, 16, 32, 64, 65, 128]


def batch_sweep(out: Path) -> None:
    g = torch.Generator().manual_seed(0)
    rows = []
    for N, K in BATCH_SHAPES:
        Wf = torch.randn(N, K, generator=g) * 0.02
        for bits in (2, 3, 4):
            codes, bmap, scales, zeros = make_codes(N, K, bits, g)
            torch.set_num_threads(1)
            w = BitPlaneWeight.from_codes(codes, bmap, scales, zeros, GS, RB)
            f = LowBitWeight.from_codes(codes, bmap, scales, zeros, GS, RB)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for M in BATCH_ROWS:
                    x = torch.randn(M, K, generator=g)
                    r = {
                        "shape": [N, K], "bits": bits, "threads": threads, "rows": M,
                        "lut_ms": median_ms(lambda: w.matmul(x)),  # noqa: B023
                        "fma_ms": median_ms(lambda: f.matmul(x)),  # noqa: B023
                        "fp32_ms": median_ms(lambda: F.linear(x, Wf)),  # noqa: B023
                    }  # fmt: skip
                    rows.append(r)
                    print(
                        f"{N}x{K} W{bits} t{threads} M{M:<4} LUT {r['lut_ms']:8.3f}  FMA {r['fma_ms']:8.3f}  "
                        f"fp32 {r['fp32_ms']:8.3f}",
                        flush=True,
                    )
    meta = {
        "cpu": cpu_name(), "isas": available_isas(lut.extension()), "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }  # fmt: skip
    lines = [
        f"SFMP's kernel (BitPlaneWeight) vs LowBitWeight vs fp32 `F.linear` at M rows of x; g{GS}, blocks "
        f"{RB}x{GS}; {meta['cpu']}; torch {meta['torch']}. ms (median); LUT/FMA < 1: the LUT path is faster.",
        "",
        "| shape | bits | threads | M | LUT ms | FMA ms | fp32 ms | LUT/FMA | LUT/fp32 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape'][0]}x{r['shape'][1]} | {r['bits']} | {r['threads']} | {r['rows']} | "
            f"{r['lut_ms']:.3f} | {r['fma_ms']:.3f} | {r['fp32_ms']:.3f} | {r['lut_ms'] / r['fma_ms']:.2f} | "
            f"{r['lut_ms'] / r['fp32_ms']:.2f} |"
        )
    md = "\n".join(lines) + "\n"
    print(md)
    write_results(out, "lut_gemv_batch", {"meta": meta, "machine": machine_info(), "rows": rows}, md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="576x576 and 4096x4096 only")
    p.add_argument("--shapes", default=None, help="comma-separated OUTxIN shapes (default: all five)")
    p.add_argument("--json", default=None, help="output (default results/lut_gemv[_batch].json)")
    p.add_argument("--batch", action="store_true", help="only the 1-128 rows sweep (lut_gemv_batch)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    a = p.parse_args()
    if lut.extension() is None or fma_extension() is None:
        print("a compiled kernel is not available here: the rows would time the pure-torch fallback")
        sys.exit(2)
    if a.batch:
        batch_sweep(Path(a.json or RESULTS / "lut_gemv_batch.json"))
        return
    a.json = a.json or str(RESULTS / "lut_gemv.json")
    isas = available_isas(lut.extension())
    shapes = [SHAPES[0], SHAPES[3]] if a.quick else SHAPES
    if a.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    g = torch.Generator().manual_seed(0)
    rows = []
    for N, K in shapes:
        Wf = torch.randn(N, K, generator=g) * 0.02
        x = torch.randn(1, K, generator=g)
        fp32 = {}
        for bits in BITS:
            codes, bmap, scales, zeros = make_codes(N, K, bits, g)
            torch.set_num_threads(1)  # building is single-threaded: fast and quiet on a shared machine
            w = BitPlaneWeight.from_codes(codes, bmap, scales, zeros, GS, RB)
            f = LowBitWeight.from_codes(codes, bmap, scales, zeros, GS, RB)
            del codes
            for threads in (int(t) for t in a.threads.split(",")):
                torch.set_num_threads(threads)
                if threads not in fp32:
                    fp32[threads] = median_ms(lambda: F.linear(x, Wf))  # noqa: B023
                t_lut = median_ms(lambda: w.matmul(x))  # noqa: B023
                t_avx2 = median_ms(lambda: w.matmul(x, isa="avx2")) if "avx2" in isas else float("nan")  # noqa: B023
                t_fma = median_ms(lambda: f.matmul(x))  # noqa: B023
                row = {
                    "shape": [N, K], "threads": threads, "bits": bits, "lut_ms": t_lut, "lut_avx2_ms": t_avx2,
                    "fma_ms": t_fma, "fp32_ms": fp32[threads], "lut_over_fma": t_lut / t_fma,
                    "fp32_over_lut": fp32[threads] / t_lut, "lut_bytes": w.nbytes(), "fma_bytes": f.nbytes(),
                }  # fmt: skip
                rows.append(row)
                print(
                    f"{N}x{K} t{threads} W{bits:<4} LUT {t_lut:8.3f} ms  avx2 {t_avx2:8.3f}  "
                    f"FMA {t_fma:8.3f}  fp32 {fp32[threads]:8.3f}  LUT/FMA {t_lut / t_fma:5.2f}",
                    flush=True,
                )
    rows.sort(key=lambda r: (shapes.index(tuple(r["shape"])), r["threads"], BITS.index(r["bits"])))
    lin = linearity(rows)
    meta = {
        "cpu": cpu_name(), "isas": isas, "torch": torch.__version__,
        "cpus": os.cpu_count(), "group_size": GS, "row_block": RB, "quick": a.quick,
    }  # fmt: skip
    md = markdown(rows, lin, meta)
    print(md)
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "machine": machine_info(), "rows": rows, "linearity": lin}
    write_results(out, "lut_gemv", result, md)


if __name__ == "__main__":
    main()
