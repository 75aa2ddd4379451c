"""CPU latency and memory overhead of MosaicQuant's sparse 4-bit branch (§4.2, §5.5, Fig. 6).

For each shape (``out x in``) a random weight is MosaicQuant-ed at ``--budget`` (Δ-Hessian with a
random diagonal-dominant Hessian, 64x64 blocks) into a :class:`MosaicQuantLinear`; then, at
batch 1, 16 and 512 rows, median times of:

* ``dense``: the dense 4-bit base alone (``LowBitWeight.matmul``: compiled GEMV for <= 8 rows,
  tiled dequantize + GEMM above) -- the baseline of the overhead;
* ``fused``: one tiling pass, residual blocks dequantized into the dense tile (kernels/mosaic.py);
* ``decode`` (batch <= ``DECODE_ROWS`` only, what ``__call__`` runs there): the compiled dense GEMV,
  then the compiled residual pass (``csrc/mosaic.cpp``) accumulating into the same output;
* ``three-step``: dense product, separate sparse pass re-gathering the activations, add;
* ``fp32``: ``F.linear`` with the float weight;
* with INT activations in integers (``--abits``, per token; kernels/mosaic.py ``MosaicIntActWeight``, what
  a W4A4/W4A8 MosaicQuant layer runs on the CPU): ``int dense``, the dense base alone on the int8 kernel,
  and ``int``, dense base + residual blocks (the activations quantized once); ``int overhead`` = int /
  int dense - 1, the paper's fused overhead on the integer path; ``int vs W4A16`` = dense / int, the
  issue's comparator (the weight-only 4-bit kernel on float inputs);
* the machine's bounds, measured in the same run: ``int8 bound`` = ``2 M N K`` at ``torch._int_mm``'s
  int8 rate (``int_gemm.py``), ``mem bound`` = the stored bits / the read bandwidth.

Latency overhead = time / dense - 1.  Memory overhead = stored residual bits (block indices,
packed codes, fp16 row scales) / stored dense-base bits (packed codes + per-channel fp16 scales).
CPU only: no GPU is lent to this task, so the Triton kernel is not written or measured.

Run: flock /tmp/bitmosaic-heavy.lock python -m benchmarks.mosaic.mosaic_kernel --threads 2 [--abits 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.harness import RESULTS, machine_bounds, machine_info, write_results
from bitmosaic.algorithms.mosaic import mosaic_decompose
from bitmosaic.formats.act import ActQuantSpec, fake_quant
from bitmosaic.kernels.mosaic import DECODE_ROWS
from bitmosaic.modules import attach_input_quant
from bitmosaic.modules.mosaic import MosaicQuantLinear

SHAPES = ("576x576", "192x576", "1536x576", "576x1536", "4096x4096", "1024x4096", "14336x4096")


def _time(fn, x, repeats: int) -> float:
    fn(x)  # warm-up
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(x)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--batches", default="1,16,512")
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("--block", default="64x64")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--abits", type=int, default=4, help="INT activation bits of the integer columns")
    p.add_argument("--json", default=str(RESULTS / "mosaic_kernel.json"))
    a = p.parse_args()
    rate, bw = machine_bounds(a.threads)
    spec = ActQuantSpec("int", a.abits)
    g = torch.Generator().manual_seed(0)
    rows = []
    for shape in a.shapes.split(","):
        out, n = (int(v) for v in shape.split("x"))
        W = torch.randn(out, n, generator=g) * 0.02
        hdiag = torch.rand(n, generator=g) * 2 + 0.1
        res = mosaic_decompose(W, None, hdiag=hdiag, budget=a.budget, block=a.block, report=False)
        m = MosaicQuantLinear.from_result(res)
        k = m.kernel()
        wf = m.dequantize_reference(torch.float32)
        mem = m.residual_overhead()
        attach_input_quant(m, spec, n)
        ik = m._build_int_act()  # the integer path a W4A<abits> MosaicQuant layer runs
        assert ik is not None, m.int_act_blocker()
        stored_bits = m.bits_per_weight() * out * n
        for bsz in (int(b) for b in a.batches.split(",")):
            x = torch.randn(bsz, n, generator=g)
            reps = max(3, a.repeats if out * n * bsz < 2**31 else 3)
            t = {
                "dense": _time(k.dense_only, x, reps),
                "fused": _time(k.fused, x, reps),
                "three-step": _time(k.three_step, x, reps),
                "fp32": _time(lambda v: torch.nn.functional.linear(v, wf), x, reps),
                "int dense": _time(lambda v: ik.weight.dense.matmul(v, None, n, spec.qmax), x, reps),
                "int": _time(lambda v: ik(v, m.input_quant), x, reps),
            }
            ref = x @ wf.T
            xq = fake_quant(x, spec)
            ref_q = xq @ wf.T
            err = float((k.fused(x) - ref).abs().max() / ref.abs().max())
            dec = bsz <= DECODE_ROWS
            if dec:
                t["decode"] = _time(k.decode, x, reps)
            row = {
                "shape": shape,
                "batch": bsz,
                "blocks": f"{m.res_index.numel()}/{res.block_mask.numel()}",
                "ms": t,
                "fused_overhead": t["fused"] / t["dense"] - 1,
                "three_step_overhead": t["three-step"] / t["dense"] - 1,
                "memory_overhead": mem,
                "bits_per_weight": m.bits_per_weight(),
                "fused_rel_err": err,
                "decode_overhead": t["decode"] / t["dense"] - 1 if dec else None,
                "decode_rel_err": float((k.decode(x) - ref).abs().max() / ref.abs().max()) if dec else None,
                "int_overhead": t["int"] / t["int dense"] - 1,
                "int_vs_w4a16": t["dense"] / t["int"],
                "int_rel_err": float((ik(x, m.input_quant) - ref_q).abs().max() / ref_q.abs().max()),
                "int8_bound_ms": 2 * bsz * out * n / (rate * 1e9) * 1e3,
                "mem_bound_ms": stored_bits / 8 / (bw * 1e9) * 1e3,
            }
            rows.append(row)
            dtxt = f"decode {t['decode']:8.3f} ({100 * row['decode_overhead']:+6.1f}%)  " if dec else ""
            print(
                f"{shape:>11} b{bsz:<4} dense {t['dense']:8.3f}  {dtxt}fused {t['fused']:8.3f} "
                f"({100 * row['fused_overhead']:+6.1f}%)  3-step {t['three-step']:8.3f} "
                f"({100 * row['three_step_overhead']:+6.1f}%)  fp32 {t['fp32']:8.3f}  mem +{100 * mem:.1f}%  "
                f"int {t['int']:8.3f} ({100 * row['int_overhead']:+6.1f}% over {t['int dense']:.3f}; "
                f"{row['int_vs_w4a16']:.2f}x W4A16)",
                flush=True,
            )
    bounds = {"int8_int_mm_gops": rate, "read_bandwidth_gbs": bw}
    out = {"args": vars(a), "machine": machine_info(), "bounds": bounds, "rows": rows}
    lines = [
        f"CPU, {a.threads} threads, budget {a.budget:g}, {a.block} blocks, median ms "
        f"(`python -m benchmarks.mosaic.mosaic_kernel --threads {a.threads} --abits {a.abits}`). "
        f"`dense` is the "
        f"W4A16 kernel (float inputs); `int` columns: INT{a.abits} per-token activations in integers; "
        f"bounds measured in the same run: int8 {rate:.0f} GOPS (`torch._int_mm`), read {bw:.1f} GB/s.",
        "",
        "| shape | batch | blocks | dense (W4A16) | decode | fused | three-step | fp32 | decode overhead "
        "| fused overhead | 3-step overhead | memory overhead | int dense | int | int overhead "
        "| int vs W4A16 | int8 bound | mem bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["ms"]
        dec = r["decode_overhead"] is not None
        dcol = f"{t['decode']:.3f}" if dec else "-"
        dover = f"{100 * r['decode_overhead']:+.1f}%" if dec else "-"
        lines.append(
            f"| {r['shape']} | {r['batch']} | {r['blocks']} | {t['dense']:.3f} | {dcol} | {t['fused']:.3f} | "
            f"{t['three-step']:.3f} | {t['fp32']:.3f} | {dover} | {100 * r['fused_overhead']:+.1f}% | "
            f"{100 * r['three_step_overhead']:+.1f}% | {100 * r['memory_overhead']:.1f}% | "
            f"{t['int dense']:.3f} | {t['int']:.3f} | {100 * r['int_overhead']:+.1f}% | "
            f"{r['int_vs_w4a16']:.2f}x | {r['int8_bound_ms']:.3f} | {r['mem_bound_ms']:.3f} |"
        )
    write_results(a.json, "mosaic_kernel", out, "\n".join(lines))


if __name__ == "__main__":
    main()
