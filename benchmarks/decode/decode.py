"""End-to-end greedy decoding on the CPU: tokens/s and resident memory of SmolLM2-135M in float32,
W4, W3 and W2 g128 (loaded through ``load_quantized``, the low-bit kernels as the default path: the
bit-plane LUT at 1-3 bits; the ``(FMA)`` rows run the same W3/W2 folders on ``LowBitWeight``, the
``(LUT)`` row the W4 folder on the LUT (``$BITMOSAIC_KERNEL=lut``: which kernel is faster at 4 bits); the
``+A8`` rows the same W4/W2 folders with run-time INT8 activations on the integer kernel,
``$BITMOSAIC_RUNTIME_ACT=int8``, as llama.cpp quantizes its activations (``+Q8A``: one scale per block of
32 channels, ``q8_0``, as llama.cpp's blocks; ``+A16``: 16 bits per token as two int8 halves,
``int16``, the load default on a VNNI CPU; ``+WO``: weight-only, float activations,
``$BITMOSAIC_RUNTIME_ACT=none``); the ``+H8`` rows the output
head as an 8-bit copy, ``--runtime-head int8``, as llama.cpp's file holds it in ``Q8_0``; ``+Q8H`` its
inputs too in int8 blocks, ``--runtime-head q8_0``, as llama.cpp computes it; the ``(compiled)`` rows
those models with :func:`bitmosaic.modules.decode.enable_compiled_decode`: a static KV cache and a
``torch.compile``-d decode step inside plain ``generate``; the ``(load)`` rows the folder as a user
loads it, ``bitmosaic.load(dir)``, whose default decode is that compiled step: issue 74's target),
against llama.cpp running the very GGUF the model comes from (Q4_1) where ``llama_cpp`` is
installed (``pip install llama-cpp-python``, or the ``peers`` extra), same threads, same prompt token
ids, same number of new tokens.  Where ``llama_cpp`` is absent the run builds it once (llama.cpp from
source, 3-7 minutes on 2 cores) into a cache folder of its own and runs the llama.cpp rows from
there (``benchmarks/peers/peer_llama.py``: on a CPU with AMX without it, since llama.cpp's AMX matmul crashed
on an Intel Xeon VM with llama-cpp-python 0.3.36, SIGSEGV in ``ggml_backend_amx_mul_mat``);
``--no-build-peer`` skips those rows instead.

Each row runs in its own process, so its resident memory is its own.  The quantized folders are
made first with RTN (the method does not change the decode speed, only the quality; perplexity is
measured elsewhere).  ``decode tok/s`` counts the new tokens after the first one (the first
includes the prompt's prefill) over their wall time.  ``RSS MB`` is the process's resident set after
generation and ``+model MB`` its growth from just before the model was loaded (after the imports:
torch for bitmosaic, the llama_cpp bindings for llama.cpp).  ``linears resident MB`` is what the
linear layers hold in memory (parameters and buffers with storage plus kernel weights; released
saved buffers hold none, see ``modules/base.py``), ``linears stored MB`` what their saved tensors
take (the float32 linears for the float row; the GGUF file for llama.cpp, embeddings included);
``linears ms/token`` the time one token spends in the decoder's linears alone (each called eagerly on one
random row, the head excluded, best of 20 passes): the W2-vs-W4 comparison of issue 24 without the rest
of the step.
``first generate s`` (compiled rows) is the wall time of the first ``generate`` of the full length, which
compiles the decode graph (it is not in ``decode tok/s``); ``graphs`` counts the graphs dynamo compiled in
the row's process over every generate (1: no recompilation per token or per run).

    python -m benchmarks.decode.decode [--threads 1,2] [--new-tokens 64] [--only "W4 g128,W4 g128 (compiled)"]
    (writes results/decode.{md,json}; --only runs the named variants, llama.cpp Q4_1 included, and
    the opt-in "(compiled+cpp_wrapper)" / "(compiled+freezing)" of any compiled row: inductor options)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from benchmarks import RESULTS

PROMPT = "The history of the city begins in the early middle ages, when"


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _linear_bytes(model, folder: str) -> tuple[int, int]:
    """(resident, stored) bytes of the linear layers (the tied head excluded)."""
    import torch

    from bitmosaic.io.saved.load import stored_module_bits
    from bitmosaic.io.saved.save import quantized_modules
    from bitmosaic.modules.base import resident_bytes

    qmods = quantized_modules(model)
    resident = sum(resident_bytes(m) for m in qmods.values())
    stored = sum(stored_module_bits(folder, list(qmods)).values()) // 8 if qmods else 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m.weight.shape[0] != model.config.vocab_size:
            resident += m.weight.numel() * m.weight.element_size()
            stored += m.weight.numel() * m.weight.element_size()
    return resident, stored


# opt-in variants (run only when --only names them): a compiled row with an inductor option (the module
# guards are skipped by default now: modules/decode.py guards="model")
_INDUCTOR_OPTIONS = {
    "+cpp_wrapper": {"cpp_wrapper": True},
    # the C++ entry at -O1 apart from the kernels at -O3 (a shorter first compile)
    "+cpp_wrapper_sep": {"cpp_wrapper": True, "cpp_wrapper_build_separate": True},
    "+freezing": {"freezing": True},
}


def _linears_ms(model, reps: int = 20) -> float:
    """Milliseconds one decode token spends in the decoder's linears alone: each linear (the head
    excluded) called on one random row, in model order, best of ``reps`` passes (eager module calls)."""
    import time

    import torch

    from bitmosaic.modules.base import QuantModule

    vocab = model.config.vocab_size
    mods = [
        m
        for m in model.modules()
        if isinstance(m, QuantModule) or (isinstance(m, torch.nn.Linear) and m.out_features != vocab)
    ]
    xs = [torch.randn(1, 1, m.in_features) for m in mods]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            t = time.perf_counter()
            for m, x in zip(mods, xs, strict=True):
                m(x)
            best = min(best, time.perf_counter() - t)
    return best * 1e3


def _child_torch(variant: str, folder: str, threads: int, new_tokens: int, repeats: int) -> dict:
    import time

    import torch

    from bitmosaic.io import load_model, load_quantized
    from bitmosaic.modules.base import prepare_kernels

    torch.set_num_threads(threads)
    flags = variant.split()
    if "(FMA)" in flags or "(LUT)" in flags:  # the same folder on LowBitWeight / on the bit-plane LUT
        from bitmosaic.kernels.select import KERNEL_ENV

        os.environ[KERNEL_ENV] = "lowbit" if "(FMA)" in flags else "lut"
    # run-time 8-bit activations on the integer kernel (--runtime-act); +A16: 16-bit ones, two int8 halves
    # +WO: weight-only (float activations), the load default before 16-bit ones (modules/intact.py)
    acts = {"+A8": "int8", "+Q8A": "q8_0", "+A16": "int16", "+WO": "none"}
    for flag in set(flags) & set(acts):
        from bitmosaic.modules.intact import RUNTIME_ACT_ENV

        os.environ[RUNTIME_ACT_ENV] = acts[flag]
    rss_base = _rss_mb()  # after the imports: the growth from here is the model's
    plain = "(load)" in flags  # what a user runs: bitmosaic.load(dir), its default (compiled) decode
    if plain:
        from transformers import AutoTokenizer

        import bitmosaic

        model, tok = bitmosaic.load(folder), AutoTokenizer.from_pretrained(folder)
    elif variant.startswith("float"):
        model, tok = load_model("smollm2-135m", dtype=torch.float32)
    else:
        model, tok = load_quantized(folder)
        prepare_kernels(model)
    heads = {"+H8": "int8", "+Q8H": "q8_0"}  # the 8-bit output heads (--runtime-head; llama.cpp's Q8_0)
    for flag in set(flags) & set(heads):
        from bitmosaic.modules.head import set_runtime_head

        set_runtime_head(model, heads[flag])
    model.eval()
    # a (load) row compiles when bitmosaic.load installed its step ($BITMOSAIC_NO_COMPILE: eager)
    compiled = "(compiled" in variant or (plain and hasattr(model, "_compiled_call"))
    if "(compiled" in variant:  # a static cache and the compiled decode step in plain generate
        from bitmosaic.modules.decode import enable_compiled_decode

        option = variant.split("(compiled")[1].rstrip(")")  # "" or an _INDUCTOR_OPTIONS key
        opts = dict(_INDUCTOR_OPTIONS.get(option, {}))
        enable_compiled_decode(model, options=opts or None)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    # every row generates exactly new_tokens with no end-of-text check, as llama.cpp's loop below (its
    # generate yields tokens until told to stop); min_new_tokens would instead add a logits processor that
    # scans the 49152-token vocabulary at every step (~0.4-1.5 ms a token measured)
    model.generation_config.eos_token_id = None
    times: list[float] = []

    class Clock:  # a logits processor is called once per generated token
        def __call__(self, input_ids, scores):
            times.append(time.perf_counter())
            return scores

    from torch._dynamo.utils import counters

    with torch.inference_mode():
        t0 = time.perf_counter()
        # warm-up (kernels, caches); compiled: the full length, so that its static cache (and graph) is the
        # one the timed runs use
        n = new_tokens if compiled else 4
        model.generate(ids, max_new_tokens=n, do_sample=False)
        first_s = time.perf_counter() - t0
        rates = []
        for _ in range(repeats):
            times.clear()
            out = model.generate(
                ids,
                max_new_tokens=new_tokens,
                do_sample=False,
                logits_processor=[Clock()],
            )
            rates.append((len(times) - 1) / (times[-1] - times[0]))
    decode = max(rates)
    rss = _rss_mb()  # before anything below could rebuild a released buffer
    resident, stored = _linear_bytes(model, folder)
    linears_ms = _linears_ms(model)
    return {
        "variant": variant,
        "threads": threads,
        "prompt_ids": ids[0].tolist(),
        "new_tokens": int(out.shape[1] - ids.shape[1]),
        "decode_tok_s": decode,
        "first_generate_s": first_s if compiled else None,
        "graphs": counters["stats"]["unique_graphs"] if compiled else None,
        "graph_breaks": sum(counters["graph_break"].values()) if compiled else None,
        "compiled": compiled and not getattr(getattr(model, "_compiled_call", None), "eager", False),
        "rss_mb": rss,
        "model_rss_mb": rss - rss_base,
        "linears_resident_mb": resident / 2**20,
        "linears_stored_mb": stored / 2**20,
        "linears_ms_per_token": linears_ms,
        "text": tok.decode(out[0, ids.shape[1] :][:24]),
    }


def _child_llama_cpp(gguf: str, prompt_ids: list[int], threads: int, new_tokens: int, repeats: int) -> dict:
    import time

    from llama_cpp import Llama

    rss_base = _rss_mb()
    llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=512, seed=0, verbose=False)

    def run(n: int, clock: list[float]) -> list[int]:
        toks: list[int] = []
        for t in llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
            clock.append(time.perf_counter())
            toks.append(t)
            if len(toks) == n:
                return toks
        return toks

    run(4, [])  # warm-up, as for the torch rows
    rates = []
    for _ in range(repeats):
        times: list[float] = []
        out = run(new_tokens, times)
        rates.append((len(times) - 1) / (times[-1] - times[0]))
    decode = max(rates)
    return {
        "variant": "llama.cpp Q4_1",
        "threads": threads,
        "prompt_ids": list(prompt_ids),
        "new_tokens": len(out),
        "decode_tok_s": decode,
        "rss_mb": _rss_mb(),
        "model_rss_mb": _rss_mb() - rss_base,
        "first_generate_s": None,
        "graphs": None,
        "graph_breaks": None,
        "linears_resident_mb": None,
        "linears_stored_mb": Path(gguf).stat().st_size / 2**20,
        "linears_ms_per_token": None,
        "text": llm.detokenize(out[:24]).decode(errors="replace"),
    }


def _make_quantized(tmp: Path, bits: int) -> Path:
    import torch

    from bitmosaic import quantize_
    from bitmosaic.io import load_model, save_quantized

    out = tmp / f"w{bits}g128"
    model, tok = load_model("smollm2-135m", dtype=torch.float32)
    calib = torch.zeros((1, 8), dtype=torch.long)  # RTN needs no calibration: never run
    quantize_(model, "rtn", calib, bits=bits, group_size=128, progress=False)
    # the run's own folder: a work folder kept from an earlier run (targets.py --work) is rewritten
    info = {"method": "rtn", "bits": bits, "group_size": 128}
    save_quantized(model, out, info, tokenizer=tok, overwrite=True)
    return out


def _run_child(args: list[str], env: dict[str, str] | None = None) -> dict | None:
    from benchmarks.harness.child import child_env, module_command  # the parent only

    cmd = module_command("benchmarks.decode.decode")
    res = subprocess.run([*cmd, *args], capture_output=True, text=True, env=child_env(env))
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("ROW ")]
    if res.returncode or not line:
        print(f"{args[1]} failed:\n{res.stderr[-2000:]}")
        return None
    return json.loads(line[0][4:])


def _table(rows: list[dict]) -> str:
    lines = [
        "| variant | threads | decode tok/s | ms/token | vs float | vs llama.cpp | first generate s | graphs "
        "| RSS MB | +model MB | linears resident MB | linears stored MB | linears ms/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, spec):
        return "—" if v is None else format(v, spec)

    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['threads']} | {r['decode_tok_s']:.1f} | {1000 / r['decode_tok_s']:.1f} "
            f"| {f(r['speed_vs_float'], '.2f')}x | {f(r['speed_vs_llama_cpp'], '.2f')}x "
            f"| {f(r.get('first_generate_s'), '.1f')} | {f(r.get('graphs'), 'd')} "
            f"| {r['rss_mb']:.0f} | {r['model_rss_mb']:.0f} "
            f"| {f(r['linears_resident_mb'], '.1f')} | {f(r['linears_stored_mb'], '.1f')} "
            f"| {f(r.get('linears_ms_per_token'), '.2f')} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed generations per row; the best is kept")
    p.add_argument("--json", default=str(RESULTS / "decode.json"))
    p.add_argument("--only", default=None, help="comma list of variants to run (default: every one)")
    p.add_argument("--no-build-peer", action="store_true",
                   help="where llama_cpp is not installed, skip the llama.cpp rows instead of building it "
                   "once into a cache folder (benchmarks/peers/peer_llama.py)")  # fmt: skip
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--folder", default="", help=argparse.SUPPRESS)
    p.add_argument("--prompt-ids", default="[]", help=argparse.SUPPRESS)
    p.add_argument("--child-threads", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        if a.child == "llama.cpp":
            ids = json.loads(a.prompt_ids)
            row = _child_llama_cpp(a.folder, ids, a.child_threads, a.new_tokens, a.repeats)
        else:
            row = _child_torch(a.child, a.folder, a.child_threads, a.new_tokens, a.repeats)
        print("ROW " + json.dumps(row))
        return

    from benchmarks.peers.peer_llama import child_env, find_or_build  # the parent only

    wants_llama = a.only is None or "llama.cpp Q4_1" in a.only.split(",")
    peer_path = find_or_build(build=not a.no_build_peer) if wants_llama else None
    have_llama = peer_path is not None
    from bitmosaic.io.sources.loading import _smollm2_gguf

    gguf = str(_smollm2_gguf())
    load_before = os.getloadavg()
    rows = []
    only = set(a.only.split(",")) if a.only else None
    with tempfile.TemporaryDirectory(prefix="bitmosaic-decode-") as tmp:
        folders = {"float": "", **{f"W{b} g128": str(b) for b in (4, 3, 2)}}
        for b in (3, 2):  # 1-3 bits decode on the LUT by default: the same folders on LowBitWeight
            folders[f"W{b} g128 (FMA)"] = folders[f"W{b} g128"]
        for b in (4, 2):  # the same folders with run-time INT8 activations (what llama.cpp does)
            folders[f"W{b} g128 +A8"] = folders[f"W{b} g128"]
            folders[f"W{b} g128 +Q8A"] = folders[f"W{b} g128"]
            folders[f"W{b} g128 +A16"] = folders[f"W{b} g128"]
        # an 8-bit output head (llama.cpp's file holds its head as Q8_0): +H8 weight-only, +Q8H with int8
        # inputs per block of 32 too (--runtime-head int8 / q8_0)
        for v in ("float", "W4 g128", "W2 g128"):
            folders[f"{v} +H8"] = folders[v]
        for v in ("W4 g128", "W2 g128", "W4 g128 +A8", "W4 g128 +Q8A"):
            folders[f"{v} +Q8H"] = folders[v]
        compiled = ("float", "W4 g128", "W2 g128", "W4 g128 +Q8H", "W2 g128 +Q8H", "W4 g128 +A8 +Q8H",
                    "W4 g128 +Q8A +Q8H", "W4 g128 +A16")  # fmt: skip
        for v in compiled:
            folders[f"{v} (compiled)"] = folders[v]  # static cache + torch.compile (modules/decode.py)
        folders["W4 g128 +WO"], folders["W2 g128 +WO"] = folders["W4 g128"], folders["W2 g128"]
        # plain bitmosaic.load(dir).generate: the default
        for v in ("W4 g128", "W2 g128", "W4 g128 +A16", "W4 g128 +WO", "W2 g128 +WO"):
            folders[f"{v} (load)"] = folders[v]
        folders["W4 g128 (LUT) (load)"] = folders["W4 g128"]  # 4 bits on the bit-plane LUT instead
        if only is not None:  # opt-in: any compiled row with an inductor option, "(compiled+cpp_wrapper)"
            folders.update({f"{v} (compiled{k})": folders[v] for v in compiled for k in _INDUCTOR_OPTIONS})
            unknown = sorted(only - set(folders) - {"llama.cpp Q4_1"})
            if unknown:
                p.error(f"--only names no variant: {', '.join(unknown)} (variants: {', '.join(folders)})")
            folders = {v: f for v, f in folders.items() if v in only}
            have_llama = have_llama and "llama.cpp Q4_1" in only
        made = {b: str(_make_quantized(Path(tmp), int(b))) for b in sorted(set(folders.values()) - {""})}
        folders = {v: made.get(f, f) for v, f in folders.items()}
        for threads in (int(t) for t in a.threads.split(",")):
            common = ["--child-threads", str(threads), "--new-tokens", str(a.new_tokens)]
            common += ["--repeats", str(a.repeats)]
            prompt_ids = None
            for v, folder in folders.items():
                row = _run_child(["--child", v, "--folder", folder, *common])
                if row is not None:
                    rows.append(row)
                    prompt_ids = prompt_ids or row["prompt_ids"]
                    print(f"  {v:<16} threads {threads}  {row['decode_tok_s']:7.1f} tok/s", flush=True)
            if have_llama and prompt_ids:  # (with --only: when it names "llama.cpp Q4_1")
                ids = json.dumps(prompt_ids)
                row = _run_child(
                    ["--child", "llama.cpp", "--folder", gguf, "--prompt-ids", ids, *common],
                    env=child_env(peer_path),
                )
                if row is not None:
                    rows.append(row)
                    print(f"  llama.cpp Q4_1   threads {threads}  {row['decode_tok_s']:7.1f} tok/s")
    for r in rows:
        same = [b for b in rows if b["threads"] == r["threads"]]
        base = next((b for b in same if b["variant"] == "float"), None)  # the eager float row
        peer = next((b for b in same if b["variant"].startswith("llama.cpp")), None)
        r["speed_vs_float"] = r["decode_tok_s"] / base["decode_tok_s"] if base else None
        r["speed_vs_llama_cpp"] = r["decode_tok_s"] / peer["decode_tok_s"] if peer else None
    table = _table(rows)
    print("\n" + table)
    from benchmarks.harness import machine_info, write_results  # the parent only (children run the variants)

    machine = machine_info(loadavg_1_5_15_before=load_before, loadavg_1_5_15_after=os.getloadavg())
    out = {"args": vars(a), "machine": machine, "llama_cpp": have_llama, "gguf": Path(gguf).name}
    out["rows"] = rows
    write_results(a.json, "decode", out, table)


if __name__ == "__main__":
    main()
