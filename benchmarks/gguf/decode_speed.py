"""Decode speed of GGUF files in llama.cpp, for ``llamacpp_peers.py --decode`` (issue 72's last column).

llama.cpp's ``llama-bench`` is not among the tools ``benchmarks/peers/llama_tools.py`` builds (building it
means a second ~10-minute CMake build of the same source); the timing runs instead in llama.cpp's Python
binding built from the same llama-cpp-python 0.3.36 source with the same CMake options
(``benchmarks/peers/peer_llama.py``), as ``benchmarks/decode/decode.py`` times llama.cpp: one child process
per file (``-t`` threads for decode and batch), a 4-token warm-up, then ``repeats`` greedy generations
of ``new_tokens`` tokens from a BOS-only prompt (``llama-bench -p 0 -n 32``: text generation from an empty
context); each repeat's rate is (tokens - 1) / (time of the last token - time of the first), the rate of
the decode steps alone.  Reported: mean and standard deviation over the repeats (as ``llama-bench``; fewer
repeats where they pass 20 s, the count recorded)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def child(path: str, threads: int, new_tokens: int, repeats: int, budget_s: float = 20.0) -> dict:
    """Time decode of the GGUF file ``path`` in this process (``llama_cpp`` importable): ``repeats``
    generations, fewer (at least one) where they pass ``budget_s`` seconds (a slow, shared machine)."""
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=256, seed=0, verbose=False)
    prompt = [llm.token_bos()]

    def run(n: int) -> list[float]:
        clock: list[float] = []
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            clock.append(time.perf_counter())
            if len(clock) == n:
                break
        return clock

    run(4)
    rates, t0 = [], time.perf_counter()
    while len(rates) < repeats and (not rates or time.perf_counter() - t0 < budget_s):
        clock = run(new_tokens)
        rates.append((len(clock) - 1) / (clock[-1] - clock[0]))
    return {"tok_s": statistics.mean(rates), "tok_s_sd": statistics.pstdev(rates), "rates": rates,
            "new_tokens": new_tokens, "repeats": len(rates), "threads": threads}  # fmt: skip


def time_files(paths: dict[str, Path], threads: int, new_tokens: int = 32, repeats: int = 5) -> dict:
    """``{key: result}`` for each file of ``paths``, each timed in a child process with the binding, and
    ``"load"``: the 1-minute load average before and after (timings beside other work are noisy)."""
    from benchmarks.peers.peer_llama import child_env, find_or_build

    folder = find_or_build(build=False)
    if folder is None:
        raise SystemExit("decode timing needs llama.cpp's binding (python -m benchmarks.peers.peer_llama)")
    env = {**(child_env(folder) or os.environ), "OMP_NUM_THREADS": str(threads)}
    out: dict = {"load_before": os.getloadavg()[0]}
    for key, path in paths.items():
        cmd = [sys.executable, "-m", "benchmarks.gguf.decode_speed", str(path), str(threads), str(new_tokens),
               str(repeats)]  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if p.returncode != 0:
            out[key] = {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
        else:
            out[key] = json.loads(p.stdout.strip().splitlines()[-1])
        out[key]["load"] = os.getloadavg()[0]
        print(f"  decode {key}: {out[key].get('tok_s', out[key].get('error'))} (load {out[key]['load']:.2f})",
              flush=True)  # fmt: skip
    out["load_after"] = os.getloadavg()[0]
    return out


if __name__ == "__main__":
    f, t, n, r = sys.argv[1:5]
    print(json.dumps(child(f, int(t), int(n), int(r))))
