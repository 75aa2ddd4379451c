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
measured again must have its text read again).

No measured number in plain text (issue 73): a number that looks measured -- a decimal with two or more
decimals, or a percentage (:data:`LOOKS_MEASURED`) -- is one of

* ``{LITERAL ALIAS.FIELD}``, a number read from its result file (above), or ``{LITERAL% ALIAS.FIELD}``,
  a fraction read from its file and shown as a percentage (``0.019`` as ``1.9%``);
* ``{LITERAL% A.FIELD below B.FIELD}`` (``100 (1 - a/b)``), ``{LITERAL% A.FIELD above B.FIELD}``
  (``100 (a/b - 1)``), ``{LITERALx A.FIELD / B.FIELD}`` (``a/b``) or ``{LITERAL A.FIELD - B.FIELD}``
  (``a - b``): a percentage, ratio or difference of two cited numbers, computed from the files and
  checked like them (:data:`RATIO`);
* ``{LITERAL len A.FIELD}`` (the length of a cited list) or ``{LITERAL count A.FIELD == X}`` (how many of
  its elements equal ``X``): a count over a list a result file holds (:data:`LIST`), e.g. the linears
  whose searched α sits on the grid's end;
* ``{paper LITERAL}``: a figure quoted from the paper, or ``{set LITERAL}``: a setting (a budget, a
  grid, a learning rate), shown as ``LITERAL`` (:data:`MARK`): quoted, not measured here.

:func:`unmarked` lists the plain numbers of a text that look measured; the test suite asks for none,
outside an explicit list of texts not yet converted.
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from pathlib import Path

import yaml

from benchmarks import RESULTS

WHY_FILE = RESULTS / "findings_why.yaml"
# whether each verdict can depend on SmolLM2's float weights being a dequantized Q4_1 grid (16 values per
# 32 weights, asymmetric, float offsets; issue 73): entries as in WHY_FILE, plus ``q4_1``: one of Q4_1_WORDS
Q4_1_FILE = RESULTS / "findings_q4_1.yaml"
Q4_1_WORDS = ("can depend", "cannot")
# {LITERAL ALIAS.FIELD}: a number as the text shows it, and where the result file holds it
# ({LITERAL% ALIAS.FIELD}: a fraction the file holds, shown as a percentage)
NUMBER = re.compile(r"\{(?P<lit>[-+]?\d+(?:\.\d+)?)(?P<pct>%?) (?P<alias>[\w-]+)\.(?P<field>[\w.-]+)\}")
# {LITERAL% A.FIELD below|above B.FIELD} / {LITERALx A.FIELD / B.FIELD}: computed from two cited numbers
_REF = r"[\w-]+\.[\w.-]+"
RATIO = re.compile(
    rf"\{{(?P<lit>[-+]?\d+(?:\.\d+)?)(?P<unit>[%x]?) (?P<a>{_REF}) (?P<op>below|above|/|-) (?P<b>{_REF})\}}"
)
# {LITERAL len A.FIELD} / {LITERAL count A.FIELD == X}: a list's length, or how many of its elements are X
LIST = re.compile(rf"\{{(?P<lit>\d+) (?P<fn>len|count) (?P<ref>{_REF})(?: == (?P<x>[-+]?\d+(?:\.\d+)?))?\}}")
# {paper LITERAL} / {set LITERAL}: a paper's figure or a setting, quoted
MARK = re.compile(r"\{(?P<kind>paper|set) (?P<lit>[-+]?\d+(?:\.\d+)?[%x]?)\}")
# a plain number that looks measured: two or more decimals, or a percentage
LOOKS_MEASURED = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d{2,}|(?:\.\d+)?%)")


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


def _resolve(entry: dict, ref: str, results: Path):
    """The object ``ref`` (``ALIAS.FIELD``) names in ``entry``'s cites."""
    alias, _, field = ref.partition(".")
    if alias not in entry["cites"]:
        raise KeyError(f"no cite named {alias!r}")
    obj = cited(entry["cites"][alias], results)
    for key in field.split("."):
        obj = _step(obj, int(key) if key.isdigit() and isinstance(obj, list) else key)
    return obj


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _lookup(entry: dict, ref: str, results: Path) -> float:
    """The number ``ref`` (``ALIAS.FIELD``) names in ``entry``'s cites."""
    obj = _resolve(entry, ref, results)
    if not _is_number(obj):
        raise TypeError(f"{ref} is {obj!r}, not a number")
    return obj


