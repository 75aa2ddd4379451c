"""The claims of the five papers, each judged from the JSON its method's benchmark wrote
(``benchmarks/results/<source>.json``).  A judge returns (numbers, verdict); adding a claim is one
``Finding`` line in ``FINDINGS``."""

from __future__ import annotations

import math
from functools import partial

from findings_lib import HOLDS, MISSING, UNTESTABLE, Finding, fmt, load, ppl_fid, rows_by_name, verdict

from bitmosaic.formats.sq import parse_sq


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
        return "", f"{MISSING}: run benchmarks/ssqr_groups.py --protocol fast --fidelity --only '{rows}'"
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


# -- DPQ (paper 003) ----------------------------------------------------------------------------
def dpq_vs_baselines(res: dict) -> tuple[str, str]:
    r = rows_by_name(res)
    d, n, rt = r["W4A8 dpq gar"], r["W4A8 naive gptq gar"], r["W4A8 rtn"]
    nums = f"DPQ {ppl_fid(d)}, naive GPTQ {ppl_fid(n)}, RTN {ppl_fid(rt)} (W4A8-FP8, g128)"
    if "W4A8 naive gptq no reorder" in r:  # the paper does not say its naive baseline reordered
        nums += f"; naive GPTQ without reordering {ppl_fid(r['W4A8 naive gptq no reorder'])}"
    gain = (n["ppl"] - d["ppl"]) / n["ppl"]  # under 1% is no meaningful gain on 20 windows
    ok = gain >= 0.01 and d["ppl"] < rt["ppl"]
    return nums + f"; vs naive {gain:+.1%}", verdict(ok, "vs RTN yes, vs naive GPTQ no meaningful gain")


def dpq_gar_vs_act(res: dict) -> tuple[str, str]:
    r = rows_by_name(res)
    g, a, nat = r["W4A8 dpq gar"], r["W4A8 dpq act-order"], r["W4A8 dpq no reorder"]
    nums = (
        f"GAR {fmt(g['ppl'])} @ {fmt(g['bits_per_weight'], 3)} bpw (no g_idx), act-order "
        f"{fmt(a['ppl'])} @ {fmt(a['bits_per_weight'], 3)}, natural {fmt(nat['ppl'])}"
    )
    # the paper: GAR keeps most of act-order's gain without the g_idx gather
    gain_kept = (nat["ppl"] - g["ppl"]) / max(nat["ppl"] - a["ppl"], 1e-9)
    return nums + f"; GAR keeps {gain_kept:.0%} of act-order's gain", verdict(gain_kept >= 0.8)


B = "Babai (GPTQ geometry)"


# -- SQ-format (paper 000) ---------------------------------------------------------------------
def _sq_rows(res: dict, part: str) -> dict[str, dict]:
    return {r["name"]: r for r in res["rows"] if r.get("part") == part}


_SQ6 = "W4A(SQ6) 16-(8/4)-0.5"
_W_SQ_A4 = ("W(SQ4.5)A4 64-(8/4)-0.9375", "W(SQ5)A4 64-(8/4)-0.875", "W(SQ6)A4 32-(8/4)-0.75")


def _sq_scale_ppl(res: dict, strategy: str, scale: str) -> float:
    """W4A(SQ6) 16-(8/4)-0.5 with ``strategy`` and activation ``scale`` (token | bank | group128, and
    ``/calibrated``) from part scales; per-token rows fall back to part acts (the same model)."""
    r = _sq_rows(res, "scales")
    k = f"{_SQ6} {strategy} scales={scale}"
    if k in r:
        return r[k]["ppl"]
    if scale == "token":
        return _sq_rows(res, "acts")[f"{_SQ6} {strategy}"]["ppl"]
    raise KeyError(k)


def sq_between_a4_a8(res: dict) -> tuple[str, str]:
    """Table 1 / Fig. 5: W4A(SQ) bridges W4A8 and W4A4 (on par with W4A8 or between the two).  The
    paper's W4A4 (GPTQ) does not collapse, so the A4 bound is W4A4 with A4 per group of 128 where
    measured (per-token INT4 collapses this model), and the SQ rows are those with per-bank
    activation scales (the granularity the paper's tables fit)."""
    r, g = _sq_rows(res, "acts"), _sq_rows(res, "a4group")
    a8, a4_tok = r["W4A8"]["ppl"], r["W4A4"]["ppl"]
    a4 = g["W4A4 a4-g128"]["ppl"] if "W4A4 a4-g128" in g else a4_tok
    sq = {k: v["ppl"] for k, v in _sq_rows(res, "scales").items() if k.endswith("scales=bank")}
    if not sq:  # before issue 25: per-token scales only
        sq = {k: v["ppl"] for k, v in r.items() if k.startswith("W4A(SQ")}
    # below W4A8 counts as inside: the paper has W4A(SQ6) on par with GPTQ W4A8 (7.97 vs 7.98, Llama-3-8B)
    inside = [k for k, p in sq.items() if p <= a4]
    below = [k for k, p in sq.items() if p < a8]
    bound = f"W4A4 (A4 per group of 128) {fmt(a4)}, per-token" if a4 != a4_tok else "W4A4"
    nums = f"W4A8 {fmt(a8)}, {bound} {fmt(a4_tok)}; " + ", ".join(f"{k} {fmt(p)}" for k, p in sq.items())
    nums += f"; {len(below)} of {len(sq)} below W4A8" if below else ""
    return nums, verdict(len(inside) == len(sq), f"{len(sq) - len(inside)} setting(s) worse than W4A4")


def sq_static_close_at_84(res: dict) -> tuple[str, str]:
    """Table 2: static ≈ dynamic at 16-(8/4)-0.5, judged with per-bank activation scales (both
    strategies; the granularity the paper's tables fit); per token, per 128 channels and calibrated
    static scales reported."""
    lines, gaps = [], {}
    for sc in ("token", "bank", "group128"):
        try:
            d, st = _sq_scale_ppl(res, "dynamic", sc), _sq_scale_ppl(res, "static", sc)
        except KeyError:
            continue
        gaps[sc] = st / d - 1
        lines.append(f"scales per {sc}: dynamic {fmt(d)}, static {fmt(st)} ({gaps[sc]:+.1%})")
    scales = _sq_rows(res, "scales")
    for sc in ("bank", "group128"):
        k = f"{_SQ6} static scales={sc}/calibrated"
        if k in scales:
            lines.append(f"static, calibrated {sc} scales {fmt(scales[k]['ppl'])}")
    if "bank" not in gaps:
        raise KeyError("sq_format part scales: W4A(SQ6) dynamic/static with per-bank scales")
    return "(8/4) b16 s0.5: " + "; ".join(lines), verdict(gaps["bank"] <= 0.05, "static over 5% worse")


