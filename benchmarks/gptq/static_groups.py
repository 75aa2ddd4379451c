"""Act-order GPTQ with static groups against dynamic groups (and, with ``--kinds ...,awq``, against AWQ at
the same bits and group), on SmolLM2-135M or Gemma-3-270m at 4, 3 and 2 bits: the evidence behind two
defaults, static groups at 4 bits and GPTQ over AWQ at W4 g128 (issue 73: checked on both models).

- *static* (llm-compressor's ``actorder: weight``): columns solved in activation order, every
  group's scale and zero fixed from the original weights of its contiguous columns; no ``g_idx``,
  so compressed-tensors (>= 0.19) and every GPTQ loader hold the result exactly.
- *dynamic* (bitmosaic's default before this benchmark): a group is the next ``g`` columns in
  processing order, its scale fitted on the error-updated weights when it is reached; the result
  needs a permuted ``g_idx`` (GPTQ only; compressed-tensors refuses it).

Both: ``--method gptq`` defaults otherwise (asymmetric, MSE scale search, act-order), group 128.
- *awq* (``--kinds dynamic,static,awq``): ``--method awq`` at the same bits and group (its defaults
  otherwise), compared with *static* (GPTQ's default at 4 bits) by the same paired bootstrap.

Every quantized model is evaluated weight-only (float activations): the 16-bit run-time activations a
load gives by default on AVX-512 VNNI CPUs are taken off, so rows from any CPU compare; so is the INT8
run-time head a load gives a head whose weights are their own Q8_0 copy (the same weights: the logits
agree up to float32 rounding; on 512-token windows the decode-oriented INT8 kernel took 48% of the
evaluation's time on Gemma-3-270m, py-spy).  Runs from before this scored with that head; the JSON's
``float_head_from`` names, per model, the first window scored with the float head (Gemma-3-270m's
verdict run switched at window 81).

Protocols (named next to every perplexity): ``verdict`` -- 128 x 512 calibration tokens, the whole
WikiText-2 test set, KL(float || quantized) and top-1 agreement from the same pass; ``fast`` -- 16 x
512 calibration tokens, the first 20 windows (KL too).  The float model runs once per window for all
models (its logits are the KL reference).

Noise: the paired bootstrap over evaluation windows (2000 resamples) gives a 95% interval of the
static/dynamic perplexity ratio; ``--seeds 0,1`` also calibrates each config on a second seed, whose
spread is the calibration noise.  Verdict rule, per bit width: static groups are *within noise* when
their perplexity is at most ``--threshold`` (0.5%) above dynamic's or the difference is inside the
seed spread, and their mean KL is not worse by more than the same margin.

The run is resumable: quantized models and the per-window scores live in ``--work``; a run stops
after ``--budget-min`` minutes (state saved) and the same command continues it.  Results:
benchmarks/results/static_groups[_fast].{json,md} (written at every stop; ``"complete"`` says
whether every window of every model is in).

    flock /tmp/bitmosaic-heavy.lock env PYTHONPATH=src python -m benchmarks.gptq.static_groups \\
        --protocol verdict --bits 4,3,2 --budget-min 10      # repeat until "complete"
    PYTHONPATH=src python -m benchmarks.gptq.static_groups --model tiny   # the logic, in seconds
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, machine_info, write_results
from benchmarks.harness.bench import round_window_nll
from bitmosaic import quantize_
from bitmosaic.eval.bootstrap import bootstrap_ratio
from bitmosaic.eval.fidelity import FidelityMeter
from bitmosaic.eval.perplexity import eval_windows, window_nll
from bitmosaic.io import load_quantized, save_quantized
from bitmosaic.modules.head import set_runtime_head
from bitmosaic.modules.intact import set_runtime_activations

PROTOCOLS = {"verdict": (128, None), "fast": (16, 20)}  # calibration samples, eval windows


def load_base(a):
    if a.model == "tiny":
        from bitmosaic.testing import SPECIALS, VOCAB, tiny_llama, word_tokenizer

        g = torch.Generator().manual_seed(0)
        calib = {s: torch.randint(len(SPECIALS), VOCAB, (8, 32), generator=g.manual_seed(s)) for s in a.seeds}
        ids = eval_windows(torch.randint(len(SPECIALS), VOCAB, (1, 32 * 12), generator=g), 32, a.windows)
        return tiny_llama(), word_tokenizer(), calib, ids, 32
    from bitmosaic.data import bos_token_id, calibration_samples, eval_tokens
    from bitmosaic.io import load_model

    model, tok = load_model(a.model)
    calib = {s: calibration_samples(tok, "wikitext2", a.nsamples, a.seqlen, s) for s in a.seeds}
    ids = eval_windows(eval_tokens(tok, "wikitext2"), a.seqlen, a.windows, bos_token_id(tok))
    return model, tok, calib, ids, a.group_size


def configs(a, only_bits: int | None = None) -> list[tuple[str, dict, int]]:
    out = []
    for bits in a.bits if only_bits is None else [only_bits]:
        for seed in a.seeds:
            for kind in a.kinds:
                opts = {"bits": bits} if kind == "awq" else {"bits": bits, "static_groups": kind == "static"}
                out.append((f"w{bits} {kind} s{seed}", opts, seed))
    return out


class State:
    """Quantization reports and per-window scores, saved in ``work`` after every step."""

    def __init__(self, work: Path, key: dict):
        self.path = work / "state.pt"
        self.work = work
        st = torch.load(self.path, weights_only=False) if self.path.exists() else None
        if st is not None and st["key"] != key:
            raise SystemExit(f"error: {work} holds another run ({st['key']}); pass another --work")
        self.st = st or {"key": key, "quant": {}, "nll": {}, "meters": {}}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        torch.save(self.st, tmp)
        tmp.replace(self.path)

    def done(self, name: str) -> int:
        return len(self.st["nll"].get(name, []))


def quantize_missing(a, bits, base, tok, calib, group, state: State, deadline: float) -> bool:
    import copy

    for name, opts, seed in configs(a, bits):
        if name in state.st["quant"]:
            continue
        est = max((q["quant_seconds"] for q in state.st["quant"].values()), default=0.0)
        if time.time() + est > deadline:  # would overrun the budget: the next run does it
            return False
        m = copy.deepcopy(base)
        t = time.perf_counter()
        method = "awq" if name.split()[1] == "awq" else "gptq"
        rep = quantize_(m, method, calib[seed], progress=False, group_size=group, device=a.device, **opts)
        seconds = time.perf_counter() - t
        folder = state.work / name.replace(" ", "_")
        save_quantized(m.to("cpu"), folder, {"method": method}, tokenizer=tok, overwrite=True)
        hess = [r.get("hessian_error") for r in rep.layers]
        state.st["quant"][name] = {
            "method": method,
            "options": {"group_size": group, **opts},
            "seed": seed,
            "quant_seconds": seconds,
            "bits_per_weight": rep.bits_per_weight,
            "hessian_error_sum": sum(hess) if all(h is not None for h in hess) else None,
        }
        state.save()
        print(f"  quantized {name} in {seconds:.0f} s", flush=True)
        del m
    return True


def evaluate(a, base, ids, state: State, deadline: float) -> bool:
    names = ["float", *state.st["quant"]]
    todo = [n for n in names if state.done(n) < ids.shape[0]]
    if not todo:
        return True
    models = {"float": base}
    for n in todo:
        if n != "float":
            m = load_quantized(state.work / n.replace(" ", "_"), load_tokenizer=False)[0]
            set_runtime_activations(m, "none")  # weight-only, as quantized (module doc)
            set_runtime_head(m, "none")  # the float head, as the float model's (module doc)
            # windows scored before this (a run from before the float head) kept the INT8 head
            state.st.setdefault("float_head_from", {}).setdefault(n, state.done(n))
            models[n] = m.to(a.device).eval()
    base = base.to(a.device)
    meters = {n: FidelityMeter.from_state(state.st["meters"][n]) for n in todo if n in state.st["meters"]}
    with torch.inference_mode():
        per_window = 0.0
        for w in range(min(state.done(n) for n in todo), ids.shape[0]):
            if time.time() + per_window > deadline:
                break
            t = time.perf_counter()
            batch = ids[w : w + 1].to(a.device)
            nll_ref, ref = window_nll(base, batch, w, ids.shape[0])
            for n in todo:
                if state.done(n) != w:
                    continue
                nll, pred = (nll_ref, ref) if n == "float" else window_nll(models[n], batch, w, ids.shape[0])
                state.st["nll"].setdefault(n, []).append(float(nll[0]))
                if n != "float":
                    meters.setdefault(n, FidelityMeter()).update(ref, pred)
            per_window = max(per_window, time.perf_counter() - t)
            if (w + 1) % 10 == 0 or w + 1 == ids.shape[0]:
                state.st["meters"].update({n: m.state() for n, m in meters.items()})
                state.save()
                print(f"  window {w + 1}/{ids.shape[0]}", flush=True)
    state.st["meters"].update({n: m.state() for n, m in meters.items()})
    state.save()
    base.to("cpu")  # quantize_missing copies the float model from the CPU
    return all(state.done(n) == ids.shape[0] for n in names)


def _ppl(nll: torch.Tensor, tokens_per_window: int) -> float:
    return math.exp(float(nll.sum()) / (nll.numel() * tokens_per_window))


def summarise(a, state: State, ids: torch.Tensor) -> dict:
    T = ids.shape[1] - 1
    rows = []
    for n in ["float", *state.st["quant"]]:
        done = state.done(n)
        row = {"name": n, "windows": done, **state.st["quant"].get(n, {})}
        if done:
            row["ppl"] = _ppl(torch.tensor(state.st["nll"][n], dtype=torch.float64), T)
            # each window's mean NLL, as every verdict row keeps it (the findings' paired intervals)
            row["window_nll"] = round_window_nll(v / T for v in state.st["nll"][n])
        if n in state.st["meters"] and state.st["meters"][n]["count"]:
            row.update(FidelityMeter.from_state(state.st["meters"][n]).summary())
        rows.append(row)
    by = {r["name"]: r for r in rows}
    verdicts = []
    for bits in a.bits:
        pairs = []
        for seed in a.seeds:
            pair = _pair(state, by.get(f"w{bits} static s{seed}"), by.get(f"w{bits} dynamic s{seed}"), ids)
            if pair is not None:
                pairs.append({"seed": seed, **pair})
        if not pairs:
            continue
        spread = None
        if len(a.seeds) > 1:
            per_kind = []
            for kind in ("static", "dynamic"):
                p = [by[f"w{bits} {kind} s{s}"].get("ppl") for s in a.seeds]
                if all(p):
                    per_kind.append(max(p) / min(p) - 1)
            spread = max(per_kind) if len(per_kind) == 2 else None
        worst = max(p["ppl_ratio"] for p in pairs) - 1
        kl_worst = max(p["kl_ratio"] for p in pairs) - 1
        margin = max(a.threshold, spread or 0.0)
        within = worst <= margin and kl_worst <= margin
        verdicts.append({"bits": bits, "pairs": pairs, "seed_spread": spread, "margin": margin,
                         "within_noise": within})  # fmt: skip
    complete = all(r["windows"] == ids.shape[0] for r in rows) and len(rows) == 1 + len(configs(a))
    return {
        "protocol": a.protocol,
        "rows": rows,
        "verdicts": verdicts,
        "gptq_vs_awq": gptq_vs_awq(a, state, by, ids),
        "complete": complete,
        # per model, the first window (0-based) scored with the float head; earlier ones used the INT8
        # run-time head (the same weights; module doc)
        "float_head_from": state.st.get("float_head_from", {}),
        "eval_windows": ids.shape[0],
        "group_size": state.st["key"]["group_size"] if a.model != "tiny" else 32,
    }


def _pair(state: State, x: dict | None, y: dict | None, ids: torch.Tensor) -> dict | None:
    """Rows ``x`` against ``y``, both scored on every window: the perplexity ratio with its paired 95%
    interval over the windows, the KL ratio and the top-1 difference; None where either is missing."""
    if not all(r and r["windows"] == ids.shape[0] and "kl_mean" in r for r in (x, y)):
        return None
    ci = bootstrap_ratio(state.st["nll"][x["name"]], state.st["nll"][y["name"]], ids.shape[1] - 1)
    return {"ppl_ratio": x["ppl"] / y["ppl"], "ci95": list(ci), "kl_ratio": x["kl_mean"] / y["kl_mean"],
            "top1_diff": x["top1_agreement"] - y["top1_agreement"]}  # fmt: skip


def gptq_vs_awq(a, state: State, by: dict, ids: torch.Tensor) -> list[dict]:
    """GPTQ's default (static groups) against AWQ at the same bits and group, per bit width and seed:
    the static/AWQ perplexity ratio with its paired 95% interval over the windows, the KL ratio and the
    top-1 difference.  ``verdict``: ``gptq`` where the whole interval is below 1, ``awq`` where above,
    ``within noise`` where it holds 1."""
    out = []
    for bits in a.bits:
        for seed in a.seeds:
            pair = _pair(state, by.get(f"w{bits} static s{seed}"), by.get(f"w{bits} awq s{seed}"), ids)
            if pair is not None:
                lo, hi = pair["ci95"]
                verdict = "gptq" if hi < 1 else "awq" if lo > 1 else "within noise"
                out.append({"bits": bits, "seed": seed, **pair, "verdict": verdict})
    return out


def markdown(a, res: dict) -> str:
    proto = f"*{a.protocol}* protocol: calibration {a.nsamples}x{a.seqlen} (seeds {a.seeds}), "
    proto += "WikiText-2 test " + ("(all " if a.windows is None else "(first ")
    proto += f"{res['eval_windows']} windows "
    proto += f"of {a.seqlen} tokens), KL(float || quantized) and top-1 agreement from the same pass"
    if a.device != "cpu" and torch.cuda.is_available():
        proto += f"; GPTQ and evaluation on {torch.cuda.get_device_name()} ({a.device})"
    lines = [
        f"# GPTQ act-order: static vs dynamic groups{' and AWQ' if 'awq' in a.kinds else ''} "
        f"({a.model}, g{res['group_size']}, asym, MSE scales, weight-only evaluation)",
        "",
        proto + ("" if res["complete"] else " -- **PARTIAL: not every window of every model is in**") + ".",
        "",
        "| config | windows | ppl | KL mean | KL p99 | top-1 | bpw | quant s | hessian err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    f = lambda v, p: "" if v is None else f"{v:.{p}f}"  # noqa: E731
    for r in res["rows"]:
        lines.append(
            f"| {r['name']} | {r['windows']} | {f(r.get('ppl'), 3)} | {f(r.get('kl_mean'), 4)} | "
            f"{f(r.get('kl_p99'), 3)} | {f(r.get('top1_agreement'), 4)} | {f(r.get('bits_per_weight'), 3)} | "
            f"{f(r.get('quant_seconds'), 0)} | {'' if r.get('hessian_error_sum') is None else format(r['hessian_error_sum'], '.4g')} |"  # noqa: E501
        )
    lines += ["", "| bits | seed | static/dynamic ppl | 95% CI (windows bootstrap) | KL ratio | top-1 diff |",
              "|---:|---:|---:|---|---:|---:|"]  # fmt: skip
    for v in res["verdicts"]:
        for p in v["pairs"]:
            lines.append(
                f"| {v['bits']} | {p['seed']} | {p['ppl_ratio']:.4f} | "
                f"[{p['ci95'][0]:.4f}, {p['ci95'][1]:.4f}] | "
                f"{p['kl_ratio']:.4f} | {p['top1_diff']:+.4f} |"
            )
    lines += ["", f"Rule: within noise when static's ppl and mean KL are at most max({a.threshold:.1%}, "
              "seed spread) above dynamic's, for every seed.", ""]  # fmt: skip
    for v in res["verdicts"]:
        spread = "not measured" if v["seed_spread"] is None else f"{v['seed_spread']:.2%}"
        lines.append(f"- w{v['bits']}: seed spread {spread}, margin {v['margin']:.2%}: "
                     + ("**within noise**" if v["within_noise"] else "**outside noise**"))  # fmt: skip
    if res["gptq_vs_awq"]:
        lines += ["", "GPTQ (static groups, the default) against AWQ at the same bits and group:", "",
                  "| bits | seed | GPTQ/AWQ ppl | 95% CI (windows bootstrap) | KL ratio | top-1 diff "
                  "| better |",
                  "|---:|---:|---:|---|---:|---:|---|"]  # fmt: skip
        for v in res["gptq_vs_awq"]:
            lines.append(
                f"| {v['bits']} | {v['seed']} | {v['ppl_ratio']:.4f} | "
                f"[{v['ci95'][0]:.4f}, {v['ci95'][1]:.4f}] | {v['kl_ratio']:.4f} | "
                f"{v['top1_diff']:+.4f} | {v['verdict']} |"
            )
    cmd = "flock /tmp/bitmosaic-heavy.lock env PYTHONPATH=src python -m benchmarks.gptq.static_groups "
    cmd += "" if a.model == "smollm2-135m" else f"--model {a.model} "
    cmd += "" if a.kinds == ["dynamic", "static"] else f"--kinds {','.join(a.kinds)} "
    cmd += f"--protocol {a.protocol} --bits {','.join(map(str, a.bits))} "
    cmd += f"--seeds {','.join(map(str, a.seeds))}" + ("" if a.device == "cpu" else f" --device {a.device}")
    lines += ["", f"Reproduce (repeat until complete): `{cmd}`"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m, gemma3-270m, or tiny (the logic, in seconds)")  # fmt: skip
    p.add_argument("--kinds", default="dynamic,static",
                   help="comma list of dynamic, static (GPTQ act-order groups) and awq")  # fmt: skip
    p.add_argument("--protocol", choices=sorted(PROTOCOLS), default="verdict")
    p.add_argument("--bits", default="4,3,2")
    p.add_argument("--seeds", default="0", help="calibration seeds (two or more: the seed spread)")
    p.add_argument("--seed", type=int, default=None, help="one calibration seed (= --seeds N)")
    p.add_argument("--json", default=None, help="the result file (default: results/static_groups*.json)")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--threshold", type=float, default=0.005, help="relative ppl/KL margin (default 0.5%%)")
    p.add_argument("--budget-min", type=float, default=10.0, help="stop (state saved) after this long")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="where GPTQ and the evaluation run (cpu, cuda)")
    p.add_argument("--work", default=None, help="state folder (default /tmp/bitmosaic-static-groups...)")
    a = p.parse_args()
    deadline = time.time() + a.budget_min * 60
    torch.set_num_threads(a.threads)
    a.bits = [int(b) for b in a.bits.split(",")]
    a.seeds = [a.seed] if a.seed is not None else [int(s) for s in a.seeds.split(",")]
    a.kinds = [k for k in a.kinds.split(",") if k]
    if not a.kinds or set(a.kinds) - {"dynamic", "static", "awq"}:
        p.error(f"--kinds {','.join(a.kinds)}: choose from dynamic, static, awq")
    a.nsamples, a.windows = PROTOCOLS[a.protocol]
    suffix = "" if a.protocol == "verdict" else f"_{a.protocol}"
    if a.model == "gemma3-270m":  # the findings' second-model name: <source>_gemma_verdict.json
        suffix = "_gemma" + (suffix or "_verdict")
    elif a.model != "smollm2-135m":
        suffix += f"_{a.model}"
    suffix += "" if a.device == "cpu" else "_gpu"
    work = Path(a.work or f"/tmp/bitmosaic-static-groups{suffix or '-verdict'}")
    work.mkdir(parents=True, exist_ok=True)
    key = {"model": a.model, "protocol": a.protocol, "group_size": a.group_size, "seqlen": a.seqlen}
    state = State(work, key)
    base, tok, calib, ids, group = load_base(a)
    for bits in a.bits:  # one bit width at a time, evaluated before the next: a stopped run has pairs
        if not (quantize_missing(a, bits, base, tok, calib, group, state, deadline) and
                evaluate(a, base, ids, state, deadline)):  # fmt: skip
            break
    res = summarise(a, state, ids)
    md = markdown(a, res)
    print(md)
    out = {"args": {k: v for k, v in vars(a).items()}, **res, "machine": machine_info()}
    if a.model == "tiny":
        print(json.dumps(res["verdicts"], indent=1))
        return
    write_results(Path(a.json or RESULTS / f"static_groups{suffix}.json"), "static_groups", out, md)
    if not res["complete"]:
        print("partial: run the same command again to continue")


if __name__ == "__main__":
    main()
