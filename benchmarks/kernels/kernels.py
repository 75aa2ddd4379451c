"""CPU low-bit matmul (``kernels/qmatmul.py``) against float matmuls, today's dequantize-then-matmul
path and this machine's memory-bandwidth bound, all measured in one run.

Rows: SmolLM2 (576x576, 1536x576, 576x1536) and Llama-3-8B (4096x4096, 14336x4096, 4096x14336)
shapes ``[out, in]``; 1 and 2 threads; batch 1 (decode) and, for 4096x4096, batch 64 (prefill);
W2/W3/W4/W8 at g128 (asymmetric, float32 scales and zero-points) and the mixes 2.5 and 3.5 bits
(blocks of 512 rows x 128 columns, half of them at each neighbouring width).  Columns: our kernel;
``F.linear`` on a float32 and on a bfloat16 weight; the pre-kernel path (``dequantize_packed`` +
``F.linear``, what ``QuantLinear.forward`` did before); the bandwidth bound = bytes the kernel
reads / this machine's read bandwidth (``x.sum()`` over 512 MiB, best of 5, same thread count).
Times are medians over repeats after a warm-up.  The kernel runs its best instruction set here
(``BITMOSAIC_KERNEL_ISA`` forces another; the table's first line names it).

    python -m benchmarks.kernels.kernels [--quick]     (writes benchmarks/results/kernels.{json,md})
    python -m benchmarks.kernels.kernels --shapes 4096x4096 --threads 1 --bits 2,4 --json /tmp/k.json
      (a subset)
"""

from __future__ import annotations

import argparse

import torch
from torch.nn import functional as F

from benchmarks.harness import RESULTS, machine_info, median_ms, read_bandwidth_gbs, write_results
from bitmosaic.formats.packing import pack_codes
from bitmosaic.kernels.cpu import dequantize_packed
from bitmosaic.kernels.isa import available_isas, kernel_isa
from bitmosaic.kernels.qmatmul import LowBitWeight, extension

SHAPES = [(576, 576), (1536, 576), (576, 1536), (4096, 4096), (14336, 4096), (4096, 14336)]
GS = 128