def sq_weights_improve_as_s_falls(res: dict) -> tuple[str, str]:
    """Table 1: W(SQ)A4 improves as s falls (W(SQ4.5) -> W(SQ5) -> W(SQ6)).  Judged with A4 per
    group of 64 and of 128 channels (per-token INT4 collapses this model); per-token A4, A8 and A16
    (the weight side alone) reported, and the W(SQ5) bank sweep (16 vs 64) at each A4 group."""
    g, w = _sq_rows(res, "a4group"), _sq_rows(res, "weights")
    ppl = {}
    for G in (64, 128):
        names = [f"{k} a4-g{G}" for k in _W_SQ_A4]
        if all(n in g for n in names):
            ppl[f"A4 g{G}"] = [g[n]["ppl"] for n in names]
    if not ppl:
        raise KeyError("sq_format part a4group: W(SQ)A4 with group-wise A4")
    judged = list(ppl)
    for a in ("A4", "A8", "A16"):  # part weights: per-token A4 (collapses), A8, A16
        names = [k.replace("A4 ", f"{a} ") for k in _W_SQ_A4]
        if all(n in w for n in names):
            ppl[f"{a} per token" if a == "A4" else a] = [w[n]["ppl"] for n in names]
    nums = "s 0.9375 / 0.875 / 0.75 -> " + "; ".join(
        f"{a}: " + " / ".join(fmt(p) for p in v) for a, v in ppl.items()
    )
    banks = [f"A4 g{G}: b16 {fmt(g[f'W(SQ5)A4 16-(8/4)-0.875 a4-g{G}']['ppl'])} vs b64 "
             f"{fmt(g[f'W(SQ5)A4 64-(8/4)-0.875 a4-g{G}']['ppl'])}"
             for G in (64, 128) if f"W(SQ5)A4 16-(8/4)-0.875 a4-g{G}" in g]  # fmt: skip
    if banks:
        nums += "; W(SQ5) bank sweep " + ", ".join(banks)
    mono = {a: v[0] > v[1] > v[2] for a, v in ppl.items()}
    bad = [a for a in judged if not mono[a]]
    return nums, verdict(not bad, f"not monotone at {', '.join(bad)}")


def sq_w_sq_a4_beats_w4a4(res: dict) -> tuple[str, str]:
    """Table 1 (W4A4 vs W(SQ)A4): every W(SQ)A4 beats W4A4 at the same group-wise A4 (the paper's
    comparator is GPTQ W4A4; ours is the same smoothed GPTQ W4 weights every activation row uses)."""
    g = _sq_rows(res, "a4group")
    lines, worse = [], []
    for G in (64, 128):
        base = g.get(f"W4A4 a4-g{G}")
        rows = {k: g.get(f"{k} a4-g{G}") for k in _W_SQ_A4}
        if base is None or None in rows.values():
            continue
        each = [f"{k.split()[0]} {fmt(v['ppl'])} @ {fmt(v['measured_bits'])} bpw" for k, v in rows.items()]
        lines.append(f"A4 g{G}: W4A4 {fmt(base['ppl'])}, " + ", ".join(each))
        worse += [f"{k.split()[0]} g{G}" for k, v in rows.items() if v["ppl"] >= base["ppl"]]
    if not lines:
        raise KeyError("sq_format part a4group: W4A4 and W(SQ)A4 with group-wise A4")
    return "; ".join(lines), verdict(not worse, f"{', '.join(worse)} not better than W4A4")


# -- MosaicQuant (paper 002) --------------------------------------------------------------------
def mosaic_a4_no_collapse(res: dict) -> tuple[str, str]:
    r = rows_by_name(res)
    m, sq_, rt, g = r["mosaic W4A4"], r["smoothquant W4A4"], r["rtn W4A4"], r["gptq W4A4"]
    fl = r["float"]["ppl"]
    nums = (f"W4A4: MosaicQuant {fmt(m['ppl'])} @ {fmt(m['bits_per_weight'], 3)} bpw, SmoothQuant "
            f"{fmt(sq_['ppl'])}, GPTQ {fmt(g['ppl'])}, RTN {fmt(rt['ppl'])} (float {fmt(fl)})")  # fmt: skip
    # the paper's comparators are RTN and SmoothQuant (GPTQ is our extra number); its success: lower ppl
    ok = m["ppl"] < min(sq_["ppl"], rt["ppl"])
    return nums + f"; {m['ppl'] / fl:.2f}x float" + _wide_alpha("W4A4"), verdict(ok)


def _wide_alpha(scheme: str) -> str:
    """MosaicQuant with SmoothQuant's α grid (0-1 in steps of 0.05, plus no smoothing), when run."""
    name = "alpha 0-1/0.05 + none" + ("" if scheme == "W4A4" else f" {scheme}")
    row = rows_by_name(load("mosaic_search") or {"rows": []}).get(name)
    return f"; with α over 0-1/0.05 + none: {fmt(row['ppl'])}" if row else ""


def mosaic_w4a8(res: dict) -> tuple[str, str]:
    """The paper's W4A8 comparison: MosaicQuant against RTN and SmoothQuant."""
    r = rows_by_name(res)
    m, sq_, rt = r["mosaic W4A8"], r["smoothquant W4A8"], r["rtn W4A8"]
    nums = f"W4A8: MosaicQuant {fmt(m['ppl'])}, SmoothQuant {fmt(sq_['ppl'])}, RTN {fmt(rt['ppl'])}"
    return nums + _wide_alpha("W4A8"), verdict(m["ppl"] < min(sq_["ppl"], rt["ppl"]))


def mosaic_w4a8_vs_gptq(res: dict) -> tuple[str, str]:
    """Ours, not the paper's claim: MosaicQuant against GPTQ at W4A8."""
    r = rows_by_name(res)
    m, g = r["mosaic W4A8"], r["gptq W4A8"]
    nums = f"W4A8: MosaicQuant {fmt(m['ppl'])}, GPTQ {fmt(g['ppl'])}" + _wide_alpha("W4A8")
    return nums, verdict(m["ppl"] < g["ppl"], "GPTQ's dense base beats it")


