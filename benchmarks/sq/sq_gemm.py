"""SQ-format activations on the integer path against W4A16, W4A8 and W4A4 (Huang et al. §5.4's
efficiency claim: SQ-format's throughput near W4A4's while its accuracy is near W4A8's), one run.

Per shape (``out x in``) a random W4 g128 packed weight (RTN), at ``--rows`` rows of x (512: prefill,
1: decode), median ms of:

* ``fp32``: ``F.linear`` with the dequantized weight; ``W4A16``: the weight-only low-bit kernel;
* ``W4A8`` / ``W4A4``: per-token INT8 / INT4 activations on the integer kernel (``kernels/intmm.py``);
* ``SQ dyn`` / ``SQ static``: W4A(SQ6) ``16-(8/4)-0.5`` with per-bank activation scales (the scales the
  findings use), the layer's integer path (``modules/sq.py``): dynamic, the split by the simulated
  path's own function (float32 torch operations), then each part's levels times the codes; static, each
  part's channels gathered and quantized in one C++ pass (``ops.quantize_gathered``), then the product in
  the kernel's runs mode (``IntActWeight.product_runs``: an int32 sum per 8-column run, one float FMA
  with the run's scale, the weight scale and zero-point once per weight group); ``SQ sim``: the
  same layer's float32 split (``$BITMOSAIC_ACT_COMPUTE=sim``);
* bounds measured in the same run: ``int8 bound`` = ``2 M N K`` at ``torch._int_mm``'s int8 rate,
  ``mem bound`` = the packed 4-bit weight's bytes / the read bandwidth.

The SQ-format's own overhead on this CPU: dynamic, its split (top-k per bank, two scales per bank and
part: float32 torch operations) and a second integer product (each part multiplies every column, zeros
at the other part's places: there is no split datapath); static, the gather and each 8-column run's own
activation scale (one float FMA per run and 16 output rows, where W4A4 has one per 128 columns), with
the two parts' products one product's worth of columns.  ``python -m benchmarks.sq.sq_gemm --threads 2``
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.harness import RESULTS, machine_bounds, machine_info, median_ms, write_results
from bitmosaic.algorithms.rtn import rtn_quantize
from bitmosaic.algorithms.sq import static_channel_mask
from bitmosaic.formats.act import ActQuantSpec
from bitmosaic.formats.grid import IntGrid
from bitmosaic.formats.sq import parse_sq
from bitmosaic.modules import QuantLinear, attach_input_quant
from bitmosaic.modules.intact import ACT_COMPUTE_ENV
from bitmosaic.modules.sq import SQActLinear

SHAPES = ("576x576", "1536x576", "576x1536", "4096x4096", "14336x4096")
SQ = "16-(8/4)-0.5"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default="512,1")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=str(RESULTS / "sq_gemm.json"))
    a = p.parse_args()
    rate, bw = machine_bounds(a.threads)
    g = torch.Generator().manual_seed(0)
    fmt = parse_sq(SQ)
    rows = []
    for shape in a.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        W = torch.randn(N, K, generator=g) * 0.02
        res = rtn_quantize(W, IntGrid(4, False), 128, "minmax")
        dense = QuantLinear.from_result(res, bits=4, group_size=128, symmetric=False)
        wf = dense.dequantize_reference()
        acts = {}
        for name, bits in (("W4A8", 8), ("W4A4", 4)):
            m = QuantLinear.from_result(res, bits=4, group_size=128, symmetric=False)
            attach_input_quant(m, ActQuantSpec("int", bits), K)
            acts[name] = m
        mask = static_channel_mask(torch.rand(K, generator=g), fmt)
        sq = {
            "SQ dyn": SQActLinear.from_packed(dense, SQ, "dynamic", "bank"),
            "SQ static": SQActLinear.from_packed(dense, SQ, "static", "bank", mask),
        }
        for M in (int(r) for r in a.rows.split(",")):
            x = torch.randn(M, K, generator=g) * torch.linspace(0.2, 3, K)
            reps = a.repeats if N * K * M < 2**31 else 3
            t = {}
            with torch.inference_mode():
                t["fp32"] = median_ms(lambda: torch.nn.functional.linear(x, wf), 1.0, reps)
                k = dense.kernel()
                t["W4A16"] = median_ms(lambda: k(x), 1.0, reps)
                for name, m in {**acts, **sq}.items():
                    assert m.runs_int_act(x), (name, m.int_act_blocker())
                    t[name] = median_ms(lambda m=m: m(x), 1.0, reps)
                os.environ[ACT_COMPUTE_ENV] = "sim"
                t["SQ sim"] = median_ms(lambda: sq["SQ dyn"](x), 1.0, reps)
                os.environ.pop(ACT_COMPUTE_ENV)
            row = {
                "shape": shape, "rows": M, "ms": t,
                "int8_bound_ms": 2 * M * N * K / (rate * 1e9) * 1e3,
                "mem_bound_ms": dense.qweight.numel() / (bw * 1e9) * 1e3,
            }  # fmt: skip
            rows.append(row)
            print(shape, M, {k: round(v, 3) for k, v in t.items()}, flush=True)
    bounds = {"int8_int_mm_gops": rate, "read_bandwidth_gbs": bw}
    cols = ("fp32", "W4A16", "W4A8", "W4A4", "SQ dyn", "SQ static", "SQ sim")
    lines = [
        f"W4 g128 weights, W4A(SQ6) `{SQ}` with per-bank activation scales; CPU, {a.threads} threads, "
        f"median ms (`python -m benchmarks.sq.sq_gemm --threads {a.threads}`); bounds measured in the same "
        f"run: "
        f"int8 {rate:.0f} GOPS (`torch._int_mm`), read {bw:.1f} GB/s. Ratios: the W4A16 time over each.",
        "",
        "| shape | rows | "
        + " | ".join(cols)
        + " | int8 bound | mem bound | SQ dyn vs W4A16 | SQ static vs W4A16 "
        "| SQ static vs W4A4 |",
        "|---|---|" + "---|" * (len(cols) + 5),
    ]
    for r in rows:
        t = r["ms"]
        lines.append(
            f"| {r['shape']} | {r['rows']} | "
            + " | ".join(f"{t[c]:.3f}" for c in cols)
            + f" | {r['int8_bound_ms']:.3f} | {r['mem_bound_ms']:.3f} | {t['W4A16'] / t['SQ dyn']:.2f}x "
            f"| {t['W4A16'] / t['SQ static']:.2f}x | {t['W4A4'] / t['SQ static']:.2f}x |"
        )
    out = {"args": vars(a), "machine": machine_info(), "bounds": bounds, "rows": rows}
    write_results(a.json, "sq_gemm", out, "\n".join(lines))


if __name__ == "__main__":
    main()
