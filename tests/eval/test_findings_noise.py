"""Close pairs in the findings report (issue 73, item 8; ``benchmarks/findings/noise.py``): two rows
within 10% get the paired bootstrap interval of their perplexity ratio where both kept per-window NLLs,
the seed spread where several seeds measured them, and the verdict "within noise" where an interval
includes 1 or the seeds disagree in sign; a pair measured before per-window NLLs were kept says so and
gets no interval.  Judged here on synthetic result dicts."""

import math

import pytest
import torch

from benchmarks.findings import claims_dpq, noise
from benchmarks.findings import findings as findings_module
from benchmarks.findings.findings_lib import FAILS, HOLDS, WITHIN_NOISE

N = 200  # windows


def _nll(shift: float = 0.0, noise_sd: float = 0.0, seed: int = 0) -> list[float]:
    """Per-window mean NLLs: a base run (window to window sd 0.4), shifted, with paired noise."""
    g = torch.Generator().manual_seed(100)
    base = 3.5 + 0.4 * torch.randn(N, generator=g, dtype=torch.float64)
    jitter = noise_sd * torch.randn(N, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (base + shift + jitter).tolist()


def _row(name: str, nll: list[float] | None = None, ppl: float | None = None) -> dict:
    if ppl is None:
        ppl = math.exp(sum(nll) / len(nll))
    row = {"name": name, "ppl": ppl, "windows": N}
    if nll is not None:
        row["window_nll"] = nll
    return row


def _run(*rows, seed: int = 0) -> dict:
    return {"args": {"seed": seed}, "rows": list(rows)}


def test_a_pair_far_apart_is_not_close():
    assert noise.pair_noise([_run(_row("a", ppl=10.0), _row("b", ppl=11.5))], "a", "b") is None
    assert noise.is_close(_row("a", ppl=10.0), _row("b", ppl=10.99))
    assert noise.pair_noise([_run(_row("a", ppl=10.0))], "a", "b") is None  # b not measured


def test_an_interval_that_includes_one_is_within_noise():
    pn = noise.pair_noise([_run(_row("a", _nll(0.0, 0.02, seed=1)), _row("b", _nll()))], "a", "b")
    ((lo, hi),) = pn.intervals
    assert lo < 1 < hi and pn.within_noise
    assert pn.reason() == "seed 0's 95% interval includes 1"
    assert f"[{lo:.4f}, {hi:.4f}]" in pn.text() and noise.NO_INTERVAL not in pn.text()


def test_a_gain_beyond_noise_is_not_within_noise_and_seeds_give_a_spread():
    runs = [_run(_row("a", _nll(-0.01, 0.01, seed=s)), _row("b", _nll()), seed=s) for s in range(3)]
    pn = noise.pair_noise(runs, "a", "b")
    assert all(hi < 1 for _, hi in pn.intervals) and not pn.within_noise
    lo, hi = min(pn.ratios), max(pn.ratios)
    assert f"seed spread {lo:.4f}..{hi:.4f} over 3 seeds" in pn.text()
    assert "seed 2: " in pn.text()


def test_no_per_window_data_gives_no_interval_but_seeds_that_disagree_are_within_noise():
    old = [_run(_row("a", ppl=37.26), _row("b", ppl=37.33), seed=0)]
    pn = noise.pair_noise(old, "a", "b")
    assert pn.intervals == [None] and not pn.within_noise  # no made-up interval, no verdict change
    assert pn.text() == f"a / b ppl ratio {37.26 / 37.33:.4f}; {noise.NO_INTERVAL}"
    old.append(_run(_row("a", ppl=37.5), _row("b", ppl=37.33), seed=1))
    pn = noise.pair_noise(old, "a", "b")
    assert pn.within_noise and pn.reason() == "the seeds disagree in sign"
    # rows of different windows (two runs' lengths) are not paired
    assert noise.pair_interval(_row("a", _nll()[:10]), _row("b", _nll())) is None


def _claim(findings):
    def judge(res):
        r = {row["name"]: row for row in res["rows"]}
        return f"{r['a']['ppl']:.3f}", HOLDS if r["a"]["ppl"] < r["b"]["ppl"] else FAILS

    return findings.Finding("P", "a beats b", "bench", judge, close_pairs=(("a", "b"),))


def test_the_report_turns_a_close_pair_within_noise_and_keeps_a_clear_one(monkeypatch, tmp_path):
    findings = findings_module
    monkeypatch.setattr(findings, "RESULTS", tmp_path)
    (tmp_path / "bench_verdict_s1.json").write_text("{}")
    clear = {f"bench_verdict{s}": _run(_row("a", _nll(-0.02, 0.01, i)), _row("b", _nll()), seed=i)
             for i, s in enumerate(("", "_s1"))}  # fmt: skip
    monkeypatch.setattr(findings, "load", clear.get)
    nums, v, used, n = findings.judge_seeds(_claim(findings))
    assert (v, used, n) == (HOLDS, "bench_verdict", 2) and "seed spread" in nums and "]" in nums
    noisy = dict(clear, bench_verdict_s1=_run(_row("a", _nll(-0.001, 0.05, 7)), _row("b", _nll()), seed=1))
    monkeypatch.setattr(findings, "load", noisy.get)
    v = findings.judge_seeds(_claim(findings))[1]
    assert v == f"{WITHIN_NOISE} (a vs b: seed 1's 95% interval includes 1)"
    # a pair measured before per-window NLLs were kept: the judge's verdict, and the note
    old = {"bench_verdict": _run(_row("a", ppl=10.0), _row("b", ppl=10.2))}
    monkeypatch.setattr(findings, "load", old.get)
    nums, v, *_ = findings.judge_seeds(_claim(findings))
    assert v == HOLDS and nums.endswith(noise.NO_INTERVAL)


def _dpq(dpq_nll=None, naive_nll=None, dpq_ppl=None, naive_ppl=None) -> dict:
    d, n = claims_dpq.DPQ_VS_NAIVE
    rows = [_row(d, dpq_nll, dpq_ppl), _row(n, naive_nll, naive_ppl), _row("W4A8 rtn", ppl=60.0)]
    return _run(*rows)


@pytest.mark.parametrize(
    "res,want",
    [
        (_dpq(dpq_ppl=37.26, naive_ppl=37.33), FAILS),  # no per-window NLLs: under 1%, no gain
        (_dpq(dpq_ppl=36.91, naive_ppl=37.63), HOLDS),  # ... 1.9%: the old rule holds
        (_dpq(_nll(-0.002, 0.001), _nll()), HOLDS),  # 0.2% but every window agrees: beyond noise
        (_dpq(_nll(-0.02, 0.3), _nll()), WITHIN_NOISE),  # 2% but the windows scatter: within noise
        (_dpq(_nll(0.01, 0.01), _nll()), FAILS),  # worse beyond noise
    ],
)
def test_the_dpq_judge_uses_the_interval_where_the_run_kept_windows(res, want):
    nums, v = claims_dpq.dpq_vs_baselines(res)
    assert v.startswith(want) and "vs naive" in nums
