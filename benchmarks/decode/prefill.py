"""Whole-model prefill on the CPU: the wall time of one forward over a ``--tokens``-token prompt (the
first tokens of WikiText-2 raw test; the output head on the last position only, as ``generate``'s prefill)
of SmolLM2-135M in float32 against the same model quantized with
SmoothQuant W4A8 (``quantize_(model, "smoothquant", calib, scheme="W4A8")``: per-token dynamic INT8
activations on the integer kernel, ``kernels/intmm.py``), at each ``--threads`` count, in one process.

Beside the times, the physical bound of the quantized prefill: the decoder linears' multiply-adds
(``2 x tokens x out x in`` summed over them) at this machine's int8 GEMM rate (``torch._int_mm`` on
2048^3, :func:`benchmarks.harness.machine_bounds`, measured in the run); attention, norms and the float
output head are outside it.  Issue 74's target: the W4A8 prefill at most 0.5x the float model's time.

``--profile``: also one forward of each model under ``torch.profiler`` per thread count, its self CPU
time summed by kind (:func:`op_kind`: ``linears`` -- torch's GEMMs and the kernels' operators;
``attention``; ``norms+elementwise``; ``other``) and ``outside`` -- the forward's wall time less every
operator's self time: eagerly the integer kernels (the activations' quantization inside them) are
called through pybind, not as operators, so their time and Python's are there: what stops the W4A8
prefill at its ratio, and what would move it.

    python -m benchmarks.decode.prefill [--threads 1,2] [--tokens 512] [--nsamples 16] [--profile]
      (writes benchmarks/results/prefill.{json,md}; benchmarks/targets.py runs it for its prefill_model row)
"""

from __future__ import annotations

import argparse
import copy

import torch

from benchmarks.harness import act_paths, machine_bounds, machine_info, median_ms, write_results


def linear_macs(model) -> int:
    """Multiply-adds per token of the float model's decoder linears (the output head excluded)."""
    vocab = model.config.vocab_size
    mods = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features != vocab]
    return sum(m.out_features * m.in_features for m in mods)


KINDS = ("linears", "attention", "norms+elementwise", "other", "outside")
_ELEMENTWISE = ("mul", "add", "rsqrt", "pow", "mean", "silu", "neg", "cat", "div", "copy", "to", "clone",
                "contiguous", "slice", "index", "embedding", "cos", "sin", "view", "reshape", "transpose",
                "empty", "expand", "unsqueeze", "unsafe_view")  # fmt: skip


def op_kind(name: str) -> str:
    """The kind an operator's self CPU time counts for in ``--profile`` (module doc; ``outside`` is
    what no operator holds)."""
    n = name.lower().removeprefix("aten::").removeprefix("bitmosaic::")
    if n in ("mm", "addmm") or any(k in n for k in ("qmatmul", "int_matmul", "lut_matmul", "quantize")):
        return "linears"
    if "attention" in n or "sdpa" in n or "flash" in n or n in ("bmm", "softmax", "_softmax", "baddbmm"):
        return "attention"
    if any(n == k or n.startswith(k + "_") or n.startswith("_" + k) for k in _ELEMENTWISE):
        return "norms+elementwise"
    return "other"


def profile_ms(fn) -> tuple[dict, list]:
    """One call of ``fn`` under ``torch.profiler``: self CPU ms by :func:`op_kind` and ``outside`` (its
    wall time less them), and the ten operators of the most self time."""
    import time

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        fn()
        wall = (time.perf_counter() - t) * 1e3
    by = dict.fromkeys(KINDS, 0.0)
    ops = []
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / 1e3
        by[op_kind(e.key)] += ms
        ops.append((e.key, round(ms, 2), e.count))
    by["outside"] = max(0.0, wall - sum(by.values()))
    ops.sort(key=lambda o: -o[1])
    return {k: round(v, 2) for k, v in by.items()}, ops[:10]


