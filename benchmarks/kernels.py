"""CPU dequantization kernel vs the reference path (and vs a dense float matmul).

Run: python benchmarks/kernels.py [--threads 1]   (writes benchmarks/results/kernels.json)
Each row times one [out, in] layer: reference unpack + dequantize, the LUT fast path, and
QuantLinear.forward for a single token (decode) against nn.Linear on the float weight.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bitmosaic.formats.layout import default_g_idx, dequantize
from bitmosaic.formats.packing import pack_codes, unpack_codes
from bitmosaic.kernels.cpu import dequantize_packed
from bitmosaic.models.serialization import atomic_write_text

from common import RESULTS


def best_of(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default=str(RESULTS / "kernels.json"))
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    for out, n in ((1536, 576), (576, 1536)):
        for bits in (2, 3, 4, 8):
            G = -(-n // 128)
            codes = torch.randint(0, 1 << bits, (out, n), generator=g, dtype=torch.int32)
            scales = (torch.rand(out, G, generator=g) * 0.01 + 1e-3).half()
            zeros = torch.randint(0, 1 << bits, (out, G), generator=g).half()
            packed = pack_codes(codes, bits)
            gi = default_g_idx(n, 128)
            W = dequantize(codes, scales, zeros, gi)
            fast = dequantize_packed(packed, bits, n, scales, zeros, None, group_size=128, contiguous=True)
            assert torch.equal(W, fast), "fast path must be bitwise equal to the reference"
            ref_ms = best_of(lambda: dequantize(unpack_codes(packed, bits, n), scales, zeros, gi), a.reps)
            fast_ms = best_of(
                lambda: dequantize_packed(
                    packed, bits, n, scales, zeros, None, group_size=128, contiguous=True
                ),
                a.reps,
            )
            x = torch.randn(1, n, generator=g)
            dense_ms = best_of(lambda: torch.nn.functional.linear(x, W), a.reps)
            rows.append(
                {
                    "shape": f"{out}x{n}",
                    "bits": bits,
                    "reference_ms": ref_ms,
                    "fast_ms": fast_ms,
                    "speedup": ref_ms / fast_ms,
                    "dense_gemv_ms": dense_ms,
                }
            )
    print(f"threads {torch.get_num_threads()}; group 128, asymmetric, float32 output; best of {a.reps}")
    print(
        f"{'shape':>10} {'bits':>4} {'reference ms':>13} {'fast ms':>9} {'speedup':>8} {'dense GEMV ms':>14}"
    )
    for r in rows:
        print(
            f"{r['shape']:>10} {r['bits']:>4} {r['reference_ms']:>13.3f} {r['fast_ms']:>9.3f} "
            f"{r['speedup']:>7.1f}x {r['dense_gemv_ms']:>14.3f}"
        )
    atomic_write_text(
        a.json,
        json.dumps({"benchmark": "kernels", "threads": torch.get_num_threads(), "rows": rows}, indent=2),
    )
    print(f"\nJSON written to {a.json}")


if __name__ == "__main__":
    main()