# -- SFMP (paper 001) ---------------------------------------------------------------------------
def _sfmp_main(res: dict) -> dict[str, dict[str, dict]]:
    """point -> {name: row} for the main rows (not the ablations, whose names hold a '=')."""
    by_point: dict[str, dict[str, dict]] = {}
    for r in res["rows"]:
        point, _, name = r["name"].partition(" ")
        if r["method"] != "float" and "=" not in name:
            by_point.setdefault(point, {})[name] = r
    return by_point


PAPER_UNIFORM = ("gptq-orig", "awq")  # the paper's Table 3 comparators: GPTQ (natural, min-max), AWQ


def sfmp_beats_uniform(
    res: dict, solver: str = "awq", uniform: tuple[str, ...] = PAPER_UNIFORM
) -> tuple[str, str]:
    """At each measured budget: the SFMP rows of ``solver`` (awq: the paper's; gptq: our extension)
    against the ``uniform`` rows (default the paper's comparators; ``("gptq",)``: our act-order + MSE
    GPTQ) of the same protocol using no fewer bits."""
    lines, wins, total, close, pts, lacking = [], 0, 0, 0, [], {}
    for point, rows in _sfmp_main(res).items():
        uni = {k: v for k, v in rows.items() if v["method"] != "sfmp" and k.split()[0] in uniform}
        for u in uniform:
            if not any(k.split()[0] == u for k in uni):
                lacking.setdefault(u, []).append(point)
        for k, v in rows.items():
            if v["method"] != "sfmp" or not k.startswith(f"sfmp-{solver} "):
                continue
            pts.append(point)
            fair = {u: w for u, w in uni.items() if w["bits_per_weight"] >= v["bits_per_weight"] - 1e-9
                    and w.get("protocol") == v.get("protocol")}  # fmt: skip
            for u, w in fair.items():
                total += 1
                wins += v["ppl"] < w["ppl"]
                close += bool(_sfmp_undecided([v, w]))
                lines.append(f"BPW {point}: {k} {fmt(v['ppl'])} @ {fmt(v['bits_per_weight'], 3)} vs {u} "
                             f"{fmt(w['ppl'])} @ {fmt(w['bits_per_weight'], 3)}")  # fmt: skip
    if not total:
        return "", f"{MISSING}: no SFMP-{solver} row with a {'/'.join(uniform)} row of at least its size"
    v = verdict(wins == total, f"{wins}/{total} wins")
    if len(pts) < 6:  # the issue asks for 2.5, 3.0, 3.25, 3.5, 4.0 and 4.25
        v += f" at BPW {', '.join(sorted(pts))} only; the other budgets are not measured"
    for u, at in lacking.items():
        v += f"; {u} not measured at BPW {', '.join(sorted(at))}"
    if close:
        v += f"; {close} of the {total} pairs are under 10% apart without the verdict protocol"
    return "; ".join(lines), v


def sfmp_gptq_beats_awq(res: dict) -> tuple[str, str]:
    """Our extension: the same allocation, blocks solved by GPTQ instead of AWQ, at the same BPW."""
    cells, wins = [], 0
    for point, rows in _sfmp_main(res).items():
        a = next((v for k, v in rows.items() if k.startswith("sfmp-awq ")), None)
        g = next((v for k, v in rows.items() if k.startswith("sfmp-gptq ")), None)
        if a and g:
            cells.append(f"BPW {point}: GPTQ {fmt(g['ppl'])} vs AWQ {fmt(a['ppl'])}")
            wins += g["ppl"] < a["ppl"]
    if not cells:
        return "", f"{MISSING}: no point with both SFMP solvers"
    return "; ".join(cells), verdict(wins == len(cells), f"{wins}/{len(cells)} wins")


def _sfmp_ablation(res: dict, key: str) -> tuple[dict[str, dict[str, dict]], str]:
    """``{head: {label: row}}`` of the ablation rows named ``head key=label`` (a row named ``head``
    itself is label ``""``), preferring the rows at equal code bits (names with ``b=``) and falling
    back to the earlier ones at equal total bits; and which of the two it is."""
    for code in (True, False):
        cells: dict[str, dict[str, dict]] = {}
        for v in res["rows"]:
            if v["method"] != "sfmp" or (" b=" in v["name"]) != code:
                continue
            head, _, label = v["name"].partition(f" {key}=")
            if label or code:
                cells.setdefault(head, {})[label] = v
        cells = {h: c for h, c in cells.items() if len(c) > 1}
        if cells:
            return cells, "equal code bits" if code else "equal total bits"
    raise KeyError(f"{key} rows")


def _sfmp_row(v: dict) -> str:
    return f"{fmt(v['ppl'])} @ {fmt(v['bits_per_weight'], 3)} bpw"


def _sfmp_undecided(rows: list[dict]) -> str:
    """A note when ``rows`` differ by under 10% in perplexity without the verdict protocol (issue 25:
    such claims need the whole test set and two seeds)."""
    ppl = [r["ppl"] for r in rows]
    gap = max(ppl) / min(ppl) - 1
    if gap >= 0.10 or all(r.get("protocol") == "verdict" for r in rows):
        return ""
    where = rows[0].get("protocol", "unrecorded")
    return f" ({gap:.1%} apart on the {where} protocol: too close to decide there)"


def sfmp_fisher_samples(res: dict) -> tuple[str, str]:
    """Fisher from the most samples (>= 128) gives an allocation at least as good as from the fewest
    (ppl lower, or within 1%); the estimation's cost beside each."""
    cells, how = _sfmp_ablation(res, "fisher")
    parts, fails, notes = [], [], []
    for head, c in cells.items():
        r = {int(k): v for k, v in c.items() if k}
        if len(r) < 2:
            continue
        lo, hi = min(r), max(r)
        nums = ", ".join(f"{n} samples {_sfmp_row(v)}, Fisher {fmt(v['fisher_seconds'] or 0, 0)} s"
                         for n, v in sorted(r.items()))  # fmt: skip
        if "" in c:
            nums += f"; the calibration's {c['']['fisher_samples']}: {_sfmp_row(c[''])}"
        parts.append(f"{head} ({how}): {nums}")
        if hi < 128 or r[hi]["ppl"] > r[lo]["ppl"] * 1.01:
            fails.append(f"{hi} samples worse than {lo}" if hi >= 128 else f"only {hi} samples")
        notes.append(_sfmp_undecided(list(r.values())))
    if not parts:
        raise KeyError("fisher rows")
    return "; ".join(parts), verdict(not fails, "; ".join(fails)) + "".join(notes)


