"""Findings-report judges of the Babai / GPTQ-geometry paper (Thm. 4-5, HPTQ, SSQR)."""

from __future__ import annotations

import math

from benchmarks.findings.findings_lib import HOLDS, MISSING, fmt, rows_by_name, verdict


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


PAPER_GPTQ = ("gptq w3 g128 act mse static", "gptq w4 g128 act mse static")  # Babai paper §3, App. D.2


def _at_bits(bits: float, points: list[tuple[float, float]]) -> float:
    """``points`` (bits, value) interpolated at ``bits``, linear in log(value) between the two that
    bracket it (the nearest one outside their range: no extrapolation)."""
    pts = sorted(points)
    if bits <= pts[0][0] or bits >= pts[-1][0]:
        return min(pts, key=lambda p: abs(p[0] - bits))[1]
    (x0, y0), (x1, y1) = next((a, b) for a, b in zip(pts, pts[1:], strict=False) if a[0] <= bits <= b[0])
    t = (bits - x0) / (x1 - x0)
    return math.exp((1 - t) * math.log(y0) + t * math.log(y1))


def ssqr_vs_gptq(res: dict) -> tuple[str, str]:
    """The paper's comparison (Table 3): SSQR (static groups, Algorithm 9) against its GPTQ baseline
    (act-order, static MSE scales, g128) on the perplexity-vs-bits curve, bits counted as the paper
    counts them (``paper_bpw``: symmetric, no zero, no g_idx, 32 bits per outlier); GPTQ's w3 and w4
    rows are interpolated (log-linear) at SSQR's bits.  Judged on perplexity and on KL to the float
    model from the same pass: where the two disagree, the protocol cannot decide.  Judged so, the
    paper's own Table 3 (Qwen3-8B, WikiText-2) has SSQR-1% and -2% at 3-bit inliers below its GPTQ
    curve (10.64 vs 11.85, 10.57 vs 10.99) but SSQR-3% above it (10.42 vs 10.20 at 4.085 bits)."""
    r = rows_by_name(res)
    base = {k: r[k] for k in PAPER_GPTQ if k in r}
    ssqr = [v for k, v in r.items() if k.startswith("ssqr") and k.endswith("static")]
    if not base or not ssqr:
        rows = ",".join([*PAPER_GPTQ, "ssqr w3 g128 3% static"])
        how = f"python -m benchmarks.lattice.ssqr_groups --protocol fast --fidelity --only '{rows}'"
        return "", f"{MISSING}: run {how}"
    has_kl = all("kl_mean" in v for v in [*base.values(), *ssqr])
    lines, wins = [], []
    for s in ssqr:
        x = s["paper_bpw"]
        ppl = _at_bits(x, [(g["paper_bpw"], g["ppl"]) for g in base.values()])
        ok = [s["ppl"] < ppl]
        line = f"{s['name']} @ {fmt(x, 3)} paper bpw: ppl {fmt(s['ppl'])} vs GPTQ {fmt(ppl)}"
        if has_kl:
            kl = _at_bits(x, [(g["paper_bpw"], g["kl_mean"]) for g in base.values()])
            ok.append(s["kl_mean"] < kl)
            line += f", KL {fmt(s['kl_mean'], 4)} vs {fmt(kl, 4)}"
        won = res.get("layer_wins", {}).get(s["name"], {}).get(PAPER_GPTQ[0])
        over = s.get("overflow_a1_mean")
        line += (f"; lower error than GPTQ w3 in {won} layers" if won else "") + (
            f"; overflow at α=1 {over:.1%} mean, {s['overflow_a1_max']:.1%} max" if over is not None else ""
        )
        lines.append(line)
        wins.append(ok)
    g = "; ".join(f"{k.split()[1]} {fmt(v['ppl'])} @ {fmt(v['paper_bpw'], 3)}" for k, v in base.items())
    nums = "; ".join(lines) + f" (GPTQ static: {g})"
    below = [s["paper_bpw"] < max(v["paper_bpw"] for v in base.values()) for s in ssqr]
    if len(base) < len(PAPER_GPTQ) and not (any(not any(w) for w in wins) and not any(below)):
        # one GPTQ width only: decided only where SSQR, with more bits than it, still loses
        return nums, f"{MISSING}: the row {next(k for k in PAPER_GPTQ if k not in base)} (equal bits)"
    if all(all(w) for w in wins):
        return nums, HOLDS
    if any(not any(w) for w in wins):
        return nums, verdict(False, "above the paper's GPTQ curve at its own bit count")
    return nums, "undecided here (perplexity and KL disagree: needs the verdict protocol)"
