"""FP8 x FP8 GEMM (torch._scaled_mm) vs bf16 GEMM on a CUDA GPU with FP8 tensor cores.

For each (tokens m, in k, out n) it checks the FP8 GEMM against the float32 reference on the same
device (max relative error), then times both (CUDA events, median of repeats) and reports the
speed-up.  Without such a GPU it says so and writes nothing (no simulated timings).

Run: python -m benchmarks.gpu.fp8_gemm   (writes benchmarks/results/fp8_gemm.json)
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.harness import RESULTS, machine_info, write_results
from bitmosaic.formats.fp import fp_round
from bitmosaic.kernels.fp8 import fp8_gemm_reference, fp8_gemm_scaled_mm, scaled_mm_available

SHAPES = [
    (m, k, n)
    for m in (1, 16, 512, 4096)
    for (k, n) in ((576, 1536), (1536, 576), (4096, 4096), (4096, 14336))
]


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--json", default=str(RESULTS / "fp8_gemm.json"))
    a = p.parse_args()
    if not scaled_mm_available():
        print("no CUDA GPU with FP8 tensor cores (capability >= 8.9): nothing measured")
        return 0
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    print(f"{'m':>6} {'k':>6} {'n':>6} {'bf16 ms':>9} {'fp8 ms':>9} {'speed-up':>9} {'max rel err':>12}")
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device=dev, generator=g)
        w = torch.randn(n, k, device=dev, generator=g) * 0.02
        s_x, s_w = x.abs().amax() / 448, w.abs().amax() / 448
        x8 = fp_round(x / s_x, "e4m3").to(torch.float8_e4m3fn)
        w8 = fp_round(w / s_w, "e4m3").to(torch.float8_e4m3fn)
        ref = fp8_gemm_reference(x8, w8, s_x, s_w)
        y = fp8_gemm_scaled_mm(x8, w8, s_x, s_w).float()
        err = float((y - ref).abs().max() / ref.abs().max())
        xb, wb = (x8.float() * s_x).bfloat16(), (w8.float() * s_w).bfloat16()
        t_bf16 = timed(lambda xb=xb, wb=wb: xb @ wb.T, a.reps)
        t_fp8 = timed(lambda x8=x8, w8=w8, s_x=s_x, s_w=s_w: fp8_gemm_scaled_mm(x8, w8, s_x, s_w), a.reps)
        rows.append({"m": m, "k": k, "n": n, "bf16_ms": t_bf16, "fp8_ms": t_fp8, "max_rel_err": err})
        print(f"{m:>6} {k:>6} {n:>6} {t_bf16:>9.4f} {t_fp8:>9.4f} {t_bf16 / t_fp8:>9.2f} {err:>12.2e}")
    out = {"device": torch.cuda.get_device_name(), "machine": machine_info(), "rows": rows}
    write_results(a.json, "fp8_gemm", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