def sfmp_small_blocks(res: dict) -> tuple[str, str]:
    """Finer allocation blocks (smaller m_b, n_b = the group) lower perplexity at equal code bits
    (earlier rows: at equal total bits, n_b = 128): perplexity does not rise as m_b falls."""
    for code in (True, False):  # the rows at equal code bits where two m_b are measured, else the earlier
        groups: dict[str, dict[int, dict]] = {}
        for v in res["rows"]:
            n = v["name"]
            if v["method"] != "sfmp" or "mb=" not in n or any(k in n for k in ("reorder=", "fisher=")):
                continue
            if code and (" b=" not in n or " nb=" in n) or not code and (" b=" in n or "nb=128" not in n):
                continue
            head, _, rest = n.partition(" mb=")
            mb, _, tail = rest.partition(" ")
            groups.setdefault(f"{head} {tail}".strip(), {})[int(mb)] = v
        groups = {h: g for h, g in groups.items() if len(g) > 1}
        if groups:
            break
    if not groups:
        raise KeyError("block rows")
    parts, fails, notes = [], [], []
    for head, r in groups.items():
        parts.append(f"{head} ({'equal code bits' if code else 'equal total bits'}): "
                     + ", ".join(f"m_b {m}: {_sfmp_row(v)}" for m, v in sorted(r.items())))  # fmt: skip
        ppl = [r[m]["ppl"] for m in sorted(r)]
        if ppl != sorted(ppl):
            fails.append(head)
        notes.append(_sfmp_undecided(list(r.values())))
    return "; ".join(parts), verdict(not fails, "perplexity does not fall with m_b") + "".join(notes)


# -- more SQ-format claims (parts gap, agrid, ablate of sq_format.py) ---------------------------
def _first(values, what: str):
    """The first of ``values``; KeyError (the report's "not measured") when there is none."""
    for v in values:
        return v
    raise KeyError(what)


def _sq_ppl(rows: dict[str, dict], sq: str, strategy: str) -> float:
    return _first((v["ppl"] for k, v in rows.items() if f" {sq} " in f" {k} " and k.endswith(strategy)), sq)


def sq_static_falls_at_int2(res: dict) -> tuple[str, str]:
    r = _sq_rows(res, "gap")
    gaps = {}
    for low in (4, 3, 2):
        sq = f"16-(8/{low})-0.5"
        d, st = _sq_ppl(r, sq, "dynamic"), _sq_ppl(r, sq, "static")
        gaps[low] = (d, st, st / d - 1)
    nums = "; ".join(
        f"(8/{k}): dynamic {fmt(d)}, static {fmt(st)} ({g:+.0%})" for k, (d, st, g) in gaps.items()
    )
    ok = gaps[2][2] > gaps[3][2] > gaps[4][2]
    return nums, verdict(ok, "the static-dynamic gap does not widen steadily towards INT2")


def sq_static_small_banks(res: dict) -> tuple[str, str]:
    """At each sparsity, the bank chosen by calibration loss (test perplexity only reported)."""
    rows = [v for v in res["rows"] if v.get("part") == "agrid" and v["name"].endswith("static")]
    by_s: dict[str, list[tuple[int, dict]]] = {}
    for v in rows:
        f = parse_sq(v["name"].split()[1])  # "W4A(SQ) 16-(8/4)-0.5 static"
        by_s.setdefault(f"{f.sparsity:g}", []).append((f.bank, v))
    if not by_s:
        raise KeyError("agrid rows")
    lines, ok = [], True
    for s, cells in sorted(by_s.items()):
        cells.sort(key=lambda c: c[0])
        best = min(cells, key=lambda c: c[1]["calib_loss"])
        lines.append(
            f"s={s}: "
            + ", ".join(f"b{b} {fmt(v['ppl'])}" for b, v in cells)
            + f" (chosen by calib loss: b{best[0]})"
        )
        ok &= best[0] <= min(b for b, _ in cells) * 2  # one of the two smallest banks
    return "; ".join(lines), verdict(ok, "a larger bank has the lowest calibration loss")


def sq_importance_ablation(res: dict) -> tuple[str, str]:
    r = _sq_rows(res, "ablate")
    imps = ("aw", "abs-aw", "a")
    p = {i: _first((v["ppl"] for k, v in r.items() if k.endswith(f"I={i}")), i) for i in imps}
    nums = (
        f"static W4A(SQ6) b16: I=|A·ΣW| {fmt(p['aw'])}, mean|A|·Σ|W| {fmt(p['abs-aw'])}, "
        f"|A| alone {fmt(p['a'])}"
    )
    return nums, verdict(p["a"] > 1.1 * p["aw"], "|A| alone is within 10% of the paper's importance")


# -- more MosaicQuant claims (mosaic_layers.json, mosaic_ablation/sweep.json, mosaic_kernel.json) --
def _mosaic_linears(res: dict) -> list[dict]:
    return [v for L in res["layers"].values() for v in L["linears"].values()]


def _at(res: dict, crit: str, budget: float) -> float:
    i = res["budgets"].index(budget)
    lin = _mosaic_linears(res)
    return sum(v["curves"][crit][i] for v in lin) / len(lin)


def mosaic_blocks_not_stripes(res: dict) -> tuple[str, str]:
    lin = _mosaic_linears(res)
    blk = sum(v["top10_blocks_share_diag"] for v in lin) / len(lin)
    col = sum(v["same_elements_columns_share_diag"] for v in lin) / len(lin)
    nums = (
        f"share of the diagonal residual distortion in the top 10% of 64x64 blocks {blk:.1%} vs in the "
        f"top input columns of the same element count {col:.1%} (mean of {len(lin)} linears, layers "
        f"{', '.join(res['layers'])})"
    )
    return nums, verdict(blk > col, "column stripes hold as much distortion as blocks")


