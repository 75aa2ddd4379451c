"""Shared pieces of the findings report: the Finding record, result loading and verdict words."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import RESULTS

BENCHMARKS = Path(__file__).resolve().parents[1]
NOT_SCRIPTS = ("harness", "findings")  # the package's own folders, not a benchmark's
HOLDS, FAILS, UNTESTABLE, MISSING = "holds", "does not hold here", "cannot be tested here", "not measured"
UNDECIDED = "undecided"  # verdict-protocol runs of two seeds disagree
# a close pair (within 10%) whose paired bootstrap interval includes 1, or whose seeds disagree in sign
# (benchmarks.findings.noise): neither "holds" nor "does not hold"
WITHIN_NOISE = "within noise"


@dataclass
class Finding:
    paper: str
    claim: str
    source: str  # benchmark JSON name (benchmarks/results/<source>.json), or "fresh"
    judge: Callable[[dict], tuple]  # results -> (numbers, verdict); pooled: (numbers, verdict, seeds)
    differ: str = ""  # why this may differ from the paper, besides what every row shares (DIFFERS)
    q4_1: str = ""  # whether the verdict can depend on SmolLM2's Q4_1-grid weights, and why (issue 73)
    # the judge sees every verdict seed at once (seed 0's rows, the others as res["seeds"]) and says
    # how many seeds its pairs rest on: for tables whose later seeds repeat only the pairs under 10%
    pooled: bool = False
    # the row pairs (a, b) the claim says differ: where a pair is close (within 10%) the numbers get its
    # paired bootstrap interval and seed spread, and the verdict says "within noise" where those do
    # (benchmarks.findings.noise)
    close_pairs: tuple[tuple[str, str], ...] = ()
    # (numbers, verdict) where no run wrote the source: a GPU claim's "not measured: no GPU lent"
    # (claims_gpu.py); None: "not measured: run <the benchmark>"
    unmeasured: tuple[str, str] | None = None


# what every SmolLM2 row shares and the papers do not (the report says it once, above the table)
# (issue 73: no claim about the weights' outliers here -- the Q4_1 grid keeps each group's extremes, and
# outliers.md measures the weights' and activations' outliers; each row says whether the grid can matter)
DIFFERS = (
    "SmolLM2-135M (576 wide, 30 layers) where the papers use 7B-70B models; its float weights are a "
    "dequantized Q4_1 GGUF (each 32 weights of a row on a grid of 16 values, asymmetric, float offsets: "
    "each row's *Q4_1 grid* line says whether its verdict can depend on that); its weight and activation "
    "outliers are measured in outliers.md; the papers' own baselines are not all rebuilt here"
)


def protocol_of(res: dict) -> str:
    """Which protocol ``res`` (a benchmark's JSON) measured with: ``fast``, ``verdict``, or its settings;
    ``-`` for a result with no calibration (a kernel timing); a per-layer measurement names its
    calibration and says it scores no perplexity."""
    a = res.get("args") or {}
    said = res.get("protocol", a.get("protocol"))  # the run's own word; its arguments' where it has none
    if said in ("fast", "verdict"):
        return said
    n, w = a.get("nsamples"), a.get("max_windows")
    if n is None:
        return "-"
    if (n, w) == (16, 20):
        return "fast"
    if n >= 128 and w is None and a.get("fidelity"):  # the verdict protocol (common.protocol_label)
        return "verdict"
    if "max_windows" not in a and not res.get("rows"):  # per-layer measurements: no perplexity pass
        return f"{n}x{a.get('seqlen', 512)} calib, per layer (no perplexity)"
    return f"{n}x{a.get('seqlen', 512)} calib, " + ("every window" if w is None else f"{w} windows")


def _is_script(path: Path) -> bool:
    return path.parent.name not in NOT_SCRIPTS and '__name__ == "__main__"' in path.read_text()


def module_of(source: str) -> str:
    """The benchmark module that writes ``results/<source>.json``: the script of that name in a topic
    folder, or the one whose part it is (``mosaic_main``: ``mosaic.py --parts main``; ``sfmp_decode``:
    ``sfmp.py --parts decode``)."""
    stem = source
    while stem:
        found = [p for p in [BENCHMARKS / f"{stem}.py", *sorted(BENCHMARKS.glob(f"*/{stem}.py"))]
                 if p.is_file() and _is_script(p)]  # fmt: skip
        if found:
            parts = () if found[0].parent == BENCHMARKS else (found[0].parent.name,)
            return ".".join(("benchmarks", *parts, stem))
        stem = stem.rpartition("_")[0]
    return f"benchmarks.<topic>.{source}"


SECOND_SUFFIX = "_gemma"  # the result files of the report's second model: <source>_gemma*.json (issue 73)


def run_command(source: str) -> str:
    """What to type, at the repository root, to measure ``source`` (a second-model source: the driver
    that reruns its benchmark on Gemma-3-270m with the same rows, benchmarks/findings/second_model.py)."""
    if SECOND_SUFFIX in source:
        base = source.split(SECOND_SUFFIX)[0]
        return f"python -m benchmarks.findings.second_model --only {base} --protocol verdict"
    return f"python -m {module_of(source)}"


def load(name: str) -> dict | None:
    p = RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def rows_by_name(res: dict) -> dict[str, dict]:
    return {r["name"]: r for r in res.get("rows", [])}


def fmt(x: float, nd: int = 2) -> str:
    return "inf" if not math.isfinite(x) else f"{x:.{nd}f}"


def ppl_fid(row: dict) -> str:
    """``row``'s perplexity, with KL and top-1 to the float model where the run measured them."""
    out = fmt(row["ppl"])
    if "kl_mean" in row:
        out += f" (KL {row['kl_mean']:.4f}, top-1 {row['top1_agreement']:.3f})"
    return out


def verdict(ok: bool, why_not: str = "") -> str:
    return HOLDS if ok else (FAILS + (f" ({why_not})" if why_not else ""))
