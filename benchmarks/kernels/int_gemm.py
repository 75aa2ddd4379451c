"""Integer-activation matmul (``kernels/intmm.py``) against float32 ``F.linear``, the W4A16 low-bit kernel,
the simulated W4A8 path, ``torch._int_mm`` and this machine's int8 compute and memory bounds, one run.

Rows: SmolLM2 (576x576, 1536x576, 576x1536) and Llama-3-8B (4096x4096, 14336x4096) shapes ``[out, in]``,
prefill (512 rows of x) and decode (1 row), at each ``--threads`` count.  Columns (ms, medians after a
warm-up):

* ``fp32``: ``F.linear`` on a float32 weight;
* ``W4A16``: the weight-only low-bit kernel (``LowBitWeight``, 4-bit g128 asymmetric);
* ``W4A8 sim``: the simulated W4A8 layer before this kernel (per-token ``fake_quant`` + ``LowBitWeight``);
* ``W4A8 int`` / ``W8A8 int``: the integer path as a layer runs it (``IntActKernel``: per-token scales,
  int8 quantization, integer product), 4-bit g128 asymmetric / 8-bit per-channel symmetric (SmoothQuant's
  W8A8); ``W4A8 int_mm`` / ``W8A8 int_mm``: the same through ``torch._int_mm`` (oneDNN), once per weight
  group;
* ``W4 int16``: the W4 weight with 16-bit per-token activations (``--runtime-act int16``: two int8 halves
  through the same integer kernel, one pass over the weight) -- the near-exact integer alternative to the
  float-activation ``W4A16`` column;
* ``W4A8 VNNI`` / ``W8A8 VNNI`` (on a CPU with AMX-INT8 only): the integer path with the AMX body turned
  off (``$BITMOSAIC_AMX=0``), so the AMX column's gain is measured in the same run (at 512 rows the
  integer columns above run on AMX tiles there; decode rows never do);
* bounds: ``int8 bound`` = ``2 M N K`` / the int8 rate of ``torch._int_mm`` on a 2048^3 product (oneDNN's
  int8 GEMM -- on VNNI, or AMX where the CPU has it -- measured in the run); ``mem bound`` = the 4-bit
  weight's bytes / the read bandwidth.

Targets (issue 24): at M=512, W4A8 int >= 2x fp32 and >= 1.5x W4A16; W8A8 int >= 2x fp32.

    python -m benchmarks.kernels.int_gemm [--threads 1,2] [--shapes 576x576,4096x4096]
      (writes benchmarks/results/int_gemm.{json,md})
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.nn import functional as F

from benchmarks.harness import machine_bounds, machine_info, median_ms, write_results
from bitmosaic.formats.act import ActQuantSpec, fake_quant
from bitmosaic.kernels.intmm import AMX_ENV, IntActWeight, amx, vnni
from bitmosaic.kernels.isa import kernel_isa
from bitmosaic.kernels.qmatmul import LowBitWeight
from bitmosaic.modules.actquant import ActQuantizer
from bitmosaic.modules.intact import IntActKernel

SHAPES = [(576, 576), (1536, 576), (576, 1536), (4096, 4096), (14336, 4096)]
ROWS = (512, 1)
GS = 128


def weights(N: int, K: int, g: torch.Generator):
    G = -(-K // GS)
    c4 = torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32)
    s4 = torch.rand(N, G, generator=g) * 0.01 + 1e-3
    z4 = torch.randint(6, 10, (N, G), generator=g).float()
    c8 = torch.randint(0, 256, (N, K), generator=g, dtype=torch.int32)
    s8 = torch.rand(N, 1, generator=g) * 1e-3 + 1e-4
    return {
        "w4": LowBitWeight.from_codes(c4, 4, s4, z4, GS),
        "i4": IntActWeight.from_codes(c4, 4, s4, z4, GS),
        "i8": IntActWeight.from_codes(c8, 8, s8, 128.0, -1),
        "f32": ((c4.float() - z4.repeat_interleave(GS, 1)[:, :K]) * s4.repeat_interleave(GS, 1)[:, :K]),
    }


def measure(N, K, M, g, rate, bw) -> dict:
    w = weights(N, K, g)
    x = torch.randn(M, K, generator=g)
    spec = ActQuantSpec("int", 8)
    quant = ActQuantizer(spec, K)
    quant16 = ActQuantizer(ActQuantSpec("int", 16), K)
    k4, k8 = IntActKernel(w["i4"]), IntActKernel(w["i8"])

    def int_mm(weight):
        s = x.abs().amax(-1, keepdim=True).div(127.0).clamp(min=1e-12)
        return lambda: weight.matmul(x, s, K, 127.0, route="int_mm")

    row = {"shape": f"{N}x{K}", "M": M}
    with torch.inference_mode():
        row["fp32"] = median_ms(lambda: F.linear(x, w["f32"]))
        row["w4a16"] = median_ms(lambda: w["w4"].matmul(x))
        row["w4a8_sim"] = median_ms(lambda: w["w4"].matmul(fake_quant(x, spec)))
        row["w4a8_int"] = median_ms(lambda: k4(x, quant))
        row["w8a8_int"] = median_ms(lambda: k8(x, quant))
        row["w4_int16"] = median_ms(lambda: k4(x, quant16))
        if amx():  # the same calls on the VNNI body
            os.environ[AMX_ENV] = "0"
            try:
                row["w4a8_vnni"] = median_ms(lambda: k4(x, quant))
                row["w8a8_vnni"] = median_ms(lambda: k8(x, quant))
            finally:
                os.environ.pop(AMX_ENV)
        row["w4a8_int_mm"] = median_ms(int_mm(w["i4"]))
        row["w8a8_int_mm"] = median_ms(int_mm(w["i8"]))
    row["int8_bound"] = 2 * M * N * K / (rate * 1e9) * 1e3
    row["mem_bound"] = w["i4"].data.numel() / (bw * 1e9) * 1e3
    return row


def table(rows: list[dict]) -> str:
    vn = any("w4a8_vnni" in r for r in rows)
    head = (
        "| shape | M | threads | fp32 | W4A16 | W4A8 sim | W4A8 int | W8A8 int | W4A8 int_mm | W8A8 int_mm "
        "| int8 bound | mem bound | W4A8 vs fp32 | W4A8 vs W4A16 | W8A8 vs fp32 | W4A8 int vs sim "
        "| W4 int16 | W4 int16 vs W4A16 |" + (" W4A8 VNNI | W8A8 VNNI | W4A8 VNNI / AMX |" if vn else "")
    )
    lines = [head, "|" + "---|" * (21 if vn else 18)]
    for r in rows:
        cells = [r["shape"], r["M"], r["threads"]] + [
            f"{r[k]:.3f}"
            for k in ("fp32", "w4a16", "w4a8_sim", "w4a8_int", "w8a8_int", "w4a8_int_mm", "w8a8_int_mm")
        ]
        cells += [f"{r['int8_bound']:.3f}", f"{r['mem_bound']:.3f}"]
        cells += [f"{r['fp32'] / r['w4a8_int']:.2f}x", f"{r['w4a16'] / r['w4a8_int']:.2f}x"]
        cells += [f"{r['fp32'] / r['w8a8_int']:.2f}x", f"{r['w4a8_sim'] / r['w4a8_int']:.2f}x"]
        i16 = r.get("w4_int16")  # rows before the int16 column have none
        cells += [f"{i16:.3f}", f"{r['w4a16'] / i16:.2f}x"] if i16 else ["—"] * 2
        if vn:
            v4, v8 = r.get("w4a8_vnni"), r.get("w8a8_vnni")
            cells += [f"{v4:.3f}", f"{v8:.3f}", f"{v4 / r['w4a8_int']:.2f}x"] if v4 else ["—"] * 3
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["M"] != 512:
            continue
        a, b, c = r["fp32"] / r["w4a8_int"], r["w4a16"] / r["w4a8_int"], r["fp32"] / r["w8a8_int"]
        out.append(
            f"- {r['shape']} M=512, {r['threads']} thread(s): W4A8 {a:.2f}x fp32 "
            f"({'met' if a >= 2 else 'NOT met'}, target 2x), {b:.2f}x W4A16 "
            f"({'met' if b >= 1.5 else 'NOT met'}, target 1.5x); "
            f"W8A8 {c:.2f}x fp32 ({'met' if c >= 2 else 'NOT met'}, target 2x)"
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2", help="comma list of thread counts")
    p.add_argument("--shapes", default=None, help="comma list of OUTxIN (default: the five above)")
    p.add_argument("--rows", default="512,1", help="comma list of rows of x")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    rows_m = [int(m) for m in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    rows, bounds = [], {}
    for t in [int(t) for t in args.threads.split(",")]:
        rate, bw = machine_bounds(t)
        bounds[t] = {"int8_int_mm_gops": rate, "read_bandwidth_gbs": bw}
        for N, K in shapes:
            for M in rows_m:
                r = measure(N, K, M, g, rate, bw)
                r["threads"] = t
                rows.append(r)
                print(r, flush=True)
    isa = kernel_isa()
    isa = "avx512 + VNNI" if isa == "avx512" and vnni() else isa
    isa += " (prefill on AMX-INT8 tiles)" if amx() else ""
    head = [
        "# Integer-activation matmul (W8A8 / W4A8) vs float, W4A16 and simulated W4A8",
        "",
        f"Kernel ISA: {isa}. Bounds per thread count: "
        + "; ".join(
            f"{t}: int8 {b['int8_int_mm_gops']:.0f} GOPS (torch._int_mm 2048^3), "
            f"read {b['read_bandwidth_gbs']:.1f} GB/s"
            for t, b in bounds.items()
        )
        + ". Times in ms (median).",
        "",
        f"Reproduce: `python -m benchmarks.kernels.int_gemm --threads {args.threads} --rows {args.rows}"
        + (f" --shapes {args.shapes}" if args.shapes else "")
        + "`",
        "",
    ]
    md = "\n".join(head) + table(rows) + "\n\nTargets (M=512):\n" + "\n".join(verdicts(rows))
    print(md)
    write_results(args.json, "int_gemm", {"bounds": bounds, "rows": rows, "machine": machine_info()}, md)


if __name__ == "__main__":
    main()