def mosaic_ten_percent_half(res: dict) -> tuple[str, str]:
    """§3 Observation 3: output-aware selection (the greedy oracle of Fig. 2b) recovers over half of
    a layer's output distortion at 10% of blocks (55% and 63% on the paper's two layers).  Judged on
    the mean over linears; the largest linear and the global allocation are reported beside it."""
    i = res["budgets"].index(0.1)
    lin = {f"{li}.{k}": v for li, L in res["layers"].items() for k, v in L["linears"].items()}
    orc = {k: v["curves"]["oracle"][i] for k, v in lin.items()}
    best = max(orc, key=orc.get)
    r, o = _at(res, "delta-hessian", 0.1), sum(orc.values()) / len(orc)
    glob = ", ".join(f"layer {li} {L['global_top10_recovered']:.1%}" for li, L in res["layers"].items())
    nums = (f"exact ΔD/‖RXᵀ‖² at 10% of blocks, mean of {len(lin)} linears: greedy oracle {o:.1%}, Δ-Hessian "
            f"{r:.1%}; largest linear (oracle) {orc[best]:.1%} ({best}); one 10% budget over each layer's "
            f"7 matrices (global Δ-Hessian allocation, ours): {glob}")  # fmt: skip
    return nums, verdict(o > 0.5, "10% of blocks recovers less than half, even for the oracle")


def mosaic_block_beats_channel(res: dict) -> tuple[str, str]:
    """§3 Observation 1 / Fig. 5: Δ-Hessian blocks beat channel-level compensation at the same budget.
    The paper's comparator is its naive channel strategy (outlier channels, here by the float input's
    max abs(X_j)); our stronger Δ-Hessian columns are an extra number.  Channel residuals are stored as
    dense columns, so each row's bits per weight are what it stores."""
    if "channel-act" not in _mosaic_linears(res)[0]["curves"]:
        return "the per-linear results predate the paper's channel baseline", MISSING
    b, c, ours = _at(res, "delta-hessian", 0.1), _at(res, "channel-act", 0.1), _at(res, "channel", 0.1)
    nums = (f"recovered at 10% (same elements): blocks by Δ-Hessian {b:.1%}, the paper's outlier channels "
            f"(max abs(X_j)) {c:.1%}, ours: columns by Δ-Hessian {ours:.1%}")  # fmt: skip
    ch = rows_by_name(load("mosaic_channel") or {"rows": []})
    mo = rows_by_name(load("mosaic_main") or {"rows": []}).get("mosaic W4A4")
    paper, mine = ch.get("channel (paper: outlier max|X|)"), ch.get("channel (ours: Δ-Hessian columns)")
    if not (paper and mo):
        return nums, verdict(b > c, "whole outlier channels recover as much or more")
    nums += (f"; W4A4 ppl (fast): blocks {fmt(mo['ppl'])} @ {fmt(mo['bits_per_weight'], 3)} bpw, paper's "
             f"channels {fmt(paper['ppl'])} @ {fmt(paper['bits_per_weight'], 3)} bpw")  # fmt: skip
    if mine:
        nums += f", ours {fmt(mine['ppl'])} @ {fmt(mine['bits_per_weight'], 3)} bpw"
    thin = rows_by_name(load("mosaic_thin") or {"rows": []}).get("block 1x128")
    if thin:
        nums += f"; 1x128 blocks (ours) {fmt(thin['ppl'])} @ {fmt(thin['bits_per_weight'], 3)} bpw"
    return nums, verdict(b > c and mo["ppl"] < paper["ppl"], "whole outlier channels recover as much or more")


def mosaic_selection_ablation(res: dict) -> tuple[str, str]:
    """W4A4 perplexity: the Δ-Hessian selection (the main table's row) against the other block
    criteria and no sparse branch, at the same 10% budget."""
    r = rows_by_name(res)
    main = rows_by_name(load("mosaic_main") or {"rows": []})["mosaic W4A4"]
    others = ["magnitude", "residual norm", "random", "no sparse, alpha re-searched", "no sparse, alpha kept"]
    nums = f"W4A4 ppl: Δ-Hessian {fmt(main['ppl'])}; " + ", ".join(f"{k} {fmt(r[k]['ppl'])}" for k in others)
    gq = r.get("Δ-Hessian, GPTQ base (ours)")
    if gq:
        nums += f"; with a GPTQ dense base (ours) {fmt(gq['ppl'])}"
    return nums, verdict(all(main["ppl"] < r[k]["ppl"] for k in others))


def mosaic_diminishing(res: dict) -> tuple[str, str]:
    """Diminishing returns: the mean slope of the recovered-distortion curve falls from one roughly
    doubling budget range to the next (0-5%, 5-10%, 10-20%, 20-50%)."""
    bud = res["budgets"]
    vals = [_at(res, "delta-hessian", x) for x in bud]
    nums = "Δ-Hessian recovered vs budget: " + ", ".join(
        f"{100 * x:g}% {v:.1%}" for x, v in zip(bud, vals, strict=True)
    )
    knots = [x for x in (0.0, 0.05, 0.1, 0.2, 0.5) if x in bud]
    at = dict(zip(bud, vals, strict=True))
    slopes = [(at[b] - at[a]) / (b - a) for a, b in zip(knots, knots[1:], strict=False)]
    nums += "; mean slope per range " + ", ".join(f"{s:.2f}" for s in slopes)
    sw = load("mosaic_sweep")
    if sw:
        nums += "; W4A4 ppl: " + ", ".join(f"{r['name']} {fmt(r['ppl'])}" for r in sw["rows"])
    ok = len(slopes) >= 3 and all(b < a for a, b in zip(slopes, slopes[1:], strict=False))
    return nums, verdict(ok, "the slope does not fall from range to range")


def mosaic_atom_like(res: dict) -> tuple[str, str]:
    """Table 1's Atom comparison, per linear: W4A4 output error of MosaicQuant (10%) against an
    Atom-like layer at Atom's 3.1% INT8 channels with GPTQ g128 INT4 weights; both bits reported."""
    lin = _mosaic_linears(res)
    if "atom_weight_bpw" not in lin[0]:
        return "the per-linear results predate the 3.1% Atom-like baseline", MISSING

    def mean(k):
        return sum(v[k] for v in lin) / len(lin)

    wins = sum(v["mosaic_w4a4_rel_err"] < v["atom_like_w4a4_rel_err"] for v in lin)
    m, a = mean("mosaic_w4a4_rel_err"), mean("atom_like_w4a4_rel_err")
    nums = (
        f"W4A4 relative output error (mean of {len(lin)} linears): MosaicQuant {m:.4f} @ "
        f"{mean('mosaic_weight_bpw'):.3f} weight bpw / {mean('mosaic_act_bits'):.3f} activation bits, "
        f"Atom-like (3.1% INT8 channels, GPTQ g128) {a:.4f} @ {mean('atom_weight_bpw'):.3f} / "
        f"{mean('atom_act_bits'):.3f}; MosaicQuant lower on {wins}/{len(lin)}"
    )
    return nums, verdict(wins > len(lin) / 2, "the Atom-like layer has the lower error on most linears")


