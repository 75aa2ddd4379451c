"""End-to-end greedy decoding on the CPU: tokens/s and resident memory of SmolLM2-135M in float32,
W4 g128 and W3 g128 (loaded through ``load_quantized``, the low-bit kernels as the default path),
against llama.cpp running the very GGUF the model comes from (Q4_1) where ``llama_cpp`` is
installed (``pip install llama-cpp-python``; it builds llama.cpp from source), same threads, same
prompt, same number of new tokens.

Each row runs in its own process, so its resident memory is its own.  The quantized folders are
made first with RTN (the method does not change the decode speed, only the quality; perplexity is
measured elsewhere).  ``decode tok/s`` counts the new tokens after the first one (the first
includes the prompt's prefill) over their wall time; ``rss MB`` is the process's resident set after
generation, ``weights MB`` the bytes the linears hold (packed codes, scales, kernel layouts; the
float32 linears for the float row).

    python benchmarks/decode.py [--threads 1,2] [--new-tokens 64]   (writes results/decode.{md,json})
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from bitmosaic.models.serialization import atomic_write_text

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PROMPT = "The history of the city begins in the early middle ages, when"


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _linear_bytes(model) -> int:
    import torch

    from bitmosaic.modules.base import QuantModule

    total = 0
    for m in model.modules():
        if isinstance(m, QuantModule):
            k = m.kernel()
            total += sum(t.numel() * t.element_size() for t in m.storage_tensors())
            total += k.nbytes() if k is not None else 0
        elif isinstance(m, torch.nn.Linear) and m.weight.shape[0] != model.config.vocab_size:
            total += m.weight.numel() * m.weight.element_size()
    return total


def _child_torch(variant: str, folder: str, threads: int, new_tokens: int) -> dict:
    import time

    import torch

    torch.set_num_threads(threads)
    if variant == "float":
        from bitmosaic.models import load_model

        model, tok = load_model("smollm2-135m", dtype=torch.float32)
    else:
        from bitmosaic.models import load_quantized
        from bitmosaic.modules.base import prepare_kernels

        model, tok = load_quantized(folder)
        prepare_kernels(model)
    model.eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    times: list[float] = []

    class Clock:  # a logits processor is called once per generated token
        def __call__(self, input_ids, scores):
            times.append(time.perf_counter())
            return scores

    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up (kernels, caches)
        out = model.generate(
            ids,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=[Clock()],
        )
    decode = (len(times) - 1) / (times[-1] - times[0])
    return {
        "variant": variant,
        "threads": threads,
        "prompt_tokens": int(ids.shape[1]),
        "new_tokens": int(out.shape[1] - ids.shape[1]),
        "decode_tok_s": decode,
        "rss_mb": _rss_mb(),
        "weights_mb": _linear_bytes(model) / 2**20,
        "text": tok.decode(out[0, ids.shape[1] :][:24]),
    }


def _child_llama_cpp(threads: int, new_tokens: int) -> dict:
    import time

    from llama_cpp import Llama

    from bitmosaic.models.loading import _smollm2_gguf

    llm = Llama(model_path=str(_smollm2_gguf()), n_threads=threads, n_ctx=512, verbose=False)
    prompt = llm.tokenize(PROMPT.encode())
    times: list[float] = []
    llm.reset()
    out = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        times.append(time.perf_counter())
        out.append(tok)
        if len(out) == new_tokens:
            break
    decode = (len(times) - 1) / (times[-1] - times[0])
    return {
        "variant": "llama.cpp Q4_1",
        "threads": threads,
        "prompt_tokens": len(prompt),
        "new_tokens": len(out),
        "decode_tok_s": decode,
        "rss_mb": _rss_mb(),
        "weights_mb": None,
        "text": llm.detokenize(out[:24]).decode(errors="replace"),
    }


def _make_quantized(tmp: Path, bits: int) -> Path:
    import torch

    from bitmosaic import quantize_
    from bitmosaic.models import load_model, save_quantized

    out = tmp / f"w{bits}g128"
    model, tok = load_model("smollm2-135m", dtype=torch.float32)
    calib = torch.zeros((1, 8), dtype=torch.long)  # RTN needs no calibration: never run
    quantize_(model, "rtn", calib, bits=bits, group_size=128, progress=False)
    save_quantized(model, out, {"method": "rtn", "bits": bits, "group_size": 128}, tokenizer=tok)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--json", default=str(RESULTS / "decode.json"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--folder", default="", help=argparse.SUPPRESS)
    p.add_argument("--child-threads", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        if a.child == "llama.cpp":
            row = _child_llama_cpp(a.child_threads, a.new_tokens)
        else:
            row = _child_torch(a.child, a.folder, a.child_threads, a.new_tokens)
        print("ROW " + json.dumps(row))
        return

    try:
        import llama_cpp  # noqa: F401

        have_llama = True
    except ImportError:
        have_llama = False
        print("llama.cpp rows skipped: the llama_cpp package is not installed (pip install llama-cpp-python)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bitmosaic-decode-") as tmp:
        folders = {"float": "", **{f"W{b} g128": str(_make_quantized(Path(tmp), b)) for b in (4, 3)}}
        for threads in (int(t) for t in a.threads.split(",")):
            variants = list(folders) + (["llama.cpp"] if have_llama else [])
            for v in variants:
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    v,
                    "--folder",
                    folders.get(v, ""),
                    "--child-threads",
                    str(threads),
                    "--new-tokens",
                    str(a.new_tokens),
                ]
                res = subprocess.run(cmd, capture_output=True, text=True)
                line = [ln for ln in res.stdout.splitlines() if ln.startswith("ROW ")]
                if res.returncode or not line:
                    print(f"{v} ({threads} threads) failed:\n{res.stderr[-2000:]}")
                    continue
                row = json.loads(line[0][4:])
                rows.append(row)
                print(
                    f"  {row['variant']:<16} threads {threads}  {row['decode_tok_s']:7.1f} tok/s  "
                    f"rss {row['rss_mb']:7.1f} MB",
                    flush=True,
                )
    for r in rows:
        base = next((b for b in rows if b["variant"] == "float" and b["threads"] == r["threads"]), None)
        r["speed_vs_float"] = r["decode_tok_s"] / base["decode_tok_s"] if base else None
    lines = [
        "| variant | threads | decode tok/s | vs float | RSS MB | linear weights MB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        wmb = f"{r['weights_mb']:.1f}" if r["weights_mb"] is not None else "—"
        lines.append(
            f"| {r['variant']} | {r['threads']} | {r['decode_tok_s']:.1f} | {r['speed_vs_float']:.2f}x | "
            f"{r['rss_mb']:.0f} | {wmb} |"
        )
    table = "\n".join(lines)
    print("\n" + table)
    out = {
        "benchmark": "decode",
        "args": vars(a),
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
        },
        "llama_cpp": have_llama,
        "rows": rows,
    }
    atomic_write_text(Path(a.json), json.dumps(out, indent=2))
    atomic_write_text(Path(a.json).with_suffix(".md"), table + "\n")
    print(f"\nJSON written to {a.json}")


if __name__ == "__main__":
    main()
