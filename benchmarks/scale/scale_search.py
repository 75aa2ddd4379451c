"""The MSE scale search (GPTQ's default ``--scale mse``), reference torch vs the compiled search
(issue 74): seconds per call on the group shapes of a Llama-3-8B layer and a Qwen3-30B-A3B layer, and
per layer (every projection's groups), with the chosen scales checked bit for bit.

``python -m benchmarks.scale.scale_search [--threads 2] [--json PATH]``: the reference is timed on one
call per distinct group shape (``rows x 128``) and multiplied by the calls a layer makes (one per
group, as GPTQ made them); the compiled search on the same calls, and on one call per projection
(all static groups at once, as GPTQ now makes them).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, machine_info

# projection -> (rows, in_features, count per layer); group size 128
LAYERS = {
    "llama3-8b": {"q": (4096, 4096, 1), "k": (1024, 4096, 1), "v": (1024, 4096, 1), "o": (4096, 4096, 1),
                  "gate": (14336, 4096, 1), "up": (14336, 4096, 1), "down": (4096, 14336, 1)},
    "qwen3-30b-a3b": {"q": (4096, 2048, 1), "k": (512, 2048, 1), "v": (512, 2048, 1), "o": (2048, 4096, 1),
                      "expert gate": (768, 2048, 128), "expert up": (768, 2048, 128),
                      "expert down": (2048, 768, 128)},
}  # fmt: skip
G = 128


def _time(fn, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import bitmosaic.kernels  # noqa: F401  (installs the compiled search)
    from bitmosaic.algorithms import scales
    from bitmosaic.formats.grid import IntGrid

    grid = IntGrid(4, False)
    fast = scales.set_fast_mse_search(None)
    scales.set_fast_mse_search(fast)
    assert fast is not None, "no compiled search (no compiler?)"
    gen = torch.Generator().manual_seed(0)
    per_group: dict[int, dict] = {}
    out: dict = {"group_calls": {}, "layers": {}}
    for shape, projs in LAYERS.items():
        lay = {"reference_s": 0.0, "fast_per_group_s": 0.0, "fast_batched_s": 0.0, "identical": True}
        for name, (rows, n, count) in projs.items():
            W = (torch.randn(rows, n, generator=gen) * 0.02).bfloat16().float()
            if rows not in per_group:  # one group: the reference and the compiled search, one call each
                w = W[:, :G].contiguous()
                scales.set_fast_mse_search(None)
                t_ref = _time(lambda w=w: scales.find_scale_zero(w, grid, "mse"), reps=2)
                ref = scales.find_scale_zero(w, grid, "mse")
                scales.set_fast_mse_search(fast)
                t_fast = _time(lambda w=w: scales.find_scale_zero(w, grid, "mse"))
                got = scales.find_scale_zero(w, grid, "mse")
                same = all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
                per_group[rows] = {"rows": rows, "cols": G, "reference_s": t_ref, "fast_s": t_fast,
                                   "speedup": t_ref / t_fast, "identical": same}  # fmt: skip
            t_b = _time(lambda W=W: scales.group_scale_zero(W, grid, G, "mse"), reps=1)
            groups = n // G * count
            lay["reference_s"] += groups * per_group[rows]["reference_s"]
            lay["fast_per_group_s"] += groups * per_group[rows]["fast_s"]
            lay["fast_batched_s"] += t_b * count
            lay["identical"] &= per_group[rows]["identical"]
            print(f"{shape} {name}: {rows}x{n} x{count}: one call for all groups {t_b:.3f} s", flush=True)
        lay["speedup"] = lay["reference_s"] / lay["fast_batched_s"]
        out["layers"][shape] = lay
    out["group_calls"] = {str(k): v for k, v in per_group.items()}
    out["threads"] = args.threads
    out["machine"] = machine_info()
    md = ["# MSE scale search: reference torch vs compiled (issue 74)", "",
          f"`python -m benchmarks.scale.scale_search --threads {args.threads}`; w4 asym g128, 80 shrink "
          "candidates, norm 2.4; random bf16-valued weights (x0.02); scales and zeros checked bit for bit.",
          "", "| one group (rows x 128) | reference | compiled | speedup | identical |",
          "|---|---|---|---|---|"]  # fmt: skip
    for v in per_group.values():
        md.append(f"| {v['rows']} x {v['cols']} | {v['reference_s'] * 1e3:.1f} ms | "
                  f"{v['fast_s'] * 1e3:.1f} ms | {v['speedup']:.1f}x | {v['identical']} |")  # fmt: skip
    md += ["", "| layer (every projection's groups) | reference (one call per group) | compiled, one call "
           "per group | compiled, one call per projection | speedup |", "|---|---|---|---|---|"]  # fmt: skip
    for shape, v in out["layers"].items():
        md.append(f"| {shape} | {v['reference_s']:.1f} s | {v['fast_per_group_s']:.1f} s | "
                  f"{v['fast_batched_s']:.1f} s | {v['speedup']:.1f}x |")  # fmt: skip
    path = Path(args.json) if args.json else RESULTS / "scale_search_micro.json"
    path.write_text(json.dumps(out, indent=2, default=str))
    print("\n".join(md))


if __name__ == "__main__":
    main()
