"""The per-token overhead that compiled decode cuts, without the LM head: greedy decode ms/token of a
random Llama with SmolLM2-135M's decoder shapes (30 layers, hidden 576, MLP 1536, 9 heads, 3 KV heads)
and a 128-token vocabulary (so no head cost; SmolLM2's float32 tied head is ~11 ms of a token, handled
elsewhere), RTN W4 and W2 g128 on the default kernels, eager ``generate`` against
:func:`bitmosaic.modules.decode.enable_compiled_decode` (its default skips dynamo's guards on the modules;
``+full_guards``: ``guards="full"``, dynamo's own guards).  Random weights: the tokens mean nothing, the
time per token is what is measured (64 new tokens, best of 3, one thread by default).  Each row runs in
its own process.  ``first generate s``: the compiling call (inductor's FX cache may shorten it on a rerun).

    python -m benchmarks.decode.decode_proxy [--threads 1] [--bits 4,2]
      (writes results/decode_proxy.{md,json})
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

from benchmarks import RESULTS

MODES = ("eager", "compiled", "compiled+full_guards")


def _child(bits: int, mode: str, threads: int, new_tokens: int) -> dict:
    import torch
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM

    from bitmosaic import quantize_
    from bitmosaic.modules.base import prepare_kernels
    from bitmosaic.modules.decode import enable_compiled_decode

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    m = LlamaForCausalLM(cfg).eval()
    quantize_(m, "rtn", torch.zeros((1, 8), dtype=torch.long), bits=bits, group_size=128, progress=False)
    prepare_kernels(m)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    times: list[float] = []

    class Clock:  # called once per generated token
        def __call__(self, input_ids, scores):
            times.append(time.perf_counter())
            return scores

    def gen(**kw):
        return m.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kw)

    first = None
    with torch.inference_mode():
        if mode != "eager":
            enable_compiled_decode(m, guards="full" if mode.endswith("full_guards") else "model")
        t0 = time.perf_counter()
        gen()  # warm-up; compiled: compiles the decode step for this cache length
        first = time.perf_counter() - t0
        best = float("inf")
        for _ in range(3):
            times.clear()
            gen(logits_processor=[Clock()])
            best = min(best, (times[-1] - times[0]) / (len(times) - 1))
    return {
        "bits": bits,
        "mode": mode,
        "threads": threads,
        "ms_per_token": best * 1e3,
        "first_generate_s": first if mode != "eager" else None,
        "graphs": counters["stats"]["unique_graphs"] if mode != "eager" else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bits", default="4,2")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--json", default=str(RESULTS / "decode_proxy.json"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        bits, mode = a.child.split(":")
        print("ROW " + json.dumps(_child(int(bits), mode, a.threads, a.new_tokens)))
        return
    load_before = os.getloadavg()
    rows = []
    for bits in (int(b) for b in a.bits.split(",")):
        for mode in MODES:
            from benchmarks.harness.child import child_env, module_command  # the parent only

            cmd = [*module_command("benchmarks.decode.decode_proxy"), "--child", f"{bits}:{mode}"]
            cmd += ["--threads", str(a.threads)]
            res = subprocess.run(
                [*cmd, "--new-tokens", str(a.new_tokens)], capture_output=True, text=True, env=child_env()
            )
            line = [ln for ln in res.stdout.splitlines() if ln.startswith("ROW ")]
            if res.returncode or not line:
                print(f"W{bits} {mode} failed:\n{res.stderr[-2000:]}")
                continue
            rows.append(json.loads(line[0][4:]))
            print(f"  W{bits} {mode:<22} {rows[-1]['ms_per_token']:.2f} ms/token", flush=True)
    lines = [
        "| weights | mode | threads | ms/token | vs eager | first generate s | graphs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        eager = next((e for e in rows if e["bits"] == r["bits"] and e["mode"] == "eager"), None)
        ratio = f"{eager['ms_per_token'] / r['ms_per_token']:.2f}x" if eager else "—"
        fs = "—" if r["first_generate_s"] is None else f"{r['first_generate_s']:.1f}"
        lines.append(
            f"| W{r['bits']} g128 | {r['mode']} | {r['threads']} | {r['ms_per_token']:.2f} | {ratio} | {fs} "
            f"| {r['graphs'] if r['graphs'] is not None else '—'} |"
        )
    table = "\n".join(lines)
    print("\n" + table)
    from benchmarks.harness import machine_info, write_results

    machine = machine_info(loadavg_1_5_15_before=load_before, loadavg_1_5_15_after=os.getloadavg())
    write_results(a.json, "decode_proxy", {"args": vars(a), "machine": machine, "rows": rows}, table)


if __name__ == "__main__":
    main()
