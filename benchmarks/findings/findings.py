"""Findings report: does each paper's headline claim hold on SmolLM2-135M here?

One row per claim: the paper, the claim, the numbers behind it and a verdict (holds / does not hold
here / cannot be tested here, with why).  The numbers are never typed in: each row reads the JSON
that the method's own benchmark wrote (``benchmarks/results/<name>.json``, or ``<name>_verdict.json``
where a verdict-protocol run holds every row the claim needs; ``--run NAME`` reruns
that benchmark first, with its recorded arguments), and the Babai equivalence and bound rows are
measured afresh here on real SmolLM2 layers (``--skip-fresh`` reuses the last such measurement
from ``findings.json``).  A benchmark whose JSON
is missing gives the row "not measured" and the command that measures it.  The last column's texts
(why a row may differ from its paper) are data, ``benchmarks/results/findings_why.yaml``, whose
measured numbers are read from the same result files (:mod:`benchmarks.findings.why`).

Run: python -m benchmarks.findings   (writes benchmarks/results/findings.md and findings.json)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from dataclasses import replace

from benchmarks.findings import why
from benchmarks.findings.claims import FINDINGS, SECOND_MODEL, SECOND_WHY, Finding
from benchmarks.findings.findings_lib import (
    DIFFERS,
    FAILS,
    HOLDS,
    MISSING,
    RESULTS,
    SECOND_SUFFIX,
    UNDECIDED,
    UNTESTABLE,
    WITHIN_NOISE,
    load,
    module_of,
    protocol_of,
    run_command,
    verdict,
)
from benchmarks.findings.noise import pair_noise
from benchmarks.findings.why import WHY_FILE
from benchmarks.harness import write_text
from benchmarks.harness.child import child_env


def register(more: list[Finding]) -> None:
    FINDINGS.extend(more)


def fresh_babai(nsamples: int = 8, seqlen: int = 256, layers=(0, 15)) -> dict:
    """On real SmolLM2 layers: method ``babai`` vs ``gptq --static-groups --direction back`` integers
    (Thm. 4), in float64, for every linear of the chosen decoder layers."""
    import torch

    from bitmosaic.algorithms import HessianAccumulator
    from bitmosaic.data import calibration_samples
    from bitmosaic.io import load_model
    from bitmosaic.methods.babai import BabaiConfig, quantize_babai
    from bitmosaic.methods.common import quantize_gptq
    from bitmosaic.methods.gptq import GPTQConfig
    from bitmosaic.methods.registry import LayerStats
    from bitmosaic.pipeline.capture import run_layer
    from bitmosaic.pipeline.pipeline import capture_layer_inputs

    model, tok = load_model("smollm2-135m")
    calib = calibration_samples(tok, "wikitext2", nsamples, seqlen, seed=0)
    blocks = model.model.layers
    inputs, kw = capture_layer_inputs(model, blocks, calib, batch_size=4)
    kwargs = next(iter(kw.values()))
    same = total = 0
    with torch.inference_mode():
        for i in range(max(layers) + 1):
            if i in layers:
                for lin in blocks[i].modules():
                    if not isinstance(lin, torch.nn.Linear):
                        continue
                    acc = HessianAccumulator(lin.in_features, dtype=torch.float64)
                    hook = lin.register_forward_pre_hook(lambda m, a, acc=acc: acc.add(a[0].double()))
                    for h, k in zip(inputs, kwargs, strict=True):
                        run_layer(blocks[i], h, k)
                    hook.remove()
                    common = dict(bits=3, group_size=128, scale="minmax", order="act")
                    common["direction"] = "back"
                    W, st = lin.weight.double(), LayerStats(hessian=acc.H)
                    b = quantize_babai(W, st, BabaiConfig(**common, damp=0.01, solver_dtype="float64"))
                    g = quantize_gptq(W, st, GPTQConfig(**common, static_groups=True, solver_dtype="float64"))
                    same += int((b.codes == g.codes).sum())
                    total += b.codes.numel()
            inputs = [run_layer(blocks[i], h, k) for h, k in zip(inputs, kwargs, strict=True)]
    return {"identical_codes": same, "codes": total, "layers": list(layers)}


def judge_fresh(res: dict) -> tuple[str, str]:
    frac = res["identical_codes"] / res["codes"]
    nums = (
        f"{res['identical_codes']}/{res['codes']} integers identical ({frac:.6%}), w3 g128 act order, "
        f"every linear of layers {res['layers']}"
    )
    return nums, verdict(frac == 1.0)


def verdict_runs(source: str) -> list[str]:
    """The verdict-protocol runs of ``source``: ``<source>_verdict.json`` (seed 0) and any other seed's
    ``<source>_verdict_s<N>.json``, in that order."""
    seeds = sorted(RESULTS.glob(f"{source}_verdict_s*.json"), key=lambda p: p.stem)
    # not the partial file a run still going (or cut short) keeps beside its JSON
    return [f"{source}_verdict"] + [p.stem for p in seeds if not p.stem.endswith(".partial")]


def judge(f: Finding) -> tuple[str, str, str]:
    """(numbers, verdict, the JSON used): the verdict-protocol runs of ``f.source`` when they hold every
    row the claim needs (seeds that disagree: :func:`majority`),
    else the benchmark's own ``<source>.json``."""
    return judge_seeds(f)[:3]