def mosaic_thin_blocks(res: dict) -> tuple[str, str]:
    """Ours: thin residual blocks at the same 10% budget against the paper's square 64x64 blocks."""
    r = rows_by_name(res)
    mo = rows_by_name(load("mosaic_main") or {"rows": []}).get("mosaic W4A4")
    thin = [r[k] for k in ("block 8x128", "block 16x64", "block 1x128") if k in r]
    if not (mo and thin):
        return "no thin-block rows", MISSING
    nums = f"W4A4 ppl (fast): 64x64 {fmt(mo['ppl'])} @ {fmt(mo['bits_per_weight'], 3)} bpw; " + ", ".join(
        f"{t['name'].split()[-1]} {fmt(t['ppl'])} @ {fmt(t['bits_per_weight'], 3)} bpw" for t in thin
    )
    best = min(thin, key=lambda t: t["ppl"])
    return nums, verdict(best["ppl"] < mo["ppl"], "no thin shape beats 64x64")


def mosaic_fused_overhead(res: dict) -> tuple[str, str]:
    rows = [r for r in res["rows"] if r["shape"] in ("4096x4096", "1024x4096", "14336x4096")]
    nums = "CPU, 10% budget: " + ", ".join(
        f"{r['shape']} b{r['batch']} fused {r['fused_overhead']:+.0%} / 3-step "
        f"{r['three_step_overhead']:+.0%}"
        for r in rows
    )
    mem = rows[0]["memory_overhead"] if rows else float("nan")
    return nums + f"; memory +{mem:.1%}", f"{UNTESTABLE} (the ~5-6% is a GPU figure; no GPU was lent)"


# -- more SFMP claims ----------------------------------------------------------------------------
def sfmp_latency_linear(res: dict) -> tuple[str, str]:
    rows = [r for r in res["linearity"] if r["kernel"] == "lut" and r["shape"][0] >= 4096]
    nums = "LUT GEMV ms vs bits (1-8), batch 1: " + ", ".join(
        f"{r['shape'][0]}x{r['shape'][1]} t{r['threads']} R² {r['r2']:.3f}, W2/W4 {r['w2_over_w4']:.2f}"
        for r in rows
    )
    return nums, verdict(bool(rows) and min(r["r2"] for r in rows) >= 0.95, "R² < 0.95 on an 8B shape")


def sfmp_reorder_decode_cost(res: dict) -> tuple[str, str]:
    v = res["variants"]
    nums = ", ".join(f"{k} {x['tok_s']:.2f} tok/s" for k, x in v.items())
    cost = res["decode_cost_pct"]
    nums += f"; reorder costs {cost:.1f}% of decode speed (batch 1, {res['threads']} thread(s))"
    return nums, verdict(res["decode_cost_pct"] <= 5.0, "over 5%")


def sfmp_reorder_helps(res: dict) -> tuple[str, str]:
    """Per ablation head (solver, group, m_b, b): none / row / column against both (rows and columns),
    at equal code bits where measured (else the earlier rows at equal total bits, ``both`` = the main
    row).  The paper (Fig. 7, AWQ blocks): reordering helps, columns more than rows."""
    cells, how = _sfmp_ablation(res, "reorder")
    by = rows_by_name(res)
    parts, fails, solvers = [], [], set()
    for head, c in cells.items():
        if how == "equal total bits" and head in by:
            c[""] = by[head]
        if "none" not in c or "" not in c:
            continue
        c["both"] = c.pop("")
        solvers.add(head.split()[1])
        order = [k for k in ("none", "row", "col", "both") if k in c]
        parts.append(f"{head} ({how}): " + ", ".join(f"{k} {_sfmp_row(c[k])}" for k in order))
        if not c["both"]["ppl"] < c["none"]["ppl"]:
            fails.append(head)
    if not parts:
        raise KeyError("reorder rows")
    v = verdict(not fails, f"not for {', '.join(fails)}")
    if "sfmp-awq" not in solvers:
        v += " (GPTQ blocks, our default; the paper's AWQ blocks not measured at equal code bits)"
    return "; ".join(parts), v


# -- rotations (QuaRot; issue 25's goals: ours, not a claim of the five papers) ------------------------
ALONE = "gptq W4A4 +hadamard"  # rotation alone: QuaRot's GPTQ W4A4 (W4 per channel, A4 per token)


def rotation_w4a4_goal(res: dict) -> tuple[str, str]:
    r = rows_by_name(res)
    fl = r["float"]["ppl"]
    names = ["gptq W4A4", ALONE, "gptq W4A4c0.9 +hadamard", "gptq W4A4g64 +hadamard",
             "gptq W4A4g64c0.9 +hadamard"]  # fmt: skip
    nums = ", ".join(f"{n} {fmt(r[n]['ppl'])} ({r[n]['ppl'] / fl:.2f}x)" for n in names if n in r)
    best = min(r[n]["ppl"] for n in names[1:] if n in r)
    why = f"best rotated row {best / fl:.2f}x float"
    return f"{nums} (float {fmt(fl)}; goal 1.5x)", verdict(best <= 1.5 * fl, why)


def rotation_beats_alone(method_row: str, res: dict, alone: str = ALONE) -> tuple[str, str]:
    """``method_row`` with a Hadamard rotation against the rotation alone (GPTQ +hadamard with the same
    activations: per token, or ``alone``), and the same method without the rotation."""
    r = rows_by_name(res)
    m = r[method_row + " +hadamard"]
    dev = m.get("device", "cpu")
    alone = r.get(f"{alone} @{dev}") or r[alone]  # the same device's row where there is one
    plain = r.get(method_row)
    nums = (f"{method_row} +hadamard {fmt(m['ppl'])} @ {fmt(m['bits_per_weight'], 3)} bpw vs rotation alone "
            f"{fmt(alone['ppl'])} @ {fmt(alone['bits_per_weight'], 3)}"
            + (f"; without rotation {fmt(plain['ppl'])}" if plain else ""))  # fmt: skip
    if m.get("device", "cpu") != alone.get("device", "cpu"):
        nums += f" (run on {m.get('device', 'cpu')} vs {alone.get('device', 'cpu')})"
    gain = 1 - m["ppl"] / alone["ppl"]
    return nums + f" ({gain:+.1%})", verdict(gain >= 0.01, "within 1% of rotation alone" if gain > 0 else "")


