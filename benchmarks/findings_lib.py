"""Shared pieces of the findings report: the Finding record, result loading and verdict words."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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