def judge_seeds(f: Finding) -> tuple[str, str, str, int]:
    """:func:`judge`, and how many verdict-protocol seeds the verdict rests on (0: not the verdict runs);
    a claim's close pairs then get their intervals and may turn the verdict to "within noise"
    (:func:`close_pair_noise`)."""
    nums, v, used, n = judge_pooled(f) if f.pooled else _judge_seeds(f)
    if not f.close_pairs or not nums:  # not measured: nothing to add
        return nums, v, used, n
    nums, v = close_pair_noise(f, nums, v, used)
    return nums, v, used, n


def close_pair_noise(f: Finding, nums: str, v: str, used: str) -> tuple[str, str]:
    """``nums`` and ``v`` with each close pair of ``f`` (:attr:`Finding.close_pairs`) judged over the
    runs the verdict rests on (every verdict seed holding both rows, or the one run ``used``): its
    intervals and seed spread added to the numbers, and the verdict "within noise" where an interval
    includes 1 or the seeds disagree in sign (:mod:`benchmarks.findings.noise`)."""
    names = verdict_runs(f.source) if used == f"{f.source}_verdict" else [used]
    runs = [res for name in names if (res := load(name)) is not None]
    why = []
    for a, b in f.close_pairs:
        pn = pair_noise(runs, a, b)
        if pn is None:  # not close, or not measured together
            continue
        nums += "; " + pn.text()
        if pn.within_noise:
            why.append(f"{a} vs {b}: {pn.reason()}")
    return nums, (f"{WITHIN_NOISE} ({'; '.join(why)})" if why else v)


def _judge_seeds(f: Finding) -> tuple[str, str, str, int]:
    missing, seeds = None, []
    for name in verdict_runs(f.source):
        res = load(name)
        if res is None:
            continue
        try:
            seeds.append((name, *f.judge(res)))
        except KeyError as e:  # a row the claim needs is absent from that run
            missing = missing or (name, e)
    if seeds:
        name, nums, v = seeds[0]
        if len(seeds) > 1:
            nums += "; " + "; ".join(f"{n}: {other}" for n, other, _ in seeds[1:])
            if any(_head(other) != _head(v) for *_, other in seeds[1:]):  # the reasons may differ
                v = majority([x for *_, x in seeds])
        return nums, v, name, len(seeds)
    res = load(f.source)
    if res is not None:
        try:
            return (*f.judge(res), f.source, 0)
        except KeyError as e:
            missing = missing or (f.source, e)
    return _not_measured(f, missing)


def _not_measured(f: Finding, missing: tuple[str, KeyError] | None) -> tuple[str, str, str, int]:
    """The verdict of a claim no run can judge: which run lacks which row, or that none ran."""
    if missing is None and f.unmeasured is not None:
        return (*f.unmeasured, f.source, 0)
    if missing is None:
        return "", f"{MISSING}: run {run_command(f.source)}", f.source, 0
    name, e = missing
    return "", f"{MISSING}: {name}.json has no {e}; rerun {run_command(f.source)}", f.source, 0


def judge_pooled(f: Finding) -> tuple[str, str, str, int]:
    """:func:`judge_seeds` of a pooled claim: judged once on seed 0's verdict run with every other
    seed's run beside it (``res["seeds"]``), the judge deciding pair by pair and counting the seeds;
    else on the benchmark's own run (never on a later seed alone: it repeats only some pairs)."""
    verdict_run, *others = verdict_runs(f.source)
    missing = None
    for name in (verdict_run, f.source):
        res = load(name)
        if res is None:
            continue
        seeds = {o: r for o in others if (r := load(o)) is not None} if name == verdict_run else {}
        try:
            nums, v, n = f.judge({**res, "seeds": seeds})
        except KeyError as e:
            missing = missing or (name, e)
            continue
        return nums, v, name, n if name == verdict_run else 0
    return _not_measured(f, missing)


