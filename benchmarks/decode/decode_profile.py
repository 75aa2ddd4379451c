"""Where a compiled SmolLM2 decode step spends its time (issue 24: the profile behind the decode target).

Builds the RTN W4 g128 SmolLM2 model of ``decode.py`` (the same folder code), loads it as ``decode.py``'s
``"W4 g128 +Q8H (compiled)"`` row does (``q8_0`` head; ``--act q8_0`` adds the run-time ``q8_0``
activations of ``+Q8A``), compiles the decode step, warms it up on the full length, then records one
``generate`` of ``--new-tokens`` tokens under ``torch.profiler`` and sums self CPU time by kind:

* ``linears``: the quantized linears' operators (``bitmosaic::qmatmul``, ``lut_matmul``, ``int_linear``);
* ``head``: the 8-bit output head (``bitmosaic::`` operators of ``modules/head.py``, the head's GEMV);
* ``attention``: ``scaled_dot_product_attention`` and its parts;
* ``graph``: everything else inside the compiled graph (norms, rotary, adds, copies: inductor's kernels);
* ``outside``: what the profiler saw outside any operator (``generate``'s Python, the guard checks).

Per token, in ms, with the decode rate of the same run.  One process per thread count:
``python -m benchmarks.decode.decode_profile --threads 1,2`` (``--act q8_0`` for the +Q8A row).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.harness import RESULTS, machine_info, write_text
from benchmarks.harness.child import child_env, module_command

KINDS = ("linears", "head", "attention", "graph", "outside")


HEAD_BYTES = 10_000_000  # an operator reading a weight this large is the output head (49152 x 576 at 8 bits)


def _kind(name: str, shapes) -> str:
    n = name.lower()
    if any(k in n for k in ("qmatmul", "lut_matmul", "int_linear", "int_matmul")):
        sizes = [s for s in (shapes or []) if isinstance(s, (list, tuple)) and s]
        big = max((eval_numel(s) for s in sizes), default=0)
        return "head" if big >= HEAD_BYTES else "linears"
        return "linears"
    if "attention" in n or "sdpa" in n or "flash" in n:
        return "attention"
    return "graph"


def eval_numel(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def _child(folder: str, threads: int, new_tokens: int, act: str | None) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bitmosaic.io import load_quantized
    from bitmosaic.modules.base import prepare_kernels
    from bitmosaic.modules.decode import enable_compiled_decode
    from bitmosaic.modules.head import set_runtime_head

    torch.set_num_threads(threads)
    if act:
        from bitmosaic.modules.intact import RUNTIME_ACT_ENV

        os.environ[RUNTIME_ACT_ENV] = act
    model, tok = load_quantized(folder)
    prepare_kernels(model)
    set_runtime_head(model, "q8_0")
    model.eval()
    enable_compiled_decode(model)
    ids = tok("The history of the city begins", return_tensors="pt").input_ids
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=new_tokens, do_sample=False)  # compile + warm up, full length
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        plain_s = time.perf_counter() - t
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
            wall = time.perf_counter() - t
    ms = dict.fromkeys(KINDS, 0.0)
    calls: dict[str, int] = dict.fromkeys(KINDS, 0)
    top = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key.startswith("ProfilerStep") or e.key.startswith("## "):
            continue
        k = _kind(e.key, e.input_shapes)
        ms[k] += e.self_cpu_time_total / 1e3
        calls[k] += e.count
        top.append((e.self_cpu_time_total / 1e3, e.count, f"{e.key} ({k})"))
    ms["outside"] = max(0.0, wall * 1e3 - sum(ms.values()))  # operators' self time is the calling thread's
    top.sort(reverse=True)
    per = {k: v / new_tokens for k, v in ms.items()}
    return {
        "threads": threads,
        "act": act or "float",
        "new_tokens": new_tokens,
        "tok_s_unprofiled": new_tokens / plain_s,
        "ms_per_token_profiled": wall * 1e3 / new_tokens,
        "ms_per_token": per,
        "calls_per_token": {k: v / new_tokens for k, v in calls.items()},
        "top": [
            {"ms_per_token": t / new_tokens, "calls_per_token": c / new_tokens, "op": n}
            for t, c, n in top[:12]
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--act", default=None, choices=["q8_0", "int8", "int16"], help="run-time integer activations"
    )
    p.add_argument("--json", default=None)
    p.add_argument("--child", nargs=3, metavar=("FOLDER", "THREADS", "NEW_TOKENS"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(_child(a.child[0], int(a.child[1]), int(a.child[2]), a.act)))
        return
    from benchmarks.decode.decode import _make_quantized

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = _make_quantized(Path(tmp), 4)
        for th in (int(t) for t in a.threads.split(",")):
            args = [*module_command("benchmarks.decode.decode_profile"), "--child", str(folder), str(th)]
            args += [str(a.new_tokens)]
            args += ["--act", a.act] if a.act else []
            r = subprocess.run(args, capture_output=True, text=True, env=child_env())
            if r.returncode:
                raise SystemExit(f"profile child failed: {r.stderr.strip().splitlines()[-1:]}")
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]["ms_per_token"]), flush=True)
    name = "decode_profile" + (f"_{a.act}" if a.act else "")
    out = Path(a.json) if a.json else RESULTS / f"{name}.json"
    head = "| threads | activations | tok/s (unprofiled) | ms/token (profiled) | " + " | ".join(KINDS) + " |"
    lines = [head, "|" + "---|" * (4 + len(KINDS))]
    for r in rows:
        cells = [f"{r['ms_per_token'][k]:.2f}" for k in KINDS]
        rate, wall = f"{r['tok_s_unprofiled']:.1f}", f"{r['ms_per_token_profiled']:.2f}"
        lines.append(f"| {r['threads']} | {r['act']} | {rate} | {wall} | " + " | ".join(cells) + " |")
    md = (
        "Compiled SmolLM2 decode step, RTN W4 g128 + `q8_0` head "
        "(`python -m benchmarks.decode.decode_profile`), "
        "self CPU time per token by kind on the calling thread (torch.profiler; an operator's intra-op "
        "threads run inside its time; `outside` = the step's wall time not inside any recorded operator).\n\n"
        + "\n".join(lines)
        + "\n"
    )
    for r in rows:
        md += f"\nTop operators, {r['threads']} thread(s) (ms per token, calls per token):\n\n"
        md += "\n".join(
            f"- {t['ms_per_token']:.3f} ms, {t['calls_per_token']:.0f}x: `{t['op']}`" for t in r["top"]
        )
        md += "\n"
    write_text(out, json.dumps({"machine": machine_info(), "rows": rows}, indent=2))
    write_text(out.with_suffix(".md"), md)
    print(md)


if __name__ == "__main__":
    main()
