"""Findings-report judges of bitmosaic's own defaults at 4 bits (issue 73: a default chosen on SmolLM2 is
checked on Gemma-3-270m on the verdict protocol): act-order GPTQ with static groups (no ``g_idx``, so
every export holds it) rather than dynamic groups, and GPTQ rather than AWQ at W4 g128.  Both read
``benchmarks/gptq/static_groups.py``'s runs (``--kinds dynamic,static,awq``): the three models of one
calibration seed, scored on the same windows in one pass."""

from __future__ import annotations

from benchmarks.findings.findings_lib import fmt, ppl_fid, rows_by_name, verdict

STATIC, DYNAMIC, AWQ = "w4 static s0", "w4 dynamic s0", "w4 awq s0"
# the close pair of the GPTQ-over-AWQ claim: its interval is added by the findings report
GPTQ_VS_AWQ = (STATIC, AWQ)


def _complete(res: dict, *names: str) -> list[dict]:
    """The rows ``names`` of ``res``, each scored on every window (a row still being evaluated counts as
    absent: KeyError, so the report says "not measured" and names the run)."""
    by, out = rows_by_name(res), []
    for n in names:
        row = by[n]
        if row.get("windows") != res["eval_windows"] or "ppl" not in row:
            raise KeyError(f"{n} (on every window)")
        out.append(row)
    return out


def _at(row: dict) -> str:
    return f"{ppl_fid(row)} @ {fmt(row['bits_per_weight'], 3)} bpw"


def static_groups_at_4_bits(res: dict) -> tuple[str, str]:
    """Static groups (the default at 4 bits) are no worse than dynamic: the benchmark's own rule, static's
    perplexity and mean KL at most max(0.5%, the seed spread) above dynamic's on every seed."""
    s, d = _complete(res, STATIC, DYNAMIC)
    v = next((v for v in res["verdicts"] if v["bits"] == 4), None)
    if v is None:
        raise KeyError("the w4 verdict")
    p = v["pairs"][0]
    nums = (
        f"w4 g128 static {_at(s)}, dynamic {_at(d)}; static/dynamic ppl {p['ppl_ratio']:.4f} "
        f"(95% interval {p['ci95'][0]:.4f}..{p['ci95'][1]:.4f}), KL ratio {p['kl_ratio']:.4f}"
    )
    return nums, verdict(v["within_noise"], f"static more than {v['margin']:.1%} above dynamic")


def gptq_beats_awq_at_w4(res: dict) -> tuple[str, str]:
    """GPTQ (the default method, static groups) has the lower perplexity than AWQ at W4 g128; the report
    adds the pair's interval and calls it within noise where the interval includes 1."""
    g, w = _complete(res, STATIC, AWQ)
    nums = f"GPTQ w4 g128 {_at(g)}, AWQ w4 g128 {_at(w)}; GPTQ/AWQ ppl {g['ppl'] / w['ppl']:.4f}"
    return nums, verdict(g["ppl"] < w["ppl"], "AWQ has the lower perplexity")