def _head(verdict: str) -> str:
    """A verdict without its parenthesised reason or ``;``-separated notes: two seeds that both say
    ``does not hold here`` agree even where their reasons quote different numbers."""
    return verdict.split(" (", 1)[0].split("; ", 1)[0]


def majority(verdicts: list[str]) -> str:
    """The verdict of seeds that disagree: with three or more, the one most of them give, with its
    count (``holds (2 of 3 seeds)``); else (two, or no majority) undecided, every seed's named."""
    heads = [_head(v) for v in verdicts]  # seeds are counted by verdict, whatever their reasons say
    best = max(set(heads), key=heads.count)
    if len(verdicts) >= 3 and heads.count(best) > len(verdicts) / 2:
        return (
            f"{best} ({heads.count(best)} of {len(verdicts)} seeds; the others: "
            + " / ".join(v for v, h in zip(verdicts, heads, strict=True) if h != best)
            + ")"
        )
    return f"{UNDECIDED} (the seeds disagree: " + " / ".join(verdicts) + ")"


def rerun(name: str) -> None:
    res = load(name)
    args = (res or {}).get("args", {})
    cmd = [sys.executable, "-m", module_of(name)]
    for k, v in args.items():
        if v is None or v is False or k == "json":
            continue
        cmd += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    print("running", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=child_env())


def protocol_summary(rows: list[dict]) -> str:
    """One line: how many claims each protocol decided (the move to the verdict protocol, counted)."""

    def kind(protocol: str) -> str:
        if protocol == "-" or protocol.endswith("(no perplexity)"):
            return "no perplexity (timings, per-layer errors)"
        head = protocol.split(",")[0]
        return f"the {head} protocol" if head in ("verdict", "fast") else "other settings"

    counts = Counter(kind(r["protocol"]) for r in rows)
    return f"Of {len(rows)} claims: " + ", ".join(f"{n} on {k}" for k, n in counts.most_common()) + "."

# the second model (issue 73): Gemma-3-270m (a different family, twice the size, its float weights a
# dequantized Q4_K_M/Q6_K file: not SmolLM2's Q4_1 grid), run with the same benchmarks and row names,
# ``--model gemma3-270m``, into ``<source>_gemma.json`` (fast) / ``<source>_gemma_verdict[_s<N>].json``
MODELS = (("SmolLM2-135M", ""), ("Gemma-3-270m", SECOND_SUFFIX))
SECOND_MODEL_NOTE = (
    "The claims named in `claims.SECOND_MODEL` (one or more per paper and the ones that set a default) "
    "are also judged on Gemma-3-270m with the same benchmark, rows and judge (`--model gemma3-270m`, "
    "results `<source>_gemma*.json`); a verdict that differs between the models says so in both rows. "
    "bitmosaic refuses rotation on Gemma-3, so no rotation claim has a Gemma row."
)

GEMMA_DIFFERS = (
    "Gemma-3-270m (640 wide, 18 layers, 262k vocabulary, BOS on every window), dequantized from its "
    "Q4_K_M GGUF (Q4_K and Q6_K blocks): another grid than SmolLM2's Q4_1, but a grid too (outliers.md: "
    "every 32-weight group of o_proj holds at most 16 values, 15-25% of the q/k/v/gate/up groups do)"
)


def model_rows(f: Finding, fresh: dict | None) -> list[dict]:
    """The report's rows of claim ``f``: SmolLM2-135M's, then Gemma-3-270m's where ``f`` is one of
    :data:`claims.SECOND_MODEL` (judged like the first, on ``<source>_gemma*`` runs)."""
    out = [_row(f, fresh, MODELS[0][0])]
    if f.claim in SECOND_MODEL and callable(f.judge) and f.source != "fresh":
        second = replace(f, source=f.source + MODELS[1][1], differ=SECOND_WHY.get(f.claim, GEMMA_DIFFERS))
        out.append(_row(second, None, MODELS[1][0]))
    return out


def _row(f: Finding, fresh: dict | None, model: str) -> dict:
    used, nseeds = f.source, 0
    if f.source == "fresh":
        if fresh is None:
            nums, v = "", f"{MISSING} (--skip-fresh)"
        else:
            nums, v = judge_fresh(fresh)
    elif not callable(f.judge):
        nums, v = f.judge
    else:
        nums, v, used, nseeds = judge_seeds(f)
    proto = "fresh (8x256 calib)" if f.source == "fresh" else protocol_of(load(used) or {})
    if nseeds:  # how many seeds the verdict rests on (pooled: seed 0, more on the pairs repeated)
        proto += ", one seed" if nseeds == 1 else f", {nseeds} seeds"
        proto += " on the pairs a later seed repeats, one on the rest" if f.pooled and nseeds > 1 else ""
    q4_1 = getattr(f, "q4_1", "") if model == MODELS[0][0] else ""  # SmolLM2's grid: its rows only
    return {"paper": f.paper, "claim": f.claim, "model": model, "source": used, "numbers": nums,
            "verdict": v, "protocol": proto, "may_differ": f.differ, "q4_1": q4_1}  # fmt: skip


