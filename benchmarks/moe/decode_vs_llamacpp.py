"""Decode of a Qwen3-30B-A3B-shaped model (a few layers) in bitmosaic against llama.cpp running
bitmosaic's own GGUF export of it, same run, 1 and 2 threads (issue 71, "Measure").

The checkpoint: ``python -m benchmarks.scale.real_shapes write --shape qwen3-30b-a3b --write-layers 3
--dir D`` (random bf16 weights of the real shapes, hidden 2048, 128 experts of width 768, top-8, vocabulary
151936; its config says 3 layers).  It is quantized streamed with RTN W4 g32 symmetric (the method does not
change decode speed; symmetric 4-bit groups of 32 are llama.cpp's ``Q4_0`` exactly), saved, and exported
with ``bitmosaic export --format gguf`` (``Q4_0`` for every linear and the experts, which llama.cpp keeps
as ``ffn_{gate,up,down}_exps``; the embeddings and head as the export writes them, noted in the JSON).

Rows, each in its own process (``--threads`` each): ``bitmosaic`` = ``bitmosaic.load(out)`` then plain
``generate`` (greedy, the default load: what a user gets; the compiled decode step refuses a mixture of
experts, whose routing is data-dependent), and ``llama.cpp Q4_0`` = llama-cpp-python (built from source by
``benchmarks/peers/peer_llama.py``) on the exported file. Same prompt token ids (random: the checkpoint
has no tokenizer), same number of new tokens; decode tok/s counts the tokens after the first over their
wall time, best of ``--repeats``. Bound: the bytes a token reads (per layer the attention and 8 experts'
packed weights, plus the head) over the read bandwidth measured in the same run (a 1 GiB ``torch.sum``).
Random weights route uniformly-ish, as the bound assumes. At 3 layers the 151936 x 2048 head (bf16 in
both) is most of the bytes a token reads, so this measures the head and the step's fixed costs as much as
the experts.

    flock /tmp/locks/heavy python -m benchmarks.moe.decode_vs_llamacpp --dir D [--threads 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPT_IDS = [9707, 11, 1879, 0, 576, 3364, 315, 279, 3283, 12033]  # any ids below the vocabulary


def _child_bitmosaic(folder: str, threads: int, new_tokens: int, repeats: int, compiled: bool) -> dict:
    import torch

    import bitmosaic

    torch.set_num_threads(threads)
    model = bitmosaic.load(folder)
    if compiled:
        from bitmosaic.modules.decode import enable_compiled_decode

        enable_compiled_decode(model)
    ids = torch.tensor([PROMPT_IDS])
    rates, out = [], None
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        first = time.perf_counter() - t0
        for _ in range(repeats):
            stamps: list[float] = []

            class _Clock:  # a streamer: one call per new token
                def put(self, value):
                    stamps.append(time.perf_counter())

                def end(self):
                    pass

            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 streamer=_Clock())  # fmt: skip
            rates.append((len(stamps) - 2) / (stamps[-1] - stamps[1]))  # stamps[0]: the prompt itself
    return {
        "decode_tok_s": max(rates),
        "first_generate_s": first,
        "tokens": out[0, len(PROMPT_IDS) :].tolist(),
    }


def _child_llama(gguf: str, threads: int, new_tokens: int, repeats: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=256, seed=0, verbose=False)

    def run(n: int, clock: list[float]) -> list[int]:
        toks: list[int] = []
        for t in llm.generate(PROMPT_IDS, temp=0.0, top_k=1, reset=True):
            clock.append(time.perf_counter())
            toks.append(t)
            if len(toks) == n:
                break
        return toks

    run(4, [])
    rates, out = [], []
    for _ in range(repeats):
        stamps: list[float] = []
        out = run(new_tokens, stamps)
        rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return {"decode_tok_s": max(rates), "first_generate_s": None, "tokens": out}


def _run_child(argv: list[str], peer: str = "") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": argv[argv.index("--threads") + 1]}
    if peer:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (peer, env.get("PYTHONPATH", "")) if p)
    r = subprocess.run([sys.executable, "-m", "benchmarks.moe.decode_vs_llamacpp", *argv], env=env,
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"child {argv} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _prepare(ckpt: Path, work: Path) -> tuple[Path, Path, dict]:
    from bitmosaic.cli import main as cli

    out, gguf = work / "q30-rtn-w4g32-sym", work / "q30-rtn-w4g32-sym.gguf"
    if not (out / "config.json").is_file():
        rc = cli(["quantize", "--model", str(ckpt), "--method", "rtn", "--bits", "4", "--group-size", "32",
                  "--sym", "--dtype", "bfloat16", "--stream", "on", "--out", str(out),
                  "--no-progress"])  # fmt: skip
        if rc:
            raise SystemExit(f"quantize failed ({rc})")
    from bitmosaic.io.export import export_model

    # the checkpoint's word tokenizer has no GGUF form: llama.cpp runs on token ids ("none" vocabulary)
    ids_only = work / "q30-rtn-w4g32-sym-ids"
    ids_only.mkdir(exist_ok=True)
    for f in out.iterdir():
        link = ids_only / f.name
        if not f.name.startswith(("tokenizer", "special_tokens", "vocab")) and not link.exists():
            link.symlink_to(f.resolve())
    res = export_model(ids_only, gguf, "gguf", overwrite=True)
    return out, gguf, {"notes": list(res.notes), "gguf_mb": gguf.stat().st_size / 2**20}


def _bytes_per_token(folder: Path) -> float:
    """Bytes one decode token reads: the attention and 8 of 128 experts' stored weights per layer, the
    norms, and the head (the embedding row is negligible)."""
    from safetensors import safe_open

    cfg = json.loads((folder / "config.json").read_text())
    k = cfg["num_experts_per_tok"]
    e = next(cfg[n] for n in ("num_experts", "num_local_experts", "n_routed_experts") if cfg.get(n))
    total = 0.0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if "embed_tokens" in name:
                    continue
                sl = st.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= d
                size = n * {"I32": 4, "F32": 4, "BF16": 2, "F16": 2, "U8": 1, "I8": 1, "I64": 8}.get(
                    sl.get_dtype(), 4
                )
                total += size * (k / e if ".mlp.experts." in name else 1.0)
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", help="the Qwen3-30B-A3B-shaped checkpoint (module doc)")
    p.add_argument("--work", default=None, help="where the quantized folder and GGUF go (default DIR-decode)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="default benchmarks/results/moe_decode_llamacpp.json")
    p.add_argument("--child", choices=("bitmosaic", "compiled", "llama"), help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        t = int(a.threads)
        if a.child == "llama":
            r = _child_llama(a.path, t, a.new_tokens, a.repeats)
        else:
            r = _child_bitmosaic(a.path, t, a.new_tokens, a.repeats, a.child == "compiled")
        print(json.dumps(r))
        return
    import torch

    from benchmarks.harness import read_bandwidth_gbs, write_results
    from benchmarks.peers.peer_llama import find_or_build

    ckpt = Path(a.dir)
    work = Path(a.work) if a.work else ckpt.with_name(ckpt.name + "-decode")
    work.mkdir(parents=True, exist_ok=True)
    folder, gguf, export = _prepare(ckpt, work)
    peer = find_or_build()
    per_token = _bytes_per_token(folder)
    rows = []
    for t in (int(x) for x in a.threads.split(",")):
        torch.set_num_threads(t)
        bw = read_bandwidth_gbs()
        common = ["--threads", str(t), "--new-tokens", str(a.new_tokens), "--repeats", str(a.repeats)]
        for name, child, path in (("bitmosaic", "bitmosaic", folder), ("llama.cpp Q4_0", "llama", gguf)):
            if child == "llama" and peer is None:
                continue
            try:
                r = _run_child(
                    ["--child", child, "--path", str(path), *common], (peer or "") if child == "llama" else ""
                )
            except RuntimeError as err:
                print(f"{name} at {t} threads failed: {str(err).splitlines()[-1]}", file=sys.stderr)
                r = {"decode_tok_s": None, "error": str(err).splitlines()[-1]}
            r.update(variant=name, threads=t, read_gbs=bw, bound_tok_s=bw * 1e9 / per_token)
            rows.append(r)
            print(f"{name} {t} threads: {r['decode_tok_s']} tok/s", flush=True)
    for r in rows:
        ref = next(
            (x for x in rows if x["variant"].startswith("llama") and x["threads"] == r["threads"]), None
        )
        r["vs_llama_cpp"] = r["decode_tok_s"] / ref["decode_tok_s"] if ref and r["decode_tok_s"] else None
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    out = {"checkpoint": str(ckpt), "layers": layers,
           "quantized": "rtn w4 g32 sym", "bytes_per_token_mb": per_token / 2**20, "export": export,
           "prompt_ids": PROMPT_IDS, "new_tokens": a.new_tokens, "rows": rows}  # fmt: skip
    write_results(a.json, "moe_decode_llamacpp", out, _markdown(out))


def _markdown(out: dict) -> str:
    md = [
        "# Decode: Qwen3-30B-A3B-shaped model in bitmosaic vs llama.cpp on bitmosaic's GGUF export",
        "",
        f"{out['layers']} layers (hidden 2048, 128 experts of width 768, top-8, vocabulary 151936, "
        "random bf16 "
        f"weights), {out['quantized']} (llama.cpp: the same weights as Q4_0, exported exactly); "
        f"{out['new_tokens']} new tokens after a {len(out['prompt_ids'])}-token prompt, greedy, best of the "
        f"repeats; bound: {out['bytes_per_token_mb']:.0f} MB read per token / read bandwidth measured in the "
        "run. Command: `python -m benchmarks.moe.decode_vs_llamacpp --dir D` (module doc).",
        "",
        "| variant | threads | decode tok/s | vs llama.cpp | read GB/s | bound tok/s | of bound |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in out["rows"]:
        tok = r["decode_tok_s"]
        vs = f"{r['vs_llama_cpp']:.2f}x" if r.get("vs_llama_cpp") else "-"
        frac = f"{tok / r['bound_tok_s']:.0%}" if tok else "-"
        md.append(f"| {r['variant']} | {r['threads']} | {tok:.1f} | {vs} | {r['read_gbs']:.1f} | "
                  f"{r['bound_tok_s']:.1f} | {frac} |" if tok else
                  f"| {r['variant']} | {r['threads']} | failed: {r.get('error', '')} "
                  "| - | - | - | - |")  # fmt: skip
    return "\n".join(md)


if __name__ == "__main__":
    main()
