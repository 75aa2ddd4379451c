"""Findings report: does each paper's headline claim hold on SmolLM2-135M here?

One row per claim: the paper, the claim, the numbers behind it and a verdict (holds / does not hold
here / cannot be tested here, with why).  The numbers are never typed in: each row reads the JSON
that the method's own benchmark wrote (``benchmarks/results/<name>.json``; ``--run NAME`` reruns
that benchmark first, with its recorded arguments), and the Babai equivalence and bound rows are
measured afresh here on real SmolLM2 layers (``--skip-fresh`` reuses the last such measurement
from ``findings.json``).  A benchmark whose JSON
is missing gives the row "not measured" and the command that measures it.

Run: python benchmarks/findings.py   (writes benchmarks/results/findings.md and findings.json)
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bitmosaic.models.serialization import atomic_write_text

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
HOLDS, FAILS, UNTESTABLE, MISSING = "holds", "does not hold here", "cannot be tested here", "not measured"


@dataclass
class Finding:
    paper: str
    claim: str
    source: str  # benchmark JSON name (benchmarks/results/<source>.json), or "fresh"
    judge: Callable[[dict], tuple[str, str]]  # results -> (numbers, verdict)


def load(name: str) -> dict | None:
    p = RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def rows_by_name(res: dict) -> dict[str, dict]:
    return {r["name"]: r for r in res.get("rows", [])}


def fmt(x: float, nd: int = 2) -> str:
    return "inf" if not math.isfinite(x) else f"{x:.{nd}f}"


def verdict(ok: bool, why_not: str = "") -> str:
    return HOLDS if ok else (FAILS + (f" ({why_not})" if why_not else ""))


# -- Babai / GPTQ (paper 004) ------------------------------------------------------------------
def babai_bound_table(res: dict) -> tuple[str, str]:
    t = res["bound_table"]
    worst = max(v["noclip_error"] / v["bound"] for order in t.values() for v in order.values())
    n = sum(len(o) for o in t.values())
    return (f"no-clip error / bound ≤ {fmt(worst, 3)} over {n} (order, projection) sums", verdict(worst <= 1))


def babai_min_pivot(res: dict) -> tuple[str, str]:
    t = res["bound_table"]
    tot = {o: sum(v["bound"] for v in t[o].values()) for o in t}
    best = min(tot, key=tot.get)
    nums = ", ".join(f"{o} {tot[o]:.0f}" for o in tot)
    return (f"summed Babai bound: {nums}", verdict(best == "min-pivot", f"{best} has the smallest bound"))


def hptq_vs_rtn_gptq(res: dict) -> tuple[str, str]:
    r = rows_by_name(res)
    h, hr, g = r["hptq 3.125"], r["hrtn 3.125"], r["gptq w3 g128 mse act"]
    nums = "; ".join(
        f"{k} {fmt(v['ppl'])} @ {fmt(v['bits_per_weight'], 3)} bpw"
        for k, v in (("HPTQ", h), ("HRTN", hr), ("GPTQ w3 g128", g))
    )
    ok = h["ppl"] < g["ppl"] and h["bits_per_weight"] <= g["bits_per_weight"] and h["ppl"] < hr["ppl"]
    return nums, verdict(ok)


def ssqr_vs_gptq(res: dict) -> tuple[str, str]:
    r = rows_by_name(res)
    gptq = [v for k, v in r.items() if k.startswith("gptq")]
    ssqr = [v for k, v in r.items() if k.startswith("ssqr") and "static" in k]
    lines, beats = [], 0
    for s in ssqr:  # against the GPTQ row nearest in bits per weight (either side)
        near = min(gptq, key=lambda g: abs(g["bits_per_weight"] - s["bits_per_weight"]))
        lines.append(f"{s['name']} {fmt(s['ppl'])} @ {fmt(s['bits_per_weight'])} vs {near['name']} "
                     f"{fmt(near['ppl'])} @ {fmt(near['bits_per_weight'])}")  # fmt: skip
        beats += s["ppl"] < near["ppl"]
    ok = bool(lines) and beats == len(lines)
    return "; ".join(lines), verdict(ok, "GPTQ with smaller groups wins at equal bits")


# -- DPQ (paper 003) ----------------------------------------------------------------------------
def dpq_vs_baselines(res: dict) -> tuple[str, str]:
    r = rows_by_name(res)
    d, n, rt = r["W4A8 dpq gar"], r["W4A8 naive gptq gar"], r["W4A8 rtn"]
    nums = f"DPQ {fmt(d['ppl'])}, naive GPTQ {fmt(n['ppl'])}, RTN {fmt(rt['ppl'])} (W4A8-FP8, g128)"
    gain = (n["ppl"] - d["ppl"]) / n["ppl"]  # under 1% is no meaningful gain on 20 windows
    ok = gain >= 0.01 and d["ppl"] < rt["ppl"]
    return nums + f"; vs naive {gain:+.1%}", verdict(ok, "vs RTN yes, vs naive GPTQ no meaningful gain")


def dpq_gar_vs_act(res: dict) -> tuple[str, str]:
    r = rows_by_name(res)
    g, a, nat = r["W4A8 dpq gar"], r["W4A8 dpq act-order"], r["W4A8 dpq no reorder"]
    nums = (f"GAR {fmt(g['ppl'])} @ {fmt(g['bits_per_weight'], 3)} bpw (no g_idx), act-order "
            f"{fmt(a['ppl'])} @ {fmt(a['bits_per_weight'], 3)}, natural {fmt(nat['ppl'])}")
    # the paper: GAR keeps most of act-order's gain without the g_idx gather
    gain_kept = (nat["ppl"] - g["ppl"]) / max(nat["ppl"] - a["ppl"], 1e-9)
    return nums + f"; GAR keeps {gain_kept:.0%} of act-order's gain", verdict(gain_kept >= 0.8)


B = "Babai (GPTQ geometry)"
# -- SQ-format (paper 000) ---------------------------------------------------------------------
def _sq_rows(res: dict, part: str) -> dict[str, dict]:
    return {r["name"]: r for r in res["rows"] if r.get("part") == part}


def sq_between_a4_a8(res: dict) -> tuple[str, str]:
    r = _sq_rows(res, "acts")
    a8, a4 = r["W4A8"]["ppl"], r["W4A4"]["ppl"]
    sq = {k: v["ppl"] for k, v in r.items() if k.startswith("W4A(SQ")}
    inside = [k for k, p in sq.items() if a8 <= p <= a4]
    nums = f"W4A8 {fmt(a8)}, W4A4 {fmt(a4)}; " + ", ".join(f"{k} {fmt(p)}" for k, p in sq.items())
    return nums, verdict(len(inside) == len(sq), f"{len(sq) - len(inside)} setting(s) outside [A8, A4]")


def sq_static_close_at_84(res: dict) -> tuple[str, str]:
    r = _sq_rows(res, "acts")
    d = r["W4A(SQ6) 16-(8/4)-0.5 dynamic"]["ppl"]
    st = r["W4A(SQ6) 16-(8/4)-0.5 static"]["ppl"]
    gap = st / d - 1
    return f"(8/4) b16 s0.5: dynamic {fmt(d)}, static {fmt(st)} (+{gap:.0%})", verdict(gap <= 0.05)


def sq_weights_improve_as_s_falls(res: dict) -> tuple[str, str]:
    r = _sq_rows(res, "weights")
    cfgs = ("W(SQ4.5){} 64-(8/4)-0.9375", "W(SQ5){} 64-(8/4)-0.875", "W(SQ6){} 32-(8/4)-0.75")
    ppl = [r[k.format("A16")]["ppl"] for k in cfgs]
    nums = "A16: s 0.9375 / 0.875 / 0.75 -> " + " / ".join(fmt(p) for p in ppl)
    a4 = [r[k.format("A4")]["ppl"] for k in cfgs]
    nums += "; A4: " + " / ".join(fmt(p) for p in a4) + " (per-token A4 collapses on this model)"
    return nums, verdict(ppl[0] > ppl[1] > ppl[2])


# -- MosaicQuant (paper 002) --------------------------------------------------------------------
def mosaic_a4_no_collapse(res: dict) -> tuple[str, str]:
    r = rows_by_name(res)
    m, sq_, rt, g = r["mosaic W4A4"], r["smoothquant W4A4"], r["rtn W4A4"], r["gptq W4A4"]
    fl = r["float"]["ppl"]
    nums = (f"W4A4: MosaicQuant {fmt(m['ppl'])} @ {fmt(m['bits_per_weight'], 3)} bpw, SmoothQuant "
            f"{fmt(sq_['ppl'])}, GPTQ {fmt(g['ppl'])}, RTN {fmt(rt['ppl'])} (float {fmt(fl)})")  # fmt: skip
    best_other = min(sq_["ppl"], rt["ppl"], g["ppl"])
    ok = m["ppl"] < best_other and m["ppl"] < 2 * fl
    return nums, verdict(ok, "best of the W4A4 rows, yet over 2x the float perplexity")


def mosaic_w4a8(res: dict) -> tuple[str, str]:
    r = rows_by_name(res)
    m, sq_, g = r["mosaic W4A8"], r["smoothquant W4A8"], r["gptq W4A8"]
    nums = f"W4A8: MosaicQuant {fmt(m['ppl'])}, SmoothQuant {fmt(sq_['ppl'])}, GPTQ {fmt(g['ppl'])}"
    return nums, verdict(m["ppl"] < min(sq_["ppl"], g["ppl"]), "GPTQ's dense base beats it")


# -- SFMP (paper 001) ---------------------------------------------------------------------------
def sfmp_beats_uniform(res: dict) -> tuple[str, str]:
    """At each measured budget: SFMP rows against the uniform rows using no fewer bits."""
    by_point: dict[str, dict[str, dict]] = {}
    for r in res["rows"]:
        point, _, name = r["name"].partition(" ")
        if r["method"] != "float":
            by_point.setdefault(point, {})[name] = r
    lines, wins, total = [], 0, 0
    for point, rows in by_point.items():
        uni = {k: v for k, v in rows.items() if v["method"] != "sfmp"}
        for k, v in rows.items():
            if v["method"] != "sfmp":
                continue
            fair = {u: w for u, w in uni.items() if w["bits_per_weight"] >= v["bits_per_weight"] - 1e-9}
            for u, w in fair.items():
                total += 1
                wins += v["ppl"] < w["ppl"]
                lines.append(f"BPW {point}: {k} {fmt(v['ppl'])} @ {fmt(v['bits_per_weight'], 3)} vs {u} "
                             f"{fmt(w['ppl'])} @ {fmt(w['bits_per_weight'], 3)}")  # fmt: skip
    if not total:
        return "", f"{MISSING}: no SFMP row with a uniform row of at least its size"
    pts = ", ".join(sorted(by_point))
    v = verdict(wins == total, f"{wins}/{total} wins")
    if len(by_point) < 6:  # the issue asks for 2.5, 3.0, 3.25, 3.5, 4.0 and 4.25
        v += f" at BPW {pts} only; the other budgets are not measured"
    return "; ".join(lines), v


FINDINGS: list[Finding] = [
    Finding(B, "GPTQ back-to-front = Babai's nearest plane (Thm. 4)", "fresh", None),
    Finding(B, "no-clip GPTQ error ≤ ¼ Σ D_jj s_j² (Thm. 5)", "lattice", babai_bound_table),
    Finding(B, "min-pivot order gives the smallest bound", "lattice", babai_min_pivot),
    Finding(B, "HPTQ beats RTN/HRTN and GPTQ at ~3.1 bits", "lattice", hptq_vs_rtn_gptq),
    Finding(B, "SSQR (1-3% outliers) beats GPTQ at equal bits", "ssqr_groups", ssqr_vs_gptq),
    Finding("DPQ", "DPQ W4A8 beats naive GPTQ and RTN W4A8", "dpq", dpq_vs_baselines),
    Finding("DPQ", "GAR ≈ act-order accuracy without g_idx", "dpq", dpq_gar_vs_act),
    Finding("SQ-format", "W4A(SQ) lands between W4A4 and W4A8", "sq_format", sq_between_a4_a8),
    Finding("SQ-format", "static masks ≈ dynamic at (8/4)", "sq_format", sq_static_close_at_84),
    Finding("SQ-format", "W(SQ) improves as the sparsity s falls", "sq_format",
            sq_weights_improve_as_s_falls),  # fmt: skip
    Finding("MosaicQuant", "W4A4 MosaicQuant avoids the RTN/SmoothQuant collapse", "mosaic_main",
            mosaic_a4_no_collapse),  # fmt: skip
    Finding("MosaicQuant", "MosaicQuant beats SmoothQuant and GPTQ at W4A8", "mosaic_main", mosaic_w4a8),
    Finding("SFMP", "SFMP beats uniform quantization at equal memory", "sfmp", sfmp_beats_uniform),
]


def register(more: list[Finding]) -> None:
    FINDINGS.extend(more)


def fresh_babai(nsamples: int = 8, seqlen: int = 256, layers=(0, 15)) -> dict:
    """On real SmolLM2 layers: method ``babai`` vs ``gptq --static-groups --direction back`` integers
    (Thm. 4), in float64, for every linear of the chosen decoder layers."""
    import torch

    from bitmosaic.algorithms import HessianAccumulator
    from bitmosaic.data import calibration_samples
    from bitmosaic.methods.gptq import BabaiConfig, GPTQConfig, quantize_babai, quantize_gptq
    from bitmosaic.methods.registry import LayerStats
    from bitmosaic.models import load_model
    from bitmosaic.models.capture import run_layer
    from bitmosaic.models.pipeline import capture_layer_inputs

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
                    common = dict(bits=3, group_size=128, scale_method="minmax", order="act")
                    common["direction"] = "back"
                    W, st = lin.weight.double(), LayerStats(hessian=acc.H)
                    b = quantize_babai(W, st, BabaiConfig(**common, percdamp=0.01, dtype="float64"))
                    g = quantize_gptq(W, st, GPTQConfig(**common, static_groups=True, dtype="float64"))
                    same += int((b.codes == g.codes).sum())
                    total += b.codes.numel()
            inputs = [run_layer(blocks[i], h, k) for h, k in zip(inputs, kwargs, strict=True)]
    return {"identical_codes": same, "codes": total, "layers": list(layers)}


def judge_fresh(res: dict) -> tuple[str, str]:
    frac = res["identical_codes"] / res["codes"]
    nums = (f"{res['identical_codes']}/{res['codes']} integers identical ({frac:.6%}), w3 g128 act order, "
            f"every linear of layers {res['layers']}")
    return nums, verdict(frac == 1.0)


def rerun(name: str) -> None:
    res = load(name)
    args = (res or {}).get("args", {})
    cmd = [sys.executable, str(HERE / f"{name}.py")]
    for k, v in args.items():
        if v is None or v is False or k == "json":
            continue
        cmd += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    print("running", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="", help="comma list of benchmarks to rerun first (e.g. dpq,lattice)")
    p.add_argument("--skip-fresh", action="store_true", help="skip the fresh Babai equivalence measurement")
    a = p.parse_args()
    for name in filter(None, a.run.split(",")):
        rerun(name)
    if a.skip_fresh:  # keep the last fresh measurement, if any (it is recorded in findings.json)
        prev = load("findings")
        fresh = (prev or {}).get("fresh")
    else:
        fresh = fresh_babai()
    rows = []
    for f in FINDINGS:
        if f.source == "fresh":
            if fresh is None:
                nums, v = "", f"{MISSING} (--skip-fresh)"
            else:
                nums, v = judge_fresh(fresh)
        else:
            res = load(f.source)
            if res is None:
                nums, v = "", f"{MISSING}: run python benchmarks/{f.source}.py"
            elif callable(f.judge):
                try:
                    nums, v = f.judge(res)
                except KeyError as e:  # a row the claim needs is absent from that run
                    nums = ""
                    v = f"{MISSING}: {f.source}.json has no {e}; rerun python benchmarks/{f.source}.py"
            else:
                nums, v = f.judge
        rows.append({"paper": f.paper, "claim": f.claim, "source": f.source, "numbers": nums, "verdict": v})
    md = ["# Findings on SmolLM2-135M (WikiText-2)", "",
          "Generated by `python benchmarks/findings.py` from the benchmarks' own JSON results.", "",
          "| paper | claim | numbers | verdict | source |", "|---|---|---|---|---|"]  # fmt: skip
    md += [f"| {r['paper']} | {r['claim']} | {r['numbers']} | {r['verdict']} | {r['source']} |" for r in rows]
    atomic_write_text(RESULTS / "findings.md", "\n".join(md) + "\n")
    atomic_write_text(RESULTS / "findings.json", json.dumps({"rows": rows, "fresh": fresh}, indent=2))
    print("\n".join(md))


if __name__ == "__main__":
    main()
