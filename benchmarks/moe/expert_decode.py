"""Decode speed of MoE expert layers shaped like Qwen3-30B-A3B (issue 71, item 3): hidden 2048, 128
experts, top-8, expert width 768, W4 g128 (asymmetric, random codes and scales: the time, not the
values, is measured).

Variants, each in its own process:

* ``per-expert``: a :class:`~bitmosaic.modules.experts.RoutedExperts` of one ``packed`` module per expert
  projection (kernels prepared), as a quantized MoE model ran before packing;
* ``packed``: the same modules after :func:`~bitmosaic.modules.packed_experts.pack_experts` (each
  projection's experts over one stacked storage, only the chosen experts run);
* ``...+lut``: both with ``$BITMOSAIC_KERNEL=lut`` (the bit-plane LUT kernel instead of ``LowBitWeight``,
  which the packed kind picks at 4 bits);
* ``bf16`` / ``float32``: transformers' own fused ``Qwen3MoeExperts`` (3-D parameters, its default
  experts implementation) in that dtype, the float reference.

A decode step is one token through ``--layers`` expert layers (``--float-layers`` for the float
references, whose weights are 4-8x larger), each with its own 8 distinct experts drawn uniformly at
random per token and layer (so the chosen experts' weights come from memory: every variant's weights are
far larger than the last-level cache).  Reported: tokens/s of the stack (median of ``--reps`` runs of
``--tokens`` tokens after one warm-up run), ms per layer, the same products alone (``kernels only``: the
24 kernel calls per layer and token without the routing around them), and the memory-bandwidth bound: the
bytes a token must read (8 experts x 3 projections x the kernel's bytes per expert, codes + float32 scales
and zero-points; the float weights for the references) divided into the machine's read bandwidth measured
at the same thread count (:func:`benchmarks.harness.machine.read_bandwidth_gbs`).

    python -m benchmarks.moe.expert_decode [--threads 1,2] [--layers 4] [--float-layers 2] [--lock FILE]
      (writes results/moe_decode.{md,json})
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.harness.writers import write_results

HIDDEN, EXPERTS, TOP_K, WIDTH, GROUP, BITS = 2048, 128, 8, 768, 128, 4
VARIANTS = ("per-expert", "packed", "per-expert+lut", "packed+lut", "bf16", "float32")


def _float_layer(dtype, init: bool = True):
    import torch
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = AutoConfig.for_model(
        "qwen3_moe", hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        moe_intermediate_size=WIDTH,
    )  # fmt: skip
    m = Qwen3MoeExperts(cfg).to(dtype)
    with torch.no_grad():
        for p in m.parameters() if init else ():
            p.normal_(0, 0.02)
    per_expert = (2 * WIDTH * HIDDEN + HIDDEN * WIDTH) * torch.finfo(dtype).bits // 8
    return m.eval(), per_expert


def _quant_layer(gen):
    """A RoutedExperts of random W4 g128 ``packed`` modules (asymmetric, fp16 scales and zero-points)."""
    import torch

    from bitmosaic.modules.experts import unfuse_experts
    from bitmosaic.modules.qlinear import QuantLinear

    def lin(n_in: int, n_out: int) -> QuantLinear:
        q = QuantLinear(n_in, n_out, bits=BITS, group_size=GROUP, symmetric=False)
        q.qweight.copy_(torch.randint(0, 256, q.qweight.shape, generator=gen, dtype=torch.uint8))
        q.scales.copy_(torch.rand(q.scales.shape, generator=gen) * 0.01 + 0.001)
        q.zeros.copy_(torch.randint(6, 10, q.zeros.shape, generator=gen))
        return q

    with torch.device("meta"):  # transformers' module, unfused (its gate rule), its float weights never made
        holder = torch.nn.ModuleList([_float_layer(torch.float32, init=False)[0]])
    unfuse_experts(holder)
    layer = holder[0]
    for mlp in layer:
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = lin(HIDDEN, WIDTH), lin(HIDDEN, WIDTH), lin(WIDTH, HIDDEN)
    for mlp in layer:
        for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            proj.kernel()
    per_expert = sum(p.kernel().nbytes() for p in (layer[0].gate_proj, layer[0].up_proj, layer[0].down_proj))
    return layer, per_expert


def _child(variant: str, threads: list[int], n_layers: int, tokens: int, reps: int) -> dict:
    import torch

    from benchmarks.harness.machine import read_bandwidth_gbs
    from bitmosaic.modules.packed_experts import pack_experts

    gen = torch.Generator().manual_seed(0)
    if variant.endswith("+lut"):  # the bit-plane LUT kernel for every expert (kernels/select.py override)
        os.environ["BITMOSAIC_KERNEL"] = "lut"
    t0 = time.perf_counter()
    if variant in ("bf16", "float32"):
        dtype = torch.bfloat16 if variant == "bf16" else torch.float32
        built = [_float_layer(dtype) for _ in range(n_layers)]
    else:
        dtype = torch.float32
        built = [_quant_layer(gen) for _ in range(n_layers)]
    layers, per_expert = [m for m, _ in built], built[0][1]
    if variant.startswith("packed"):
        holder = torch.nn.ModuleList(layers)
        assert pack_experts(holder) == n_layers
        layers = list(holder)
    build_s = time.perf_counter() - t0
    routes = [
        [torch.randperm(EXPERTS, generator=gen)[:TOP_K].reshape(1, TOP_K) for _ in layers]
        for _ in range(tokens)
    ]
    weights = torch.rand(tokens, n_layers, 1, TOP_K, generator=gen).softmax(-1).to(dtype)
    hidden = (torch.randn(tokens, 1, HIDDEN, generator=gen) * 0.1).to(dtype)

    def run() -> None:
        for t in range(tokens):
            h = hidden[t]
            for li, layer in enumerate(layers):
                h = h + layer(h, routes[t][li], weights[t, li])

    quantized = variant not in ("bf16", "float32")
    kernels = [[[getattr(mlp, p).kernel() for p in ("gate_proj", "up_proj", "down_proj")] for mlp in layer]
               for layer in layers] if quantized else []  # fmt: skip
    mid = torch.zeros(1, WIDTH)

    def kernels_only() -> None:  # the same 24 products per layer and token, nothing around them
        for t in range(tokens):
            for li in range(len(layers)):
                for e in routes[t][li].reshape(-1).tolist():
                    g, u, d = kernels[li][e]
                    g(hidden[t]), u(hidden[t]), d(mid)

    def median_s(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 2]

    rows = []
    for n in threads:
        torch.set_num_threads(n)
        bw = read_bandwidth_gbs()
        with torch.inference_mode():
            s = median_s(run)
            k_s = median_s(kernels_only) if quantized else None
        token_bytes = n_layers * TOP_K * per_expert
        rows.append({
            "variant": variant, "threads": n, "layers": n_layers, "tok_s": tokens / s,
            "ms_per_layer": s / tokens / n_layers * 1e3, "bytes_per_token": token_bytes,
            "read_bw_gbs": bw, "bound_tok_s": bw * 1e9 / token_bytes,
            "build_s": build_s,
            "kernels_ms_per_layer": None if k_s is None else k_s / tokens / n_layers * 1e3,
            "kernel": os.environ.get("BITMOSAIC_KERNEL", "auto") if quantized else variant,
        })  # fmt: skip
    return {"rows": rows}


def _markdown(out: dict) -> str:
    lines = [
        "# MoE expert decode (Qwen3-30B-A3B-shaped layers)",
        "",
        f"hidden {HIDDEN}, {EXPERTS} experts, top-{TOP_K}, width {WIDTH}; quantized: W{BITS} g{GROUP} "
        "asymmetric "
        "(random codes); 8 random distinct experts per token and layer; float references: transformers' "
        "Qwen3MoeExperts.  bound: measured read bandwidth / bytes a token reads (8 experts x 3 projections).",
        "",
        f"Command: `{out['command']}`",
        "",
        "| variant | threads | layers | tok/s | ms/layer | kernels only ms/layer | MB/token | read GB/s "
        "| bound tok/s | of bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in out["rows"]:
        lines.append(
            f"| {r['variant']} | {r['threads']} | {r['layers']} | {r['tok_s']:.1f} "
            f"| {r['ms_per_layer']:.2f} | "
            f"{'-' if r['kernels_ms_per_layer'] is None else format(r['kernels_ms_per_layer'], '.2f')} | "
            f"{r['bytes_per_token'] / 1e6:.1f} | {r['read_bw_gbs']:.1f} | {r['bound_tok_s']:.1f} | "
            f"{r['tok_s'] / r['bound_tok_s']:.0%} |"
        )
    lines.append("")
    rows = {(r["variant"], r["threads"]): r for r in out["rows"]}
    for (v, n), r in rows.items():
        b = rows.get((v.replace("packed", "per-expert"), n))
        if v.startswith("packed") and b:
            lines.append(f"- {v} vs {b['variant']} at {n} thread(s): {r['tok_s'] / b['tok_s']:.2f}x")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--float-layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    ap.add_argument("--lock", default=None, help="run each variant's process under `flock LOCK`")
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    if a.child:
        n = a.float_layers if a.child in ("bf16", "float32") else a.layers
        print(json.dumps(_child(a.child, threads, n, a.tokens, a.reps)))
        return
    rows = []
    for v in a.variants.split(","):
        cmd = [sys.executable, "-m", "benchmarks.moe.expert_decode", "--child", v, "--threads", a.threads,
               "--layers", str(a.layers), "--float-layers", str(a.float_layers), "--tokens", str(a.tokens),
               "--reps", str(a.reps)]  # fmt: skip
        cmd = ["flock", a.lock, *cmd] if a.lock else cmd
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:  # one variant failing leaves the others' rows (and says why)
            print(f"{v}: failed (exit {res.returncode}): {res.stderr.strip()[-2000:]}", flush=True)
            continue
        got = json.loads(res.stdout.strip().splitlines()[-1])["rows"]
        for r in got:
            line = f"{r['variant']:>14} {r['threads']}t: {r['tok_s']:.1f} tok/s"
            line += f" (bound {r['bound_tok_s']:.1f})"
            print(line, flush=True)
        rows += got
    out = {"command": "python -m benchmarks.moe.expert_decode " + " ".join(sys.argv[1:]), "rows": rows}
    write_results(a.out, "moe_decode", out, _markdown(out))


if __name__ == "__main__":
    main()
