"""How many experts a calibration set leaves thin under ``--moe-calib routed``, and what ``all`` costs.

A Qwen3-30B-A3B-shaped MoE stack (hidden 2048, 128 experts, top-8 with renormalised weights, expert
width 768; attention 32 heads of 128, 4 KV heads; ``--layers`` decoder layers, 2 by default) with
random weights (transformers' initialisation) whose embedding table is SmolLM2-135M's trained one
lifted to 2048 (:mod:`benchmarks.moe.inputs`), fed 128 x 512 WikiText-2 calibration tokens as
``bitmosaic quantize`` draws them.  Per layer: the rows routed to each expert (counted at the router,
as the float model is run layer by layer; the pipeline's routed statistics see these rows), how many
experts get fewer than N = 1, 16, 64, 256 rows and fewer than 2048 (``--moe-min-tokens auto`` for
gate/up: the input width).  The cost of ``all``: the statistics pass of layer 0's gate/up group
(:func:`bitmosaic.pipeline.experts.expert_statistics`, as a run calls it) under ``routed`` and ``all``,
timed on ``--time-samples`` of the samples (the full 128 x 512 under ``all`` runs 16x the expert FLOPs
and would take too long on this machine), and scaled linearly to the whole calibration set.

SIMULATED: a random router is not a trained one (trained routers are typically more skewed, so more
experts are thin); the counts say what the code reports and how the thresholds bite, not what
Qwen3-30B-A3B's router does.

Run: python -m benchmarks.moe.expert_coverage   (writes benchmarks/results/moe_expert_coverage.{json,md})
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from benchmarks.harness import write_results
from benchmarks.moe.inputs import SIMULATED, lifted_embeddings, wikitext_ids
from bitmosaic.modules.experts import unfuse_experts
from bitmosaic.pipeline.calibration import capture_layer_inputs
from bitmosaic.pipeline.capture import run_layer
from bitmosaic.pipeline.experts import expert_statistics
from bitmosaic.pipeline.settings import RunSettings

THRESHOLDS = (1, 16, 64, 256, 2048)


def build(layers: int, seed: int = 0):
    """The stack (module doc), its experts unfused as a run unfuses them."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    table = lifted_embeddings(2048, seed)
    cfg = Qwen3MoeConfig(
        vocab_size=table.shape[0],
        hidden_size=2048,
        moe_intermediate_size=768,
        intermediate_size=6144,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(table)
    unfuse_experts(model)
    return model


def _coverage(counts: list[int]) -> dict:
    t = sorted(counts)
    out = {"min": t[0], "median": statistics.median(t), "max": t[-1], "total_rows": sum(t)}
    out.update({f"below_{n}": sum(c < n for c in t) for n in THRESHOLDS})
    return out


def _stat_seconds(layer, inputs, kwargs, calib: str) -> float:
    group = tuple(
        f"mlp.experts.{e}.{p}" for e in range(len(layer.mlp.experts)) for p in ("gate_proj", "up_proj")
    )
    t0 = time.perf_counter()
    out = expert_statistics(
        layer, group, inputs, kwargs, settings=RunSettings(moe_calib=calib, moe_min_tokens=0)
    )
    seconds = time.perf_counter() - t0
    del out
    gc.collect()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--nsamples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--time-samples", type=int, default=4)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    t0 = time.perf_counter()
    torch.set_grad_enabled(False)
    ids = wikitext_ids(a.nsamples, a.seqlen)
    model = build(a.layers)
    layers = model.model.layers
    sub, kw = capture_layer_inputs(model, layers, ids[: a.time_samples], batch_size=a.time_samples)
    timed_rows = a.time_samples * a.seqlen
    seconds = {
        calib: _stat_seconds(layers[0], sub, next(iter(kw.values())), calib) for calib in ("routed", "all")
    }
    scale = ids.numel() / timed_rows
    timing = {
        "timed_rows": timed_rows,
        "seconds": seconds,
        "ratio_all_to_routed": seconds["all"] / seconds["routed"],
        "scaled_to_calibration_seconds": {k: v * scale for k, v in seconds.items()},
    }
    del sub
    inputs, kw = capture_layer_inputs(model, layers, ids, batch_size=a.batch_size)
    kwargs = next(iter(kw.values()))
    print(f"statistics pass of layer 0's gate/up on {timed_rows} rows: {timing['seconds']}")
    per_layer = []
    for li, layer in enumerate(layers):
        counts = torch.zeros(len(layer.mlp.experts), dtype=torch.long)

        def count(module, args, out, counts=counts):  # the router's top-k indices (its output unchanged)
            counts.add_(torch.bincount(out[2].reshape(-1), minlength=len(counts)))

        hook = layer.mlp.gate.register_forward_hook(count)
        for b in range(len(inputs)):
            inputs[b] = run_layer(layer, inputs[b], kwargs[b])
        hook.remove()
        per_layer.append(_coverage(counts.tolist()) | {"layer": li, "counts": counts.tolist()})
        print(f"layer {li}: {per_layer[-1] | {'counts': '...'}}  ({time.perf_counter() - t0:.0f}s)")
    out = {"simulated": SIMULATED, "shape": {"hidden": 2048, "experts": 128, "top_k": 8, "expert_width": 768,
           "layers": a.layers}, "calibration": [a.nsamples, a.seqlen], "thresholds": THRESHOLDS,
           "layers": per_layer, "all_cost": timing, "seconds": time.perf_counter() - t0,
           "threads": torch.get_num_threads()}  # fmt: skip
    write_results(a.json, "moe_expert_coverage", out, _markdown(out))


def _markdown(out: dict) -> str:
    n, s = out["calibration"]
    md = [
        f"# Expert coverage under --moe-calib routed ({n} x {s} tokens, Qwen3-30B-A3B-shaped MoE stack)",
        "",
        f"**{out['simulated']}.**",
        "",
        "| layer | rows/expert min | median | max | "
        + " | ".join(f"< {t}" for t in out["thresholds"])
        + " |",
        "|---:|---:|---:|---:|" + "---:|" * len(out["thresholds"]),
    ]
    for r in out["layers"]:
        md.append(
            f"| {r['layer']} | {r['min']} | {r['median']:g} | {r['max']} | "
            + " | ".join(str(r[f"below_{t}"]) for t in out["thresholds"])
            + " |"
        )
    c = out["all_cost"]
    md += [
        "",
        "Columns `< N`: experts (of 128) routed fewer than N rows; `< 2048` is `--moe-min-tokens auto` "
        "for gate/up (the input width).",
        "",
        f"## Cost of --moe-calib all (layer 0's gate/up statistics, {c['timed_rows']} rows timed, "
        f"{out['threads']} threads)",
        "",
        "| calib | seconds timed | scaled to the calibration set |",
        "|---|---:|---:|",
    ]
    md += [
        f"| {k} | {v:.2f} | {c['scaled_to_calibration_seconds'][k]:.0f} |" for k, v in c["seconds"].items()
    ]
    md += [
        "",
        f"`all` / `routed`: {c['ratio_all_to_routed']:.1f}x measured; in FLOPs `all` is E/k = 16x the routed "
        "pass (every expert runs and accumulates every row), and the routed pass's 128 small per-expert "
        "calls "
        "carry more fixed cost per row. Scaled linearly in the rows (not timed at the full size).",
    ]
    return "\n".join(md)


if __name__ == "__main__":
    main()
