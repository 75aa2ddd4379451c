"""Findings-report judges of the DPQ paper (W4A8 with FP8 compute, GAR)."""

from __future__ import annotations

from benchmarks.findings.findings_lib import WITHIN_NOISE, fmt, ppl_fid, rows_by_name, verdict
from benchmarks.findings.noise import pair_interval

# the close pair of the claim: its interval and seed spread are added by the findings report
DPQ_VS_NAIVE = ("W4A8 dpq gar", "W4A8 naive gptq gar")


# -- DPQ (paper 003) ----------------------------------------------------------------------------
def dpq_vs_baselines(res: dict) -> tuple[str, str]:
    r = rows_by_name(res)
    d, n, rt = r["W4A8 dpq gar"], r["W4A8 naive gptq gar"], r["W4A8 rtn"]
    nums = f"DPQ {ppl_fid(d)}, naive GPTQ {ppl_fid(n)}, RTN {ppl_fid(rt)} (W4A8-FP8, g128)"
    if "W4A8 naive gptq no reorder" in r:  # the paper does not say its naive baseline reordered
        nums += f"; naive GPTQ without reordering {ppl_fid(r['W4A8 naive gptq no reorder'])}"
    gain = (n["ppl"] - d["ppl"]) / n["ppl"]
    nums += f"; vs naive {gain:+.1%}"
    ci = pair_interval(d, n)  # ppl(DPQ) / ppl(naive) over the run's windows, where both kept them
    if ci is None:  # a run before per-window NLLs were kept: under 1%, within the seeds' spread (~1%)
        return nums, verdict(
            gain >= 0.01 and d["ppl"] < rt["ppl"], "vs RTN yes, vs naive GPTQ no meaningful gain"
        )
    if ci[0] <= 1 <= ci[1]:
        return nums, f"{WITHIN_NOISE} (vs RTN yes; vs naive GPTQ the 95% interval includes 1)"
    return nums, verdict(ci[1] < 1 and d["ppl"] < rt["ppl"], "vs naive GPTQ worse beyond noise")


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