def _count(entry: dict, m: re.Match, results: Path) -> int:
    """The count a :data:`LIST` match stands for."""
    obj = _resolve(entry, m["ref"], results)
    if not isinstance(obj, list):
        raise TypeError(f"{m['ref']} is {type(obj).__name__}, not a list")
    if m["fn"] == "len":
        return len(obj)
    if m["x"] is None:
        raise ValueError(f"{m[0]}: count needs '== X'")
    return sum(_is_number(v) and math.isclose(v, float(m["x"]), abs_tol=1e-9) for v in obj)


def _value(entry: dict, m: re.Match, results: Path) -> float:
    """The number a :data:`NUMBER`, :data:`RATIO` or :data:`LIST` match stands for."""
    if "fn" in m.groupdict():
        return _count(entry, m, results)
    if "op" not in m.groupdict():
        value = _lookup(entry, f"{m['alias']}.{m['field']}", results)
        return 100 * value if m["pct"] else value
    a, b = _lookup(entry, m["a"], results), _lookup(entry, m["b"], results)
    if m["op"] in "/-":
        return a / b if m["op"] == "/" else a - b
    return 100 * (1 - a / b) if m["op"] == "below" else 100 * (a / b - 1)


def _shown(value: float, literal: str) -> str:
    """``value`` written as ``literal`` is: its decimals, its sign mark."""
    decimals = len(literal.partition(".")[2])
    out = f"{value:.{decimals}f}"
    return "+" + out if literal.startswith("+") and value >= 0 else out


def _unit(m: re.Match) -> str:
    return m.groupdict().get("unit") or m.groupdict().get("pct") or ""


def _alias(m: re.Match) -> str:
    """The (first) cite a match reads."""
    g = m.groupdict()
    return g.get("alias") or (g.get("a") or g["ref"]).split(".")[0]


def render(entry: dict, results: Path = RESULTS) -> str:
    """``entry``'s text with each cited number read from its result file (where the file no longer
    holds it, the literal stays: :func:`check` names it), each ratio computed, each quoted figure bare."""

    def number(m: re.Match) -> str:
        try:
            return _shown(_value(entry, m, results), m["lit"]) + _unit(m)
        except (KeyError, IndexError, TypeError, ValueError, OSError, ZeroDivisionError):
            return m["lit"] + _unit(m)

    text = LIST.sub(number, RATIO.sub(number, entry["text"]))
    return MARK.sub(lambda m: m["lit"], NUMBER.sub(number, text))


def check(path: str | Path = WHY_FILE, results: Path = RESULTS) -> list[str]:
    """One line per number of the texts that differs from its result file (or names nothing there)."""
    _result.cache_clear()  # a test may have rewritten a result file
    bad = []
    for claim, entry in load_texts(path).items():
        for m in [m for p in (NUMBER, RATIO, LIST) for m in p.finditer(entry["text"])]:
            try:
                shown = _shown(_value(entry, m, Path(results)), m["lit"])
            except (KeyError, IndexError, TypeError, ValueError, OSError, ZeroDivisionError) as e:
                bad.append(f"{claim}: {m[0]} cites nothing ({type(e).__name__}: {e})")
                continue
            if shown != m["lit"]:
                where = entry["cites"][_alias(m)][0]
                bad.append(f"{claim}: {m[0]} reads {shown}{_unit(m)} in {where}.json")
    return bad


def unmarked(text: str) -> list[str]:
    """The plain numbers of ``text`` that look measured (:data:`LOOKS_MEASURED`): neither read from a
    result file nor marked as a paper's figure or a setting."""
    for pattern in (RATIO, LIST, NUMBER, MARK):
        text = pattern.sub(" ", text)
    return LOOKS_MEASURED.findall(text)


def why_texts(path: str | Path = WHY_FILE, results: Path = RESULTS) -> dict[str, str]:
    """claim -> its rendered text, every number from the result files."""
    return {claim: render(entry, Path(results)) for claim, entry in load_texts(path).items()}


def q4_1_texts(path: str | Path = Q4_1_FILE, results: Path = RESULTS) -> dict[str, str]:
    """claim -> ``"can depend: <reason>"`` or ``"cannot: <reason>"``, the reason rendered as a why text."""
    out = {}
    for claim, entry in load_texts(path).items():
        if entry.get("q4_1") not in Q4_1_WORDS:
            raise ValueError(
                f"{path}: the entry of {claim!r} has q4_1 {entry.get('q4_1')!r}, not one of {Q4_1_WORDS}"
            )
        out[claim] = f"{entry['q4_1']}: {render(entry, Path(results))}"
    return out