def make_weight(N: int, K: int, bits: float, g: torch.Generator):
    G = -(-K // GS)
    rb = 512
    n_rb = -(-N // rb)
    if bits == int(bits):
        bmap = torch.full((n_rb, G), int(bits))
    else:  # half the blocks at each neighbouring width, interleaved
        lo = int(bits)
        bmap = lo + (torch.arange(n_rb * G).reshape(n_rb, G) % 2)
    codes = torch.empty(N, K, dtype=torch.int32)
    for r in range(n_rb):
        for j in range(G):
            blk = codes[r * rb : (r + 1) * rb, j * GS : (j + 1) * GS]
            blk.copy_(torch.randint(0, 1 << int(bmap[r, j]), blk.shape, generator=g))
    scales = torch.rand(N, G, generator=g) * 0.01 + 1e-3
    zeros = torch.randint(0, 4, (N, G), generator=g).float()
    w = LowBitWeight.from_codes(codes, bmap if bits != int(bits) else int(bits), scales, zeros, GS, rb)
    return w, codes, scales, zeros


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="SmolLM2 shapes and 4096x4096 only, W2/W4")
    p.add_argument("--json", default=str(RESULTS / "kernels.json"))
    p.add_argument("--shapes", default=None, help="comma-separated OUTxIN shapes (e.g. 4096x4096)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--bits", default=None, help="comma-separated widths (e.g. 2,3,4,8,2.5)")
    a = p.parse_args()
    if extension() is None:
        print("the compiled kernel is not available here: the rows time the pure-torch fallback")
    shapes = SHAPES[:4] if a.quick else SHAPES
    bit_list = [2, 4] if a.quick else [2, 3, 4, 8, 2.5, 3.5]
    if a.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    if a.bits:
        bit_list = [float(b) if "." in b else int(b) for b in a.bits.split(",")]
    g = torch.Generator().manual_seed(0)
    rows = []
    bw = {}
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        bw[threads] = read_bandwidth_gbs()
        print(f"threads {threads}: read bandwidth {bw[threads]:.1f} GB/s", flush=True)
        for N, K in shapes:
            Wf = torch.randn(N, K, generator=g) * 0.02
            Wb = Wf.bfloat16()
            batches = (1, 64) if (N, K) == (4096, 4096) else (1,)
            for M in batches:
                x = torch.randn(M, K, generator=g)
                xb = x.bfloat16()
                fp32 = median_ms(lambda: F.linear(x, Wf))  # noqa: B023
                bf16 = median_ms(lambda: F.linear(xb, Wb), budget_s=0.3, max_reps=5)  # noqa: B023
                for bits in bit_list:
                    w, codes, scales, zeros = make_weight(N, K, bits, g)
                    ours = median_ms(lambda: w.matmul(x))  # noqa: B023
                    old = None
                    if bits == int(bits) and int(bits) >= 2:
                        packed = pack_codes(codes, int(bits))
                        s16, z16 = scales.half(), zeros.half()

                        def today():
                            wd = dequantize_packed(
                                packed, int(bits), K, s16, z16, None, group_size=GS, contiguous=True
                            )  # noqa: B023
                            return F.linear(x, wd)  # noqa: B023

                        old = median_ms(today, budget_s=0.3, max_reps=10)
                    bound = w.nbytes() / (bw[threads] * 1e9) * 1e3
                    row = {
                        "shape": [N, K], "threads": threads, "batch": M, "bits": bits,
                        "kernel_ms": ours, "fp32_ms": fp32, "bf16_ms": bf16, "dequant_matmul_ms": old,
                        "bound_ms": bound, "kernel_bytes": w.nbytes(),
                        "speedup_vs_fp32": fp32 / ours, "x_bound": ours / bound,
                    }  # fmt: skip
                    rows.append(row)
                    print(
                        f"  {N}x{K} b{M} W{bits:<4} ours {ours:8.3f} ms  fp32 {fp32:8.3f}  bf16 {bf16:9.2f}  "
                        f"old {old if old is None else round(old, 2)}  bound {bound:7.3f}  "
                        f"({fp32 / ours:5.2f}x fp32, {ours / bound:4.1f}x bound)",
                        flush=True,
                    )
    # every width's latency over W4's at the same shape, threads and batch (target: W2 <= 0.6)
    for r in rows:
        key = (r["shape"], r["threads"], r["batch"])
        w4 = next((o for o in rows if o["bits"] == 4 and (o["shape"], o["threads"], o["batch"]) == key), None)
        r["over_w4"] = r["kernel_ms"] / w4["kernel_ms"] if w4 else None
    lines = [
        f"kernel ISA: {kernel_isa()}; read bandwidth GB/s: "
        + ", ".join(f"{t} thread{'s' if t > 1 else ''} {v:.1f}" for t, v in bw.items()),
        "",
        "| shape | threads | batch | bits | kernel ms | fp32 ms | bf16 ms | dequant+matmul ms | bound ms | vs fp32 | x bound | / W4 |",  # noqa: E501
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        old = "—" if r["dequant_matmul_ms"] is None else f"{r['dequant_matmul_ms']:.2f}"
        lines.append(
            f"| {r['shape'][0]}x{r['shape'][1]} | {r['threads']} | {r['batch']} | {r['bits']} | "
            f"{r['kernel_ms']:.3f} | {r['fp32_ms']:.3f} | {r['bf16_ms']:.2f} | {old} | {r['bound_ms']:.3f} | "
            f"{r['speedup_vs_fp32']:.2f}x | {r['x_bound']:.2f} | "
            + ("—" if r["over_w4"] is None else f"{r['over_w4']:.2f}")
            + " |"
        )
    table = "\n".join(lines)
    print("\n" + table)
    machine = machine_info(
        cpu_capability=torch.backends.cpu.get_cpu_capability(), compiled_kernel=extension() is not None,
        kernel_isa=kernel_isa(), kernel_isas_available=available_isas(),
    )  # fmt: skip
    out = {"args": vars(a), "machine": machine, "read_bandwidth_gbs": bw, "rows": rows}
    write_results(a.json, "kernels", out, table)


if __name__ == "__main__":
    main()
