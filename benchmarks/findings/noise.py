"""Close pairs within noise (issue 73, item 8): two rows whose perplexities are within 10% of each
other (:data:`CLOSE`, the project's "close" line) get the paired bootstrap 95% interval of their
perplexity ratio over the test windows (:func:`bitmosaic.eval.bootstrap.bootstrap_ratio`, 2000
resamples, seed 0) where both rows kept their per-window NLLs (``window_nll``, from the same run: the
same windows), and, where several seeds measured them, the seed spread (min..max of the ratio over
seeds).  The pair is *within noise* where an interval includes 1 or the seeds disagree in sign; a pair
measured before per-window NLLs were kept gets no interval, never a made-up one (:data:`NO_INTERVAL`).

Run: python -m benchmarks.findings.noise "ROW A" "ROW B" RESULT.json [RESULT.json ...]   (one file per
seed: prints the pair's interval(s), seed spread and whether it is within noise)
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from bitmosaic.eval.bootstrap import bootstrap_ratio

CLOSE = 0.10  # two perplexities within 10% of each other: a close pair
RESAMPLES, BOOT_SEED = 2000, 0
NO_INTERVAL = "no interval (run before per-window NLLs were kept)"


def is_close(a: dict, b: dict) -> bool:
    """Whether rows ``a`` and ``b`` are a close pair: the larger perplexity at most 10% above the smaller."""
    lo, hi = sorted((a["ppl"], b["ppl"]))
    return 0 < lo and hi / lo - 1 <= CLOSE


def pair_interval(a: dict, b: dict) -> tuple[float, float] | None:
    """The paired bootstrap 95% interval of ``ppl(a) / ppl(b)`` over the windows both rows kept their
    mean NLL of (``window_nll``); None where either lacks them or they are not the same windows."""
    wa, wb = a.get("window_nll"), b.get("window_nll")
    if not wa or not wb or len(wa) != len(wb) or a.get("windows", len(wa)) != b.get("windows", len(wb)):
        return None
    return bootstrap_ratio(wa, wb, n=RESAMPLES, seed=BOOT_SEED)


@dataclass
class PairNoise:
    """One close pair over the runs (seeds) that measured both rows."""

    a: str
    b: str
    seeds: list  # each run's calibration seed (None where the run does not say)
    ratios: list[float]  # ppl(a) / ppl(b), one per run
    intervals: list[tuple[float, float] | None]  # each run's 95% interval (None: no per-window NLLs)

    @property
    def has_interval(self) -> bool:
        return any(i is not None for i in self.intervals)

    def reason(self) -> str:
        """Why the pair is within noise ("" where it is not): an interval that includes 1, seeds that
        disagree in sign."""
        why = [f"seed {s}'s 95% interval includes 1" for s, i in zip(self.seeds, self.intervals, strict=True)
               if i is not None and i[0] <= 1 <= i[1]]  # fmt: skip
        if len(self.ratios) > 1 and min(self.ratios) < 1 < max(self.ratios):
            why.append("the seeds disagree in sign")
        return ", ".join(why)

    @property
    def within_noise(self) -> bool:
        return bool(self.reason())

    def text(self) -> str:
        """The numbers column's note: each seed's ratio with its interval (or why it has none) and the
        seed spread."""
        cells = []
        for s, r, i in zip(self.seeds, self.ratios, self.intervals, strict=True):
            seed = "" if len(self.ratios) == 1 else f"seed {s}: "
            cells.append(f"{seed}{r:.4f}" + ("" if i is None else f" [{i[0]:.4f}, {i[1]:.4f}]"))
        out = f"{self.a} / {self.b} ppl ratio " + ", ".join(cells)
        if self.has_interval:
            out += f" (95% paired bootstrap over windows, {RESAMPLES} resamples)"
        if len(self.ratios) > 1:
            out += (
                f"; seed spread {min(self.ratios):.4f}..{max(self.ratios):.4f} over {len(self.ratios)} seeds"
            )
        if not all(i is not None for i in self.intervals):
            out += (
                "; " + NO_INTERVAL + ("" if not self.has_interval else " for the seeds without an interval")
            )
        return out


def _seed(res: dict):
    return (res.get("args") or {}).get("seed")


def pair_noise(runs: list[dict], a: str, b: str) -> PairNoise | None:
    """Rows ``a`` and ``b`` over ``runs`` (one result dict per seed; a run without both rows is
    skipped): None where no run has both, or the pair is not close in any of them."""
    pairs = []
    for res in runs:
        rows = {r["name"]: r for r in res.get("rows", [])}
        if a in rows and b in rows:
            pairs.append((res, rows[a], rows[b]))
    if not pairs or not any(is_close(x, y) for _, x, y in pairs):
        return None
    return PairNoise(
        a,
        b,
        seeds=[_seed(res) for res, _, _ in pairs],
        ratios=[x["ppl"] / y["ppl"] for _, x, y in pairs],
        intervals=[pair_interval(x, y) for _, x, y in pairs],
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="row name (the numerator)")
    p.add_argument("b", help="row name (the denominator)")
    p.add_argument("results", nargs="+", help="result JSON files, one per seed")
    args = p.parse_args(argv)
    runs = [json.loads(Path(f).read_text()) for f in args.results]
    pn = pair_noise(runs, args.a, args.b)
    if pn is None:
        print(f"{args.a} / {args.b}: not a close pair (or not measured) in {', '.join(args.results)}")
        return
    print(pn.text())
    print("within noise: " + pn.reason() if pn.within_noise else "outside noise")


if __name__ == "__main__":
    main()