def measure(
    threads: list[int], tokens: int, nsamples: int, seqlen: int, budget_s: float = 2.0, profiled: bool = False
) -> dict:
    """Times of the float and the SmoothQuant W4A8 forward over ``tokens`` tokens, per thread count."""
    from bitmosaic import quantize_
    from bitmosaic.data import calibration_samples, eval_tokens
    from bitmosaic.io import load_model

    model, tok = load_model("smollm2-135m", dtype=torch.float32)
    model.eval()
    calib = calibration_samples(tok, "wikitext2", nsamples, seqlen, 0)
    ids = eval_tokens(tok, "wikitext2").reshape(-1)[:tokens].unsqueeze(0)  # [1, tokens]
    quant = copy.deepcopy(model)
    quantize_(quant, "smoothquant", calib, scheme="W4A8", progress=False, measure_errors=False)
    quant.eval()
    macs = linear_macs(model)
    rows = []
    for t in threads:
        rate, bw = machine_bounds(t)  # sets the threads too
        with torch.inference_mode():
            # the logits of the last position only, as generate's prefill computes them
            f = median_ms(lambda: model(ids, logits_to_keep=1), budget_s, 10)
            q = median_ms(lambda: quant(ids, logits_to_keep=1), budget_s, 10)
            prof = {}
            if profiled:
                for name, m in (("float", model), ("w4a8", quant)):
                    prof[name], prof[name + "_top_ops"] = profile_ms(lambda m=m: m(ids, logits_to_keep=1))
                    print(f"  {name} profile (self CPU ms): {prof[name]}", flush=True)
        bound = 2 * tokens * macs / (rate * 1e9) * 1e3
        rows.append({"threads": t, "tokens": tokens, "float_ms": f, "w4a8_ms": q, "ratio": q / f,
                     "int8_gops": rate, "read_gbs": bw, "int8_bound_ms": bound, **prof})  # fmt: skip
        print(f"{t} thread(s): float {f:.1f} ms, SmoothQuant W4A8 {q:.1f} ms ({q / f:.2f}x), "
              f"int8 bound of the linears {bound:.1f} ms", flush=True)  # fmt: skip
    return {"rows": rows, "act_compute": act_paths(quant), "linear_macs_per_token": macs,
            "calibration": f"{nsamples}x{seqlen}"}  # fmt: skip


def markdown(out: dict, command: str) -> str:
    md = ["# Whole-model prefill: SmolLM2-135M float32 vs SmoothQuant W4A8", "",
          f"`{command}`; calibration {out['calibration']}; the W4A8 layers compute on {out['act_compute']}.",
          "", "| threads | tokens | float ms | SmoothQuant W4A8 ms | W4A8 / float | int8 bound, linears ms |",
          "|---|---|---|---|---|---|"]  # fmt: skip
    for r in out["rows"]:
        md.append(f"| {r['threads']} | {r['tokens']} | {r['float_ms']:.1f} | {r['w4a8_ms']:.1f} | "
                  f"{r['ratio']:.2f}x | {r['int8_bound_ms']:.1f} |")  # fmt: skip
    if "float" in out["rows"][0]:
        md += ["", "Profile, one forward each (`--profile`, self CPU ms by kind; the profiler's own cost is "
               "inside; `outside`: no operator's, e.g. the integer kernels called eagerly through "
               "pybind):", "",
               "| threads | model | " + " | ".join(KINDS) + " | total |",
               "|---|---|" + "---|" * (len(KINDS) + 1)]  # fmt: skip
        for r in out["rows"]:
            for name in ("float", "w4a8"):
                p = r[name]
                md.append(f"| {r['threads']} | {name} | " + " | ".join(f"{p[k]:.1f}" for k in KINDS)
                          + f" | {sum(p.values()):.1f} |")  # fmt: skip
    return "\n".join(md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--nsamples", type=int, default=16, help="SmoothQuant calibration samples")
    p.add_argument("--seqlen", type=int, default=512, help="tokens per calibration sample")
    p.add_argument("--budget", type=float, default=2.0, help="seconds of timed forwards per median")
    p.add_argument("--profile", action="store_true", help="also profile one forward of each model by kind")
    p.add_argument("--json", default=None, help="default benchmarks/results/prefill.json")
    a = p.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    out = measure(threads, a.tokens, a.nsamples, a.seqlen, a.budget, a.profile)
    cmd = (f"python -m benchmarks.decode.prefill --threads {a.threads} --tokens {a.tokens} "
           f"--nsamples {a.nsamples} --seqlen {a.seqlen}" + (" --profile" if a.profile else ""))  # fmt: skip
    write_results(a.json, "prefill", {"args": vars(a), **out, "machine": machine_info()}, markdown(out, cmd))


if __name__ == "__main__":
    main()