Q = "QuaRot rotations (ours)"

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
    Finding(
        "SQ-format", "W(SQ)A4 improves as the sparsity s falls", "sq_format", sq_weights_improve_as_s_falls
    ),  # fmt: skip
    Finding("SQ-format", "W(SQ)A4 beats W4A4 (group-wise A4)", "sq_format", sq_w_sq_a4_beats_w4a4),
    Finding(
        "MosaicQuant",
        "W4A4 MosaicQuant beats the collapsing RTN and SmoothQuant",
        "mosaic_main",
        mosaic_a4_no_collapse,
    ),  # fmt: skip
    Finding("MosaicQuant", "MosaicQuant beats RTN and SmoothQuant at W4A8", "mosaic_main", mosaic_w4a8),
    Finding("MosaicQuant", "ours: MosaicQuant beats GPTQ at W4A8", "mosaic_main", mosaic_w4a8_vs_gptq),
    Finding("SQ-format", "static falls away from dynamic towards INT2", "sq_format", sq_static_falls_at_int2),
    Finding("SQ-format", "static SQ prefers small banks", "sq_format", sq_static_small_banks),
    Finding("SQ-format", "|Ā_j| alone as static importance degrades", "sq_format", sq_importance_ablation),
    Finding(
        "MosaicQuant",
        "distortion concentrates in blocks, not channel stripes",
        "mosaic_layers",
        mosaic_blocks_not_stripes,
    ),  # fmt: skip
    Finding(
        "MosaicQuant",
        "10% of blocks recovers over half the output distortion",
        "mosaic_layers",
        mosaic_ten_percent_half,
    ),  # fmt: skip
    Finding(
        "MosaicQuant", "block selection beats channel selection", "mosaic_layers", mosaic_block_beats_channel
    ),
    Finding("MosaicQuant", "Δ-Hessian selection beats magnitude/residual/random/none", "mosaic_ablation",
            mosaic_selection_ablation),  # fmt: skip
    Finding("MosaicQuant", "the budget has diminishing returns", "mosaic_layers", mosaic_diminishing),
    Finding(
        "MosaicQuant",
        "beats an Atom-like mixed-precision split (3.1% INT8 channels)",
        "mosaic_layers",
        mosaic_atom_like,
    ),  # fmt: skip
    Finding("MosaicQuant", "ours: thin residual blocks beat 64x64 at 10%", "mosaic_thin", mosaic_thin_blocks),
    Finding(
        "MosaicQuant", "fused sparse branch costs ~5-6% latency (GPU)", "mosaic_kernel", mosaic_fused_overhead
    ),
    Finding("SFMP", "SFMP (AWQ blocks) beats uniform GPTQ and AWQ at equal memory", "sfmp",
            sfmp_beats_uniform),  # fmt: skip
    Finding("SFMP", "ours: SFMP with GPTQ blocks beats uniform at equal memory", "sfmp",
            partial(sfmp_beats_uniform, solver="gptq", uniform=(*PAPER_UNIFORM, "gptq"))),  # fmt: skip
    Finding("SFMP", "ours: SFMP (AWQ blocks) beats our GPTQ (act-order, MSE) at equal memory", "sfmp",
            partial(sfmp_beats_uniform, uniform=("gptq",))),  # fmt: skip
    Finding("SFMP", "ours: GPTQ blocks beat the paper's AWQ blocks", "sfmp", sfmp_gptq_beats_awq),
    Finding("SFMP", "Fisher from 128 samples is no worse than from 32", "sfmp", sfmp_fisher_samples),
    Finding("SFMP", "smaller blocks (m_b) allocate better", "sfmp", sfmp_small_blocks),
    Finding("SFMP", "bit-plane LUT GEMV latency falls ~linearly with bits", "lut_gemv", sfmp_latency_linear),
    Finding("SFMP", "row+column reordering lowers perplexity", "sfmp", sfmp_reorder_helps),
    Finding("SFMP", "reordering costs at most ~5% of decode speed", "sfmp_decode", sfmp_reorder_decode_cost),
    Finding(Q, "GPTQ W4A4 with a Hadamard rotation within 1.5x of float", "rotation", rotation_w4a4_goal),
    Finding(Q, "MosaicQuant + rotation beats rotation alone (W4A4)", "rotation",
            partial(rotation_beats_alone, "mosaic W4A4", alone="gptq W4A4g128 +hadamard")),  # fmt: skip
    Finding(Q, "MosaicQuant (GPTQ base) + rotation beats rotation alone (W4A4)", "rotation",
            partial(rotation_beats_alone, "mosaic-gptq W4A4", alone="gptq W4A4g128 +hadamard")),  # fmt: skip
    Finding(Q, "SQ-format W(SQ5)A4 + rotation beats rotation alone", "rotation",
            partial(rotation_beats_alone, "sq-weights W4A4")),  # fmt: skip
    Finding(Q, "SQ-format W4A(SQ) + rotation beats rotation alone", "rotation",
            partial(rotation_beats_alone, "sq-acts W4A(SQ)")),  # fmt: skip
    Finding(Q, "SmoothQuant + rotation beats rotation alone (W4A4)", "rotation",
            partial(rotation_beats_alone, "smoothquant+gptq W4A4")),  # fmt: skip
]


