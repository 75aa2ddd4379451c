"""Findings-report judges of issue 25's rotation goals (QuaRot/SpinQuant; ours, not the papers')."""

from __future__ import annotations

from benchmarks.findings.findings_lib import fmt, load, rows_by_name, verdict

# -- rotations (QuaRot; issue 25's goals: ours, not a claim of the five papers) ------------------------
ALONE = "gptq W4A4 +hadamard"  # rotation alone: QuaRot's GPTQ W4A4 (W4 per channel, A4 per token)
PAPER_SPIN = "gptq W4A4 +spinquant:batch=8"  # SpinQuant's setting: 100 steps of 8 samples, lr 1.5


def rotation_w4a4_goal(res: dict) -> tuple[str, str]:
    r = rows_by_name(res)
    fl = r["float"]["ppl"]
    names = ["gptq W4A4", ALONE, "gptq W4A4c0.9 +hadamard", "gptq W4A4g64 +hadamard",
             "gptq W4A4g64c0.9 +hadamard", "gptq W4A4 +spinquant", "gptq W4A4g64 +spinquant", PAPER_SPIN,
             "gptq W4A4g64c0.9 +spinquant:batch=8", "gptq W4A4g64c0.9 +spinquant:lr=0.1,batch=8"]  # fmt: skip
    nums = ", ".join(f"{n} {fmt(r[n]['ppl'])} ({r[n]['ppl'] / fl:.2f}x)" for n in names if n in r)
    best = min(r[n]["ppl"] for n in names[1:] if n in r)
    why = f"best rotated row {best / fl:.2f}x float"
    return f"{nums} (float {fmt(fl)}; goal 1.5x){a4_budget()}", verdict(best <= 1.5 * fl, why)


def a4_budget() -> str:
    """What the activations alone cost the rotated model (``benchmarks/rotation/w4a4_budget.py``), where
    measured."""
    res = load("w4a4_budget")
    if res is None:
        return ""
    fl = res["float_ppl"]
    rows = {(x["weights"], x["acts"]): x["ppl"] for x in res["rows"]}
    want = [
        ("float", "A4 per token, clip 0.9 (QuaRot's)", "A4 per token"),
        ("float", "A4 g64, clip 0.9", "A4g64"),
        ("float", "A4 g64, clip 0.9; A8 at gate/up", "A4g64 but A8 at gate/up"),
        ("GPTQ W4", "A4 g64, clip 0.9; A8 at gate/up", "GPTQ W4, A4g64 but A8 at gate/up"),
    ]
    parts = ", ".join(f"{say} {rows[(w, k)] / fl:.2f}x" for w, k, say in want if (w, k) in rows)
    return f"; the activations' cost (w4a4_budget, {res['protocol']}, float weights unless named): {parts}"


def rotation_beats_alone(method_row: str, res: dict, alone: str = ALONE) -> tuple[str, str]:
    """``method_row`` with a Hadamard rotation against the rotation alone (GPTQ +hadamard with the same
    activations: per token, or ``alone``), and the same method without the rotation."""
    r = rows_by_name(res)
    m = r[method_row + " +hadamard"]
    alone, where = _beside(r, alone, m)
    plain = r.get(method_row)
    nums = (f"{method_row} +hadamard {fmt(m['ppl'])} @ {fmt(m['bits_per_weight'], 3)} bpw vs rotation alone "
            f"{fmt(alone['ppl'])} @ {fmt(alone['bits_per_weight'], 3)}"
            + (f"; without rotation {fmt(plain['ppl'])}" if plain else "") + where)  # fmt: skip
    gain = 1 - m["ppl"] / alone["ppl"]
    return nums + f" ({gain:+.1%})", verdict(gain >= 0.01, "within 1% of rotation alone" if gain > 0 else "")


def spinquant_beats_hadamard(res: dict) -> tuple[str, str]:
    """SpinQuant's claim over QuaRot: the learned rotation against the Hadamard one it starts from, GPTQ
    W4A4 per token, on the same device -- the paper's setting (8 samples a step, lr 1.5) where measured,
    else our one-sample-a-step row; the A4g64 rows (ours: the best Hadamard row's activations, at the
    paper's rate and at 0.1) are reported beside it."""
    r = rows_by_name(res)
    s = r[PAPER_SPIN] if PAPER_SPIN in r else r["gptq W4A4 +spinquant"]
    gain, nums = _learned_vs_hadamard(r, s, ALONE)
    for name in ("gptq W4A4g64c0.9 +spinquant:batch=8", "gptq W4A4g64c0.9 +spinquant:lr=0.1,batch=8"):
        if name in r:
            g, txt = _learned_vs_hadamard(r, r[name], "gptq W4A4g64c0.9 +hadamard")
            nums += f"; A4g64c0.9 (ours), {r[name]['rotate']}: {txt}"
    return nums, verdict(gain >= 0.01)


def _learned_vs_hadamard(r: dict, s: dict, hadamard: str) -> tuple[float, str]:
    """(perplexity gain, text) of the learned row ``s`` over ``hadamard`` run on the same device."""
    h, where = _beside(r, hadamard, s)
    txt = (f"learned {fmt(s['ppl'])} (KL {s['kl_mean']:.3f}, top-1 {s['top1_agreement']:.3f}) vs Hadamard "
           f"{fmt(h['ppl'])} (KL {h['kl_mean']:.3f}, top-1 {h['top1_agreement']:.3f}){where}")  # fmt: skip
    gain = 1 - s["ppl"] / h["ppl"]
    return gain, txt + f" ({gain:+.1%})"


def _beside(r: dict, name: str, row: dict) -> tuple[dict, str]:
    """The baseline ``name`` run on ``row``'s device (``"NAME @DEVICE"`` where the table has one, else
    ``name``), and a note when the devices still differ (GPTQ's decisions follow float rounding)."""
    dev = row.get("device", "cpu")
    base = r.get(f"{name} @{dev}") or r[name]
    other = base.get("device", "cpu")
    return base, "" if other == dev else f" (run on {dev} vs {other})"