VERDICT_WORDS = (HOLDS, FAILS, UNTESTABLE, UNDECIDED, WITHIN_NOISE, MISSING)


def _kind(verdict: str) -> str:
    """A verdict's word (holds, does not hold here, within noise, ...), its qualifiers left out: "holds at
    BPW 4.25 only" and "holds" agree."""
    return next((w for w in VERDICT_WORDS if verdict.startswith(w)), _head(verdict))


def flag_flips(rows: list[dict]) -> list[dict]:
    """Rows of one claim on several models: where their verdicts differ (not counting "not measured"),
    each verdict says so, naming every model's verdict and protocol."""
    judged = [r for r in rows if not r["verdict"].startswith(MISSING)]
    if len({_kind(r["verdict"]) for r in judged}) > 1:
        note = "; flips between models: " + " / ".join(
            f"{r['model']} {_kind(r['verdict'])} ({r['protocol'].split(',')[0]})" for r in judged
        )
        for r in judged:
            r["verdict"] += note
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="", help="comma list of benchmarks to rerun first (e.g. dpq,lattice)")
    p.add_argument("--skip-fresh", action="store_true", help="skip the fresh Babai equivalence measurement")
    a = p.parse_args()
    for name in filter(None, a.run.split(",")):
        rerun(name)
    for line in why.check():  # a result measured again: its text shows the new number, to be read again
        print(f"note: {WHY_FILE.name}: {line}", file=sys.stderr)
    if a.skip_fresh:  # keep the last fresh measurement, if any (it is recorded in findings.json)
        prev = load("findings")
        fresh = (prev or {}).get("fresh")
    else:
        fresh = fresh_babai()
    rows = [r for f in FINDINGS for r in flag_flips(model_rows(f, fresh))]
    md = ["# Findings on SmolLM2-135M and Gemma-3-270m (WikiText-2)", "",
          "Generated by `python -m benchmarks.findings` from the benchmarks' own JSON results. Protocols: "
          "*fast* = 16x512 calibration, the first 20 test windows; *verdict* = at least 128x512, every "
          "window, KL and top-1; other settings are spelled out. A claim is judged on its verdict-protocol "
          "runs where they hold every row it needs (`<source>_verdict.json`, other seeds in "
          "`<source>_verdict_s<N>.json`: with two seeds a verdict stands only if both give it, with three "
          "or more the one most seeds give, counted; a claim judged pair by pair, whose later seeds "
          "repeat only its pairs under 10% (SFMP's main table), takes a pair's winner only where every "
          "seed gives it; the "
          "protocol column says how many seeds), else on the benchmark's own run. A claim comparing two "
          "rows within 10% of each other (a close pair) shows the paired bootstrap 95% interval of their "
          "perplexity ratio over the test windows (2000 resamples) and the seed spread (min..max of the "
          "ratio over seeds), and is *within noise* where an interval includes 1 or the seeds disagree; "
          "a pair measured before per-window NLLs were kept says so and gets no interval. A claim "
          "marked *ours* is a comparison of our own, not the paper's. " + SECOND_MODEL_NOTE, "",
          f"Why any row may differ from its paper: {DIFFERS}.", "",
          "Each SmolLM2 row's last line, *Q4_1 grid*, says whether its verdict can depend on SmolLM2's float "
          "weights being a dequantized Q4_1 grid (at most 16 values per 32 weights, asymmetric, float "
          "offsets), and why (`findings_q4_1.yaml`).", "", protocol_summary(rows), "",
          "| paper | claim | model | numbers | verdict | protocol | why this may differ from the paper "
          "| source |",
          "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    cols = ("paper", "claim", "model", "numbers", "verdict", "protocol", "may_differ", "source")
    for r in rows:  # the why column ends with the row's Q4_1-grid line (SmolLM2's rows)
        grid = f"<br>*Q4_1 grid: {r['q4_1']}*" if r.get("q4_1") else ""
        cell = {**r, "may_differ": f"{r['may_differ']}{grid}".removeprefix("<br>")}
        md.append("| " + " | ".join(str(cell[c]).replace("|", "\\|") for c in cols) + " |")
    write_text(RESULTS / "findings.md", "\n".join(md) + "\n")
    write_text(RESULTS / "findings.json", json.dumps({"rows": rows, "fresh": fresh}, indent=2))
    print("\n".join(md))


if __name__ == "__main__":
    main()
