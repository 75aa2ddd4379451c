"""Quantize at real shapes on this machine: a Llama-3-8B-shaped checkpoint and one Llama-3-70B-shaped
decoder layer, streamed (``quantize --stream on``), GPTQ w4 g128 with the default order and scales,
16 x 512 calibration tokens.

The checkpoints have random bf16 weights from a fixed seed (timings and memory do not depend on the
values) and are written shard by shard, one decoder layer at a time, never held whole.  The run is
the CLI itself in a child process; the parent reads its ``progress.json`` (wall seconds per layer)
and its peak RSS (``VmHWM``), and stops it after ``--layers`` layers (``--layers 0``: all of them; a
stopped run resumes where it stopped when run again).  Beside the numbers: the FLOP count of one
layer and this machine's measured float32 GEMM rate, so the time can be read against its bound.

    python -m benchmarks.scale.real_shapes write --shape llama3-8b --dir /tmp/l8b
    python -m benchmarks.scale.real_shapes run --shape llama3-8b --dir /tmp/l8b --layers 4
    python -m benchmarks.scale.real_shapes check --dir /tmp/l8b      # the finished output loads and generates
    python -m benchmarks.scale.real_shapes write --shape llama3-70b-layer --dir /tmp/l70
    python -m benchmarks.scale.real_shapes run --shape llama3-70b-layer --dir /tmp/l70 --layers 0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, gemm_gflops, machine_info, write_results  # noqa: E402
from benchmarks.scale.moe import MOE_SHAPES, hub_names, moe_config, moe_layer_flops  # noqa: E402
from benchmarks.scale.shapes import SHAPES  # noqa: E402


def _config(shape: str, layers: int | None = None):
    from transformers import LlamaConfig

    if shape in MOE_SHAPES:
        return moe_config(shape, layers)
    return LlamaConfig(**SHAPES[shape], tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=0,
                       eos_token_id=1)  # fmt: skip


def _random(name: str, shape, seed: int) -> torch.Tensor:
    """N(0, 0.02) in bf16 (norm weights: ones), from a generator seeded by the name; row blocks of at
    most 64M values so the float32 draw stays small."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    out = torch.empty(shape, dtype=torch.bfloat16)
    step = max(1, (64 << 20) // shape[1])
    for r in range(0, shape[0], step):
        out[r : r + step] = (torch.randn(min(step, shape[0] - r), shape[1], generator=g) * 0.02).bfloat16()
    return out


_BF16 = ("embed_tokens", "lm_head", "mlp.gate.", "norm")  # kept bf16 in the FP8 hub checkpoints


def _tensors(names: dict, group: list[str], seed: int, fp8: bool) -> dict[str, torch.Tensor]:
    """The shard's tensors; ``fp8``: each 2-D projection as E4M3 with a float32 scale per 128 x 128 block
    (``<name>_scale_inv``), as Qwen3-30B-A3B-FP8 and DeepSeek-V3 ship them (io/sources/fp8_block.py)."""
    from bitmosaic.io.sources import fp8_block

    sd = {}
    for n in group:
        t = _random(n, names[n], seed)
        if fp8 and t.ndim == 2 and not any(k in n for k in _BF16):
            sd[n], sd[n + fp8_block.SCALE_SUFFIX] = fp8_block.quantize(t)
        else:
            sd[n] = t
    return sd


def write_checkpoint(
    folder: Path, shape: str, seed: int = 0, layers: int | None = None, fp8: bool = False
) -> None:
    """A bf16 safetensors checkpoint of ``shape``: one shard per decoder layer, the embeddings and the
    head in shards of their own, an index, and a word tokenizer; never more than one shard in memory.
    ``layers``: a truncated checkpoint, its config's ``num_hidden_layers`` that many (the layers are the
    full model's first ones).  Experts are written as the hub ships them, one tensor per expert
    projection (``mlp.experts.<e>.gate_proj.weight``).  ``fp8``: the projections in FP8 with 128 x 128
    block scales (half the bytes: a 48-layer Qwen3-30B-A3B is 31 GB instead of 61 GB)."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from bitmosaic.testing import word_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    cfg = _config(shape, layers)
    if layers and shape not in MOE_SHAPES:
        cfg.num_hidden_layers = layers
    with init_empty_weights():
        skel = AutoModelForCausalLM.from_config(cfg)
    names = hub_names({n: tuple(p.shape) for n, p in skel.named_parameters()})
    names.update({n: tuple(b.shape) for n, b in skel.named_buffers() if "e_score_correction" in n})
    groups: list[list[str]] = [["model.embed_tokens.weight"]]
    for li in range(cfg.num_hidden_layers):
        groups.append([n for n in names if n.startswith(f"model.layers.{li}.")])
    groups.append(["model.norm.weight", "lm_head.weight"])
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        if not (folder / file).is_file():
            t0 = time.perf_counter()
            sd = _tensors(names, group, seed, fp8)
            save_file(sd, str(folder / (file + ".tmp")), metadata={"format": "pt"})
            os.replace(folder / (file + ".tmp"), folder / file)
            print(f"{file}: {len(sd)} tensors in {time.perf_counter() - t0:.1f}s", flush=True)
            del sd
        with safe_open(str(folder / file), "pt") as f:
            for n in f.keys():
                weight_map[n] = file
                sl = f.get_slice(n)
                total += int(torch.tensor(sl.get_shape()).prod()) * (1 if "F8" in sl.get_dtype() else 2)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    if fp8:
        cfg.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]}  # fmt: skip
    cfg.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    (folder / "calib.txt").write_text(" ".join(f"w{i % 997}" for i in range(200_000)))


def layer_flops(shape: str | dict, tokens: int, seqlen: int = 512) -> dict:
    """FLOPs of one decoder layer's GPTQ run (module doc of pipeline.py): the layer forwards the
    pipeline makes (no output cache at these sizes: a pass up to each group's inputs -- q/k/v's
    costs nothing -- and the final one) with their attention ``4 T seqlen h``, the Hessians
    ``2 T d^2`` of the four inputs (the upper triangle is ``T d^2``, plus the diagonal blocks), GPTQ's
    solve per stacked group (Cholesky ``d^3/3``, triangular inverse ``d^3/3``, column updates
    ``2 rows d^2``) and the report's error metrics (``w^T H w`` per row: ``2 rows d^2``).  ``shape``: a
    name of :data:`SHAPES` or a dict of the same fields."""
    s = SHAPES[shape] if isinstance(shape, str) else shape
    h, f = s["hidden_size"], s["intermediate_size"]
    kv = s["num_key_value_heads"] * (h // s["num_attention_heads"])
    qkv, o, gu, down = h * (h + 2 * kv), h * h, 2 * h * f, f * h
    passes = qkv + (qkv + o) + (qkv + o + gu) + (qkv + o + gu + down)
    forward = 2 * tokens * passes + 4 * (4 * tokens * seqlen * h)
    hess = tokens * (3 * h * h + f * f)
    groups = ((h + 2 * kv, h), (h, h), (2 * f, h), (h, f))
    solve = sum(2 * d**3 / 3 + 2 * rows * d * d for rows, d in groups)
    metrics = sum(2 * rows * d * d for rows, d in groups)
    return {"forward": forward, "hessian": hess, "gptq": solve, "metrics": metrics,
            "total": forward + hess + solve + metrics}  # fmt: skip


def _rss_mb(pid: int) -> float:
    return _vmhwm_mb(pid, "VmRSS:")


def _vmhwm_mb(pid: int, field: str = "VmHWM:") -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def quantize_argv(folder: Path, out: Path, threads: int | None, nsamples: int = 16,
                  max_memory: str | None = None) -> list[str]:  # fmt: skip
    """The CLI command of a streamed GPTQ w4 g128 run of ``folder`` into ``out``."""
    argv = [sys.executable, "-m", "bitmosaic.cli", "quantize", "--model", str(folder), "--method", "gptq",
            "--bits", "4", "--group-size", "128", "--calib", str(folder / "calib.txt"),
            "--nsamples", str(nsamples),
            "--seqlen", "512", "--dtype", "bfloat16", "--stream", "on", "--out", str(out),
            "--no-progress"]  # fmt: skip
    if threads:
        argv += ["--threads", str(threads)]
    if max_memory:
        argv += ["--max-memory", max_memory]
    return argv


def run(
    folder: Path, shape: str, layers: int, out: Path, threads: int | None, nsamples: int = 16,
    max_memory: str | None = None,
) -> dict:
    prog = out.parent / f".{out.name}.partial" / "progress.json"
    t0 = time.perf_counter()
    p = subprocess.Popen(quantize_argv(folder, out, threads, nsamples, max_memory))
    peak, done, trace, state, seen = 0.0, 0, [], None, 0.0
    while p.poll() is None:
        peak = max(peak, _vmhwm_mb(p.pid))
        trace.append((round(time.perf_counter() - t0, 1), round(_rss_mb(p.pid)), done))
        try:  # kept as last read: a finished run's work folder becomes the output, without it
            state = json.loads(prog.read_text())
            done = state["layers_done"]
            seen = time.perf_counter()
        except (OSError, ValueError, KeyError):
            pass
        if layers and done >= layers:
            p.terminate()
            p.wait()
            break
        time.sleep(0.5)
    wall = time.perf_counter() - t0
    per_layer = state.get("layer_seconds") if state else None
    n_layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    if out.is_dir() and len(per_layer or []) == n_layers - 1:  # the last layer's record went with the work
        per_layer = [*(per_layer or []), round(time.perf_counter() - (seen or t0), 3)]  # folder: to the exit
    return {"returncode": p.returncode, "wall_s": wall, "peak_rss_mb": peak, "layer_seconds": per_layer,
            "finished": out.is_dir(), "rss_trace": trace}  # fmt: skip


def check(out: Path, new_tokens: int = 8) -> dict:
    """Load the finished output with ``bitmosaic.load`` (transformers' ``from_pretrained`` with the
    packed modules) and generate greedily: load seconds, the first forward's and the first generation's
    seconds (each layer builds its kernel on first use: a MoE builds those of the experts it reaches),
    then the same generation again with every kernel built (steady decode), peak RSS, finite logits."""
    import resource

    from transformers import AutoTokenizer

    import bitmosaic

    t0 = time.perf_counter()
    if json.loads((out / "config.json").read_text()).get("model_type") in ("qwen3_moe", "deepseek_v3"):
        from bitmosaic.io import load_quantized

        model = load_quantized(str(out), load_tokenizer=False)[0]  # experts: one linear each
    else:
        # eager decode, as before issue 74's compiled default: 8 tokens would time a one-off compile
        model = bitmosaic.load(str(out), compile=False)
    load_s = time.perf_counter() - t0
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok("w1 w2 w3 w4", return_tensors="pt").input_ids
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model(ids).logits
        first_s = time.perf_counter() - t0  # builds the kernels of the experts the prompt reaches
        t0 = time.perf_counter()
        gen = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
        gen_s = time.perf_counter() - t0  # builds those of the experts the new tokens reach
        t0 = time.perf_counter()
        again = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
        steady_s = time.perf_counter() - t0  # the same tokens: every kernel built
    kinds = sorted({type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__})
    new = int(gen.shape[1] - ids.shape[1])
    return {"load_s": load_s, "first_forward_s": first_s, "generate_s": gen_s, "new_tokens": new,
            "tokens_per_s": new / gen_s, "steady_generate_s": steady_s, "steady_tokens_per_s": new / steady_s,
            "same_tokens": bool(torch.equal(gen, again)),
            "logits_finite": bool(torch.isfinite(logits).all()),
            "linear_kinds": kinds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "output_gb": sum(p.stat().st_size for p in out.glob("*.safetensors")) / 1e9}  # fmt: skip


def moe_results(args, gemm: float, res: dict) -> None:
    """One MoE run's row in ``benchmarks/results/moe_scale.{json,md}`` (the earlier runs' rows kept)."""
    flops = moe_layer_flops(args.shape, args.nsamples * 512)
    secs = res["layer_seconds"] or []
    steady = secs[1:] or secs  # the first layer's time includes loading and the capture
    mean = sum(steady) / max(len(steady), 1)
    bound = flops["total"] / (gemm * 1e9)
    row = {"shape": args.shape, "layers_run": len(secs), "calibration": f"{args.nsamples} x 512",
           "threads": args.threads, "peak_rss_mb": res["peak_rss_mb"], "layer_seconds": secs,
           "mean_s_per_layer_after_first": mean, "bound_s_per_layer": bound,
           "ratio_to_bound": mean / bound if bound else None, "gemm_gflops_fp32": gemm,
           "layer_tflop": {k: v / 1e12 for k, v in flops.items()}, "finished": res["finished"],
           "wall_s": res["wall_s"], "rss_trace_s_mb_layers": res["rss_trace"][::4]}  # fmt: skip
    path = Path(args.json or RESULTS / "moe_scale.json")
    data = json.loads(path.read_text()) if path.is_file() else {"runs": {}}
    data["runs"][f"{args.shape} {args.nsamples}x512" + (f", {args.label}" if args.label else "")] = row
    data["machine"] = machine_info()
    md = moe_markdown(data)
    write_results(path, "moe_scale", data, md)
    print(md)


def moe_markdown(data: dict) -> str:
    """``moe_scale.md``: the table of every run in ``data`` and its notes."""
    md = ["# Streamed GPTQ w4 g128 of MoE checkpoints at real shapes (issue 71)", "",
          "Random bf16 weights, hub per-expert tensor names, truncated checkpoints of the layers run; "
          "`python -m benchmarks.scale.real_shapes run --shape S --dir D --layers 0 --threads 2 "
          "--nsamples N`. Bound: FLOPs per layer (benchmarks/scale/moe.py) / the float32 GEMM rate "
          "measured in the run.", "",
          "| shape | layers run | calibration | peak RSS | s/layer after the first (each) "
          "| FLOP bound s/layer | ratio |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in data["runs"].values():
        each = ", ".join(f"{s:.0f}" for s in r["layer_seconds"])
        if not r["layer_seconds"]:  # stopped (or killed) before its first layer was committed
            md.append(f"| {r['shape']} | 0 (stopped after {r['wall_s'] / 60:.0f} min, unfinished: see the "
                      f"notes) | {r['calibration']} | {r['peak_rss_mb'] / 1024:.2f} GiB | - | "
                      f"{r['bound_s_per_layer']:.1f} ({r['layer_tflop']['total']:.2f} TFLOP at "
                      f"{r['gemm_gflops_fp32']:.0f} GFLOP/s) | - |")  # fmt: skip
            continue
        md.append(f"| {r['shape']} | {r['layers_run']} | {r['calibration']} | {r['peak_rss_mb'] / 1024:.2f} "
                  f"GiB | {r['mean_s_per_layer_after_first']:.1f} ({each}) | {r['bound_s_per_layer']:.1f} "
                  f"({r['layer_tflop']['total']:.2f} TFLOP at {r['gemm_gflops_fp32']:.0f} GFLOP/s) | "
                  f"{r['ratio_to_bound']:.2f}x |")  # fmt: skip
    notes = data.get("notes") or []
    return "\n".join(md + (["", "## Notes", ""] + [f"* {n}" for n in notes] if notes else []))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("write", "run", "check", "table"))
    ap.add_argument("--shape", choices=sorted([*SHAPES, *MOE_SHAPES]), default="llama3-8b")
    ap.add_argument("--dir", type=Path, default=None, help="the checkpoint folder (write, run, check)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default DIR-gptq-w4g128)")
    ap.add_argument("--layers", type=int, default=4, help="stop after this many layers (0: all)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nsamples", type=int, default=16, help="calibration samples of 512 tokens")
    ap.add_argument("--max-memory", default=None, help="run: the CLI's --max-memory (default: its own)")
    ap.add_argument("--label", default=None, help="run: a row of its own (the key gets this suffix)")
    ap.add_argument("--write-layers", type=int, default=None,
                    help="write: a truncated checkpoint of this many decoder layers (its config says so)")
    ap.add_argument("--fp8", action="store_true",
                    help="write: the projections in FP8 with 128 x 128 block scales")  # fmt: skip
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.what == "write":
        write_checkpoint(args.dir, args.shape, args.seed, args.write_layers, args.fp8)
        return
    if args.what == "table":  # moe_scale.md again from its JSON (after notes were added to it)
        path = Path(args.json or RESULTS / "moe_scale.json")
        write_results(path, "moe_scale", (data := json.loads(path.read_text())), moe_markdown(data))
        return
    out = args.out or args.dir.with_name(args.dir.name + "-gptq-w4g128")
    if args.what == "check":
        res = check(out)
        print(json.dumps(res, indent=1))
        moe = args.shape in MOE_SHAPES
        path = Path(args.json or RESULTS / ("moe_scale.json" if moe else f"real_shapes_{args.shape}.json"))
        if path.is_file():  # beside the run's numbers
            data = json.loads(path.read_text())
            (data if moe else data["results"])["load_and_generate" + (f" {out.name}" if moe else "")] = res
            path.write_text(json.dumps(data, indent=2, default=str))
        return
    gemm = gemm_gflops()
    res = run(args.dir, args.shape, args.layers, out, args.threads, args.nsamples, args.max_memory)
    if args.shape in MOE_SHAPES:
        moe_results(args, gemm, res)
        return
    flops = layer_flops(args.shape, 16 * 512)
    n_layers = SHAPES[args.shape]["num_hidden_layers"]
    secs = res["layer_seconds"] or []
    steady = secs[1:] or secs  # the first layer's time includes loading and the capture
    mean = sum(steady) / max(len(steady), 1)
    bound = flops["total"] / (gemm * 1e9)
    rows = {
        "shape": args.shape, "gemm_gflops_fp32": gemm, "layer_tflop": {k: v / 1e12 for k, v in flops.items()},
        "bound_s_per_layer": bound, "layer_seconds": secs, "mean_s_per_layer_after_first": mean,
        "ratio_to_bound": mean / bound if bound else None, "projected_total_s": mean * n_layers,
        "peak_rss_mb": res["peak_rss_mb"], "finished": res["finished"], "wall_s": res["wall_s"],
        "rss_trace_s_mb_layers": res["rss_trace"][::4],
    }  # fmt: skip
    md = [f"# {args.shape}: GPTQ w4 g128 (default order/scales), 16 x 512 calibration, streamed", "",
          "| quantity | value |", "|---|---|",
          f"| float32 GEMM rate (4096x4096 @ 8192 rows) | {gemm:.0f} GFLOP/s |",
          f"| FLOPs per layer: forwards + Hessians + GPTQ + error metrics | "
          f"{' + '.join(f'{flops[k] / 1e12:.2f}' for k in ('forward', 'hessian', 'gptq', 'metrics'))} = "
          f"{flops['total'] / 1e12:.2f} TFLOP |",
          f"| bound per layer (FLOPs / GEMM rate) | {bound:.1f} s |",
          f"| seconds per layer (wall, as run) | {', '.join(f'{s:.1f}' for s in secs)} |",
          f"| mean after the first / bound | {mean:.1f} s / {bound:.1f} s = {rows['ratio_to_bound']:.2f}x |",
          f"| projected total ({n_layers} layers) | {mean * n_layers / 60:.1f} min |",
          f"| peak RSS | {res['peak_rss_mb']:.0f} MB |",
          f"| finished the whole model | {res['finished']} |"]  # fmt: skip
    write_results(args.json, f"real_shapes_{args.shape}", {"results": rows, "machine": machine_info()},
                  "\n".join(md))  # fmt: skip
    print("\n".join(md))


if __name__ == "__main__":
    main()
