"""Quantization time, peak memory and perplexity: bitmosaic against llm-compressor, in ONE run.

Protocol (shared/data/README.md): SmolLM2-135M, GPTQ w4 g64 with static act-order (and the issue-74
pair: bitmosaic's GPTQ defaults, w4 g128 asymmetric, against llm-compressor's w4 g64 asym), calibration
16 x 512 tokens of WikiText-2 valid (seed 0, the same token ids for both tools), perplexity on the
first 20 x 512 windows of WikiText-2 raw test with the same evaluation code for both.  Each tool
runs in its own child process, so its peak RSS (``ru_maxrss``: model load included, the same
loader for both) is its own; "seconds" is quantization only (no load, no eval).

llm-compressor is the optional ``anchors`` extra (``pip install -e .[anchors]``, or a separate
environment given with ``--anchor-python``); without it its rows are skipped with a message.

    python -m benchmarks.peers.speed                       (writes benchmarks/results/speed.json)
    python -m benchmarks.peers.speed --anchor-python /path/to/venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks import RESULTS

DEFAULTS_ROW = "bitmosaic gptq defaults (w4 g128 asym act-static mse)"
PEER_ROW = "llm-compressor gptq w4 g64 act-static asym"
SAME_ROW = "bitmosaic gptq w4 g64 act-static asym mse"  # the peer's settings

# name -> (tool, options); bitmosaic options are quantize_ keywords (bits 4, group 64 unless given);
# llm-compressor's: symmetric, bits, group_size
CONFIGS = {
    "llm-compressor gptq w4 g64 act-static sym": ("llm-compressor", {"symmetric": True}),
    "bitmosaic gptq w4 g64 act-static sym": (
        "bitmosaic",
        {"symmetric": True, "order": "act", "static_groups": True, "scale_method": "minmax"},
    ),
    SAME_ROW: (
        "bitmosaic",
        {"symmetric": False, "order": "act", "static_groups": True, "scale_method": "mse"},
    ),
    "bitmosaic gptq w4 g64 act-static sym bf16": (
        "bitmosaic",
        {"symmetric": True, "order": "act", "static_groups": True, "scale_method": "minmax", "dtype": "bf16"},
    ),
    # issue 74's calibration target: `bitmosaic quantize --method gptq` with no further flags (its
    # defaults: w4 g128 asymmetric, act-order, static groups at 4 bits, MSE scales) against
    # llm-compressor's asymmetric GPTQ with static act-order at g64: llm-compressor cannot run g128 on
    # SmolLM2 (its 576-wide inputs are 4.5 groups: the modifier refuses, and with
    # bypass_divisibility_checks its observer fails to unflatten [-1, 128]); g64 is the largest group it
    # takes here (finer groups: more scales for it to fit, and a lower perplexity to match)
    DEFAULTS_ROW: ("bitmosaic", {"defaults": True}),
    PEER_ROW: ("llm-compressor", {"symmetric": False}),
}


def peer_of(name: str) -> str:
    """The llm-compressor row a config is timed against: the one of its bits, group and symmetry."""
    if CONFIGS[name][0] == "llm-compressor":
        return name
    return PEER_ROW if name in (DEFAULTS_ROW, SAME_ROW) else "llm-compressor gptq w4 g64 act-static sym"


def _child(args) -> dict:
    """Runs in a fresh process: load, calibrate, quantize (timed), evaluate; returns one row."""
    import resource
    import time

    import torch

    from bitmosaic.data import bos_token_id, calibration_samples, eval_tokens
    from bitmosaic.eval.perplexity import perplexity
    from bitmosaic.io import load_model

    tool, opts = CONFIGS[args.child]
    opts = dict(opts)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if opts.pop("dtype", None) == "bf16" else torch.float32
    model, tok = load_model(args.model, dtype=dtype)
    calib = calibration_samples(
        tok, "wikitext2", args.nsamples, args.seqlen, args.seed, data_dir=args.data_dir
    )
    t0 = time.perf_counter()
    if tool == "bitmosaic":
        from bitmosaic import quantize_

        # the defaults row passes no option at all: what `bitmosaic quantize --method gptq` runs
        given = {} if opts.pop("defaults", False) else {"bits": 4, "group_size": 64, **opts}
        rep = quantize_(model, "gptq", calib, progress=False, **given)
        seconds = time.perf_counter() - t0
        from bitmosaic.kernels.build import COMPILED

        # kernels compiled inside the timed region (the parent prebuilds them: none, unless stale)
        extra = {"reported_seconds": rep.seconds, "bits_per_weight": rep.bits_per_weight,
                 "kernels_compiled": list(COMPILED)}  # fmt: skip
    else:
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
        from datasets import Dataset
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import GPTQModifier

        weights = QuantizationArgs(
            num_bits=opts.get("bits", 4),
            type="int",
            symmetric=opts["symmetric"],
            strategy="group",
            group_size=opts.get("group_size", 64),
        )
        recipe = GPTQModifier(
            config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
            ignore=["lm_head"],
            actorder="static",
            dampening_frac=0.01,
            block_size=128,
        )
        # llm-compressor re-reads the config from model.config.name_or_path; a GGUF folder has none
        import tempfile

        cfg_dir = tempfile.mkdtemp(prefix="speed-cfg-")
        # the GGUF loader dequantized the weights to float: this model is a float model now
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.hf_quantizer = None
        model.config.save_pretrained(cfg_dir)
        model.config._name_or_path = cfg_dir
        ds = Dataset.from_dict(
            {"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()}
        )
        oneshot(
            model=model,
            tokenizer=tok,
            dataset=ds,
            recipe=recipe,
            num_calibration_samples=calib.shape[0],
            max_seq_length=calib.shape[1],
            shuffle_calibration_samples=False,
        )
        seconds = time.perf_counter() - t0
        import llmcompressor

        extra = {"llmcompressor": llmcompressor.__version__}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    ids = eval_tokens(tok, "wikitext2", data_dir=args.data_dir)
    if dtype != torch.float32:  # evaluate every row in float32 (the quantized weights are exact)
        torch.nn.Module.float(model)  # transformers refuses .float() on a GGUF-loaded model
    bos = bos_token_id(tok)
    ppl = perplexity(model, ids, args.seqlen, max_windows=args.max_windows, progress=False, bos_token_id=bos)[
        "ppl"
    ]
    return {"name": args.child, "tool": tool, "seconds": seconds, "peak_rss_mb": rss, "ppl": ppl, **extra}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--nsamples", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--max-windows", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--anchor-python", default=sys.executable, help="interpreter that has llmcompressor")
    p.add_argument("--only", default=None, help="comma list of config names (default: all)")
    p.add_argument("--json", default=str(RESULTS / "speed.json"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("ROW " + json.dumps(_child(a)), flush=True)
        return
    names = a.only.split(",") if a.only else list(CONFIGS)
    passthrough = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(a).items()
        if k in ("model", "nsamples", "seqlen", "max_windows", "seed", "data_dir", "threads")
        and v is not None
    ]
    from benchmarks.harness.child import child_env, module_command  # the parent only

    rows, skipped = [], {}
    env = child_env({**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if any(CONFIGS[n][0] == "bitmosaic" for n in names):  # no compile inside a timed child
        subprocess.run(module_command("bitmosaic.kernels"), capture_output=True, text=True, env=env)
    for name in names:
        tool = CONFIGS[name][0]
        py = a.anchor_python if tool == "llm-compressor" else sys.executable
        if tool == "llm-compressor":
            try:
                probe = subprocess.run([py, "-c", "import llmcompressor"], capture_output=True, text=True)
                missing = probe.returncode != 0
            except OSError:  # --anchor-python is not an interpreter
                missing = True
            if missing:
                skipped[name] = "llmcompressor is not installed (pip install -e .[anchors])"
                print(f"skipped {name}: {skipped[name]}", flush=True)
                continue
        print(f"running {name} ...", flush=True)
        proc = subprocess.run(
            [*module_command("benchmarks.peers.speed", py), "--child", name, *passthrough],
            capture_output=True,
            text=True,
            env=env,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            skipped[name] = "failed: " + " | ".join(tail)
            print(f"  {skipped[name]}", flush=True)
            continue
        row = json.loads(lines[-1][4:])
        rows.append(row)
        print(
            f"  {row['seconds']:.1f} s, peak RSS {row['peak_rss_mb']:.0f} MB, ppl {row['ppl']:.3f}",
            flush=True,
        )
    by_name = {r["name"]: r for r in rows}
    print(f"\nSmolLM2-135M GPTQ, calib {a.nsamples}x{a.seqlen}, eval first {a.max_windows}x{a.seqlen}")
    print(f"{'config':<52} {'seconds':>8} {'speedup':>8} {'peak RSS MB':>12} {'ppl':>8}")
    for r in rows:
        base = by_name.get(peer_of(r["name"]))  # llm-compressor at the row's bits, group and symmetry
        r["vs"] = base["name"] if base else None
        r["speedup_vs_llm_compressor"] = base["seconds"] / r["seconds"] if base else None
        r["rss_ratio_vs_llm_compressor"] = r["peak_rss_mb"] / base["peak_rss_mb"] if base else None
        sp = f"{r['speedup_vs_llm_compressor']:.2f}x" if base else "-"
        print(f"{r['name']:<52} {r['seconds']:>8.1f} {sp:>8} {r['peak_rss_mb']:>12.0f} {r['ppl']:>8.3f}")
    from benchmarks.harness import (  # the parent only: a child may run in another env
        machine_info,
        write_results,
    )

    args = {k: v for k, v in vars(a).items() if k != "child"}
    out = {"args": args, "machine": machine_info(), "rows": rows}
    write_results(a.json, "speed", {**out, "skipped": skipped})


if __name__ == "__main__":
    main()
