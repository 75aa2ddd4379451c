"""Why each claim's row may differ from its paper, beyond what every row shares
(:data:`findings_lib.DIFFERS`): the findings report's last column.  The texts are data,
``benchmarks/results/findings_why.yaml``, beside the results they cite, keyed by the claim's text in
:data:`claims.FINDINGS` (issue 25: model scale, Q4_1-origin weights, calibration size, a missing
baseline, and the measured numbers the verdict rests on).

Each entry names the result objects it cites (``cites``: an alias -> a path into a result file: the
file's name, then keys, a list's element picked by its ``name`` or by its index) and writes a measured
number as ``{LITERAL ALIAS.FIELD}``: ``{45.46 hptq.ppl}`` is row ``hptq``'s ``ppl`` shown with two
decimals.  :func:`render` fills every such number from the result file, at the literal's decimals;
:func:`check` lists every literal that differs from its file (the test suite asks for none: a result
measured again must have its text read again).  A number the texts compute (a percentage between two
rows) or quote (a paper's figure, a setting) stays plain text.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import yaml

from benchmarks import RESULTS

WHY_FILE = RESULTS / "findings_why.yaml"
# {LITERAL ALIAS.FIELD}: a number as the text shows it, and where the result file holds it
NUMBER = re.compile(r"\{(?P<lit>[-+]?\d+(?:\.\d+)?) (?P<alias>[\w-]+)\.(?P<field>[\w.-]+)\}")


def load_texts(path: str | Path = WHY_FILE) -> dict[str, dict]:
    """The entries of ``path``: claim -> ``{"cites": {alias: [file, key, ...]}, "text": str}``."""
    entries = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    for claim, e in entries.items():
        if not isinstance(e, dict) or not isinstance(e.get("text"), str):
            raise ValueError(f"{path}: the entry of {claim!r} has no text")
        e.setdefault("cites", {})
    return entries


@cache
def _result(results: Path, name: str):
    return json.loads((results / f"{name}.json").read_text())


def _step(obj, key):
    if isinstance(obj, list):
        if isinstance(key, int):
            return obj[key]
        found = [x for x in obj if isinstance(x, dict) and x.get("name") == key]
        if len(found) != 1:
            raise KeyError(f"{len(found)} elements named {key!r}")
        return found[0]
    return obj[key]


def cited(cite: list, results: Path = RESULTS):
    """The object ``cite`` names: ``[file, key, ...]`` from ``results/<file>.json``."""
    obj = _result(Path(results), cite[0])
    for key in cite[1:]:
        obj = _step(obj, key)
    return obj


def _value(entry: dict, m: re.Match, results: Path) -> float:
    alias = m["alias"]
    if alias not in entry["cites"]:
        raise KeyError(f"no cite named {alias!r}")
    obj = cited(entry["cites"][alias], results)
    for key in m["field"].split("."):
        obj = _step(obj, int(key) if key.isdigit() and isinstance(obj, list) else key)
    if isinstance(obj, bool) or not isinstance(obj, int | float):
        raise TypeError(f"{alias}.{m['field']} is {obj!r}, not a number")
    return obj


def _shown(value: float, literal: str) -> str:
    """``value`` written as ``literal`` is: its decimals, its sign mark."""
    decimals = len(literal.partition(".")[2])
    out = f"{value:.{decimals}f}"
    return "+" + out if literal.startswith("+") and value >= 0 else out


def render(entry: dict, results: Path = RESULTS) -> str:
    """``entry``'s text with each cited number read from its result file (where the file no longer
    holds it, the literal stays: :func:`check` names it)."""

    def number(m: re.Match) -> str:
        try:
            return _shown(_value(entry, m, results), m["lit"])
        except (KeyError, IndexError, TypeError, ValueError, OSError):
            return m["lit"]

    return NUMBER.sub(number, entry["text"])


def check(path: str | Path = WHY_FILE, results: Path = RESULTS) -> list[str]:
    """One line per number of the texts that differs from its result file (or names nothing there)."""
    _result.cache_clear()  # a test may have rewritten a result file
    bad = []
    for claim, entry in load_texts(path).items():
        for m in NUMBER.finditer(entry["text"]):
            try:
                shown = _shown(_value(entry, m, Path(results)), m["lit"])
            except (KeyError, IndexError, TypeError, ValueError, OSError) as e:
                bad.append(f"{claim}: {m[0]} cites nothing ({type(e).__name__}: {e})")
                continue
            if shown != m["lit"]:
                bad.append(f"{claim}: {m[0]} reads {shown} in {entry['cites'][m['alias']][0]}.json")
    return bad


def why_texts(path: str | Path = WHY_FILE, results: Path = RESULTS) -> dict[str, str]:
    """claim -> its rendered text, every number from the result files."""
    return {claim: render(entry, Path(results)) for claim, entry in load_texts(path).items()}
