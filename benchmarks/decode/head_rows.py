"""The ``int8`` run-time output head (``modules/head.py``) at prefill and evaluation row counts: where its
low-bit kernel (made for decode) hands over to torch's GEMM over chunks of its dequantized weight
(``HEAD_GEMM_ROWS``).  On SmolLM2-135M's real head (``49152 x 576``, the int8 copy a load gives it by
default) at each ``--rows`` count and ``--threads`` count, in one process: the float head (``F.linear`` on
the float32 weight: the baseline), the low-bit kernel alone, the chunked GEMM alone, and the head's
forward as dispatched now.

Beside the times, the physical bounds: the float32 GEMM rate (``torch.mm`` on 2048^3) and the read
bandwidth, measured in the run; ``gemm bound`` is ``2 x rows x 49152 x 576`` at that rate, ``read
bound`` the int8 weight's bytes (and the float weight's, for the float head) at that bandwidth.

    python -m benchmarks.decode.head_rows [--threads 1,2] [--rows 1,8,64,128,192,256,512]
      (writes benchmarks/results/head_rows.{json,md})
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.harness import gemm_gflops, machine_info, median_ms, read_bandwidth_gbs, write_results


def measure(threads: list[int], rows: list[int], budget_s: float) -> dict:
    from bitmosaic.io import load_model
    from bitmosaic.modules.head import HEAD_GEMM_ROWS, default_runtime_head

    model, _ = load_model("smollm2-135m", dtype=torch.float32)
    # what a load of a quantized SmolLM2 result gives (bitmosaic.load, load_quantized, from_pretrained)
    if default_runtime_head(model) != "int8":
        raise SystemExit("error: SmolLM2's head is not on its int8 copy; unset $BITMOSAIC_RUNTIME_HEAD")
    head = model.get_output_embeddings()
    fwd = head.__dict__["forward"]  # the run-time head's forward (modules/head.py _Int8HeadForward)
    w = head.weight.detach()
    N, K = w.shape
    gen = torch.Generator().manual_seed(0)
    out = []
    for t in threads:
        torch.set_num_threads(t)
        rate, bw = gemm_gflops(2048, 2048, 2048), read_bandwidth_gbs()
        print(f"{t} thread(s): torch.mm float32 {rate:.0f} GFLOPS, read bandwidth {bw:.1f} GB/s", flush=True)
        for m in rows:
            x = torch.randn(m, K, generator=gen)
            with torch.inference_mode():
                f = median_ms(lambda: F.linear(x, w), budget_s, 20)
                k = median_ms(lambda: fwd.kernel(x), budget_s, 20)
                g = median_ms(lambda: fwd.gemm(x), budget_s, 20)
                d = median_ms(lambda: head(x), budget_s, 20)
            r = {"threads": t, "rows": m, "float_ms": f, "kernel_ms": k, "gemm_ms": g, "head_ms": d,
                 "head_path": "gemm" if m >= HEAD_GEMM_ROWS else "kernel", "fp32_gflops": rate,
                 "read_gbs": bw, "gemm_bound_ms": 2 * m * N * K / (rate * 1e9) * 1e3,
                 "int8_read_bound_ms": N * K / (bw * 1e9) * 1e3}  # fmt: skip
            out.append(r)
            print(f"  rows {m:4d}: float {f:7.2f} ms  kernel {k:7.2f}  chunked GEMM {g:7.2f}  head now "
                  f"{d:7.2f} ({r['head_path']}, {f / d:.2f}x the float head)", flush=True)  # fmt: skip
    return {"rows": out, "shape": [N, K], "head_gemm_rows": HEAD_GEMM_ROWS}


def markdown(res: dict, command: str) -> str:
    N, K = res["shape"]
    md = [f"# The int8 run-time head ({N} x {K}, SmolLM2-135M) by rows of x", "",
          f"`{command}`; `HEAD_GEMM_ROWS` = {res['head_gemm_rows']}: from there on the head runs the chunked "
          "GEMM. Speed-up = float ms / head ms (same run).", "",
          "| threads | rows | float ms | kernel ms | chunked GEMM ms | head now ms (path) "
          "| speed-up vs float | GEMM bound ms | int8 read bound ms |",
          "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res["rows"]:
        md.append(f"| {r['threads']} | {r['rows']} | {r['float_ms']:.2f} | {r['kernel_ms']:.2f} | "
                  f"{r['gemm_ms']:.2f} | {r['head_ms']:.2f} ({r['head_path']}) | "
                  f"{r['float_ms'] / r['head_ms']:.2f}x | {r['gemm_bound_ms']:.2f} | "
                  f"{r['int8_read_bound_ms']:.2f} |")  # fmt: skip
    return "\n".join(md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rows", default="1,8,64,128,192,256,512")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timed calls per median")
    p.add_argument("--json", default=None, help="default benchmarks/results/head_rows.json")
    a = p.parse_args()
    res = measure([int(t) for t in a.threads.split(",")], [int(r) for r in a.rows.split(",")], a.budget)
    cmd = f"python -m benchmarks.decode.head_rows --threads {a.threads} --rows {a.rows}"
    out = {"args": vars(a), **res, "machine": machine_info()}
    write_results(a.json, "head_rows", out, markdown(res, cmd))


if __name__ == "__main__":
    main()