# why a row may differ from its paper, beyond what every row shares (findings_lib.DIFFERS); issue 25
WHY = {
    "SSQR (1-3% outliers) beats GPTQ at equal bits": "fast protocol; only the 3% row measured. No heavy "
    "outliers here: no-clip GPTQ on the MSE scales (α = 1) puts 1.9% of weights off the grid (2.2% at most "
    "per layer), so at 3% SSQR narrows its grid (α ≈ 0.94) and its outliers are ordinary weights. Against "
    "GPTQ w3 (0.9 bits fewer) SSQR-3% has lower error in 210 of 210 layers and lower KL yet higher "
    "perplexity (the noisy comparison the issue saw); at equal bits (w4) perplexity and KL agree that GPTQ "
    "wins. Judged the same way the paper's own Table 3 has SSQR-3% above its GPTQ curve (10.42 vs 10.20); "
    "only 1-2% sit below it. Our grids are asymmetric: paper_bpw leaves their zeros out, as the paper does",
    "DPQ W4A8 beats naive GPTQ and RTN W4A8": "16x512 calibration (the paper: far more): DPQ removes 37% of "
    "the FP8-added error on calibration data but 13% on held-out data; the naive baseline ran with GAR",
    "GAR ≈ act-order accuracy without g_idx": "fast protocol",
    "W4A4 MosaicQuant beats the collapsing RTN and SmoothQuant": "the main row searches α over 0.3-1.0 in "
    "steps of 0.1 (65 of 180 linears on the 0.3 boundary); the row with SmoothQuant's grid is given beside "
    "it; fast protocol",
    "MosaicQuant beats RTN and SmoothQuant at W4A8": "as the W4A4 row: α grid; fast protocol",
    "ours: MosaicQuant beats GPTQ at W4A8": "not a claim of the paper (it compares with RTN and SmoothQuant)",
    "beats an Atom-like mixed-precision split (3.1% INT8 channels)": "per-linear output error on a token "
    "sample, not Table 1's perplexity (no model-level Atom row); Atom rebuilt in simplified form (no "
    "KV-cache quantization, GPTQ on the INT4 channels' Hessian block, outlier channels by max abs(X_j)); its "
    "g128 weight scales are finer than MosaicQuant's per-channel base; SmolLM2 has few activation outliers",
    "block selection beats channel selection": "outlier channels by the float input's max abs(X_j) (the "
    "paper does not say how it picks them); fast protocol; no heavy outliers here to make channels strong",
    "10% of blocks recovers over half the output distortion": "the paper quotes two single layers of a "
    "7B+ model; 64x64 blocks of 576-1536-wide matrices are 1/81-1/216 of a matrix",
    "ours: thin residual blocks beat 64x64 at 10%": "not a claim of the paper (it uses square blocks); "
    "1x128 blocks store one scale per 128 weights and an index per block, so they cost more bits",
    "SFMP (AWQ blocks) beats uniform GPTQ and AWQ at equal memory": "fast protocol (16x512 calibration "
    "and Fisher, 20 windows; the paper: 1k C4 samples for Fisher); m_b = 512 leaves 1-3 row blocks per "
    "matrix (the paper's 8B matrices have many); GPTQ as the paper ran it (natural order, min-max)",
    "ours: SFMP (AWQ blocks) beats our GPTQ (act-order, MSE) at equal memory": "not the paper's comparator; "
    "act-order's g_idx makes our GPTQ store more, so SFMP gets the smaller AWQ budget",
    "row+column reordering lowers perplexity": "judged at equal code bits (indices and bit map reported "
    "beside: the indices cost 0.046 bpw here, ~0.006 on an 8B model) with m_b = 64 (3-24 row blocks per "
    "matrix; at m_b = 512 only 1-3); GPTQ blocks, our default (the paper's Fig. 7: AWQ), where the column "
    "order is also GPTQ's solve order (Fisher-sorted, akin to act-order), so part of the gain is GPTQ's "
    "order, not the allocation; fast protocol",
    "smaller blocks (m_b) allocate better": "matrices of 192-1536 rows: even m_b = 64 gives only 3-24 row "
    "blocks; at equal code bits (the paper: equal memory, where the bit map's 8 bits per block count)",
    "Fisher from 128 samples is no worse than from 32": "fast protocol; samples drawn apart from the "
    "calibration (the paper: 128-2k C4 samples on 8B models, 1k by default)",
    "static masks ≈ dynamic at (8/4)": "the paper does not print its activation scale granularity; judged "
    "with per-bank scales (what its Table 2 fits); per-token scales give +42% and per-128-channel +13%; "
    "static scales calibrated once per bank lose badly (109.8; per 128 channels 194.9): fixed scales "
    "cannot follow each token",
    "W4A(SQ) lands between W4A4 and W4A8": "the A4 bound is W4A4 with A4 per group of 128 (per-token INT4 "
    "collapses this model: 1301); SQ rows with per-bank activation scales, whose scales cost 2 bits "
    "per value at b = 16 (act_bits), which the paper's y leaves out",
    "W(SQ)A4 improves as the sparsity s falls": "A4 per group of 64 and 128 channels (per-token INT4 "
    "collapses this model); the paper's A4 granularity is not printed",
    "W(SQ)A4 beats W4A4 (group-wise A4)": "our W4A4 uses the smoothed GPTQ W4 g128 weights of every "
    "activation row (the paper's: GPTQ W4A4); W(SQ) stores more bits per weight (measured_bits)",
    "static falls away from dynamic towards INT2": "per-token activation scales (not rerun with per-bank "
    "scales, which narrow the (8/4) gap from +42% to +3.9%)",
    "static SQ prefers small banks": "per-token activation scales (not rerun with per-bank scales)",
    "|Ā_j| alone as static importance degrades": "per-token activation scales (not rerun with per-bank "
    "scales)",
    "fused sparse branch costs ~5-6% latency (GPU)": "CPU kernels; the paper's figure is a GPU's",
    "MosaicQuant + rotation beats rotation alone (W4A4)": "MosaicQuant's RTN dense base loses with a "
    "rotation here (RTN W4A16 79 -> 182, see rotation.md); both rows A4 per group of 128",
    "MosaicQuant (GPTQ base) + rotation beats rotation alone (W4A4)": "both rows A4 per group of 128",
    "SQ-format W(SQ5)A4 + rotation beats rotation alone": "W(SQ5) stores 5.5 bits per weight against "
    "4.0; rows from the H200",
    "SQ-format W4A(SQ) + rotation beats rotation alone": "A(SQ) 16-(8/4)-0.5 keeps half the activations "
    "at 8 bits: rotation alone at W4A8 gives 41.20 on the same device",
    "GPTQ W4A4 with a Hadamard rotation within 1.5x of float": "QuaRot's figures are from 7B-70B models, "
    "4096-8192 wide; a rotation spreads each token over 576 channels here",
}
for _f in FINDINGS:
    _f.differ = WHY.get(_f.claim, "")
