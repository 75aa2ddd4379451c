"""GPTQ at real scale on a GPU: a Llama-3-8B-shaped model and one Llama-3-70B-shaped decoder layer.

The weights are random (N(0, 0.02), norms 1): a model of that size cannot be carried to the lent
GPU machine, and GPTQ's time and memory do not depend on the weight values.  The model is built
in host memory in bfloat16 from the real configuration (shapes, GQA, vocabulary); calibration
uses random token ids.  Reported: quantization seconds (the pipeline's own clock: capture,
per-layer moves, Hessians, GPTQ, packing), peak device memory (``torch.cuda.max_memory_allocated``)
and peak host RSS.

    python -m benchmarks.gpu.gpu_scale                       # 8B model + one 70B layer, on CUDA
    python -m benchmarks.gpu.gpu_scale --shape tiny --device cpu --nsamples 4 --seqlen 64   # smoke run
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from benchmarks.harness import RESULTS, machine_info, write_results
from benchmarks.scale.shapes import SHAPES


def build_random_llama(shape: str, dtype: torch.dtype, init_device: str = "cpu"):
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False)
    with init_empty_weights():
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    # drawn on ``init_device`` (a GPU draws 8B values in a second; one CPU thread takes about a minute)
    g = torch.Generator(device=init_device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                w = torch.randn(p.shape, generator=g, dtype=torch.float32, device=init_device)
                p.copy_(w.mul_(0.02).to(dtype))
                del w
        model.model.rotary_emb.__init__(cfg)  # buffers were left empty by to_empty
    model.eval()
    return model


def run(shape: str, args) -> dict:
    from bitmosaic import quantize_

    t = time.perf_counter()
    model = build_random_llama(shape, torch.bfloat16, args.device)
    build_s = time.perf_counter() - t
    vocab = model.config.vocab_size
    calib = torch.randint(0, vocab, (args.nsamples, args.seqlen), generator=torch.Generator().manual_seed(1))
    rep = quantize_(
        model,
        "gptq",
        calib,
        bits=4,
        group_size=128,
        order=args.order,
        static_groups=args.order == "act",
        device=args.device,
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )
    n_weights = sum(r["shape"][0] * r["shape"][1] for r in rep.layers)
    return {
        "shape": shape,
        "config": SHAPES[shape],
        "build_seconds": build_s,
        "quant_seconds": rep.seconds,
        "peak_device_mb": rep.peak_device_mb,
        "peak_rss_mb": rep.peak_rss_mb,
        "linears": len(rep.layers),
        "quantized_weights": n_weights,
        "bits_per_weight": rep.bits_per_weight,
        "offload_inputs": rep.calibration.get("offload_inputs"),
        "device": rep.device,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", action="append", choices=sorted(SHAPES), default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--nsamples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--order", default="act", choices=["act", "natural"])
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", default=str(RESULTS / "gpu_scale.json"))
    a = p.parse_args()
    shapes = a.shape or ["llama3-8b", "llama3-70b-layer"]
    dev = torch.device(a.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    rows = []
    for shape in shapes:
        print(f"{shape}: GPTQ w4 g128 {a.order}-order, calib {a.nsamples}x{a.seqlen} on {name}", flush=True)
        rows.append(run(shape, a))
        r = rows[-1]
        dev_mb = f"{r['peak_device_mb']:.0f}" if r["peak_device_mb"] is not None else "-"
        print(f"  {r['quant_seconds']:.1f} s, peak device {dev_mb} MB, peak RSS {r['peak_rss_mb']:.0f} MB")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out = {"device": name, "args": vars(a), "machine": machine_info(), "rows": rows}
    write_results(a.json, "gpu_scale", out)


if __name__ == "__main__":
    main()
