"""The findings report's "why this may differ" texts (``benchmarks/results/findings_why.yaml``): every
measured number in them is the number its result file holds, read from there; a result measured again
(here: a copy of a result file, one value changed) makes the check name the text's number."""

import json
import shutil

import pytest

from benchmarks import RESULTS
from benchmarks.findings import why
from benchmarks.findings.claims import FINDINGS, SECOND


def test_every_number_in_the_texts_is_its_result_files():
    assert why.check() == []


def test_the_texts_cite_numbers_and_render_them_all():
    texts = why.load_texts()
    assert {k.removeprefix(SECOND) for k in texts} <= {f.claim for f in FINDINGS}
    cited = sum(len(why.NUMBER.findall(e["text"])) for e in texts.values())
    assert cited > 500  # the perplexities, KL, top-1, bits and seconds of the verdict rows
    for claim, text in why.why_texts().items():
        assert "{" not in text and "}" not in text, claim  # no placeholder left unread


def _copy_results(tmp_path, entries):
    names = {c[0] for e in entries.values() for c in e["cites"].values()}
    for name in names:
        shutil.copy(RESULTS / f"{name}.json", tmp_path / f"{name}.json")
    return tmp_path


def test_a_result_measured_again_fails_the_check(tmp_path):
    """A copy of the results with one cited perplexity changed: the check names that number, and the
    text then shows the file's new value (the report follows the files, the check asks for a rereading)."""
    entries = why.load_texts()
    claim = "HPTQ beats RTN/HRTN and GPTQ at ~3.1 bits"
    results = _copy_results(tmp_path, entries)
    assert why.check(results=results) == []
    m = next(why.NUMBER.finditer(entries[claim]["text"]))  # {45.46 hptq_3_125.ppl}
    cite = entries[claim]["cites"][m["alias"]]
    path = results / f"{cite[0]}.json"
    res = json.loads(path.read_text())
    row = next(r for r in res[cite[1]] if r.get("name") == cite[2])
    row[m["field"]] *= 1.01  # the same row, measured again
    path.write_text(json.dumps(res))
    bad = why.check(results=results)
    assert len(bad) == 1 and claim in bad[0] and m[0] in bad[0]
    new = f"{float(m['lit']) * 1.01:.2f}"
    assert new in why.render(entries[claim], results) and bad[0].endswith(f"reads {new} in {cite[0]}.json")


def test_a_number_that_names_nothing_fails_the_check(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"rows": [{"name": "a", "ppl": 12.345}]}))
    good = {"cites": {"a": ["r", "rows", "a"]}, "text": "a at {12.35 a.ppl}"}
    bad = {"cites": {"a": ["r", "rows", "a"]}, "text": "a at {12.35 a.kl_mean} or {1.0 b.ppl}"}
    texts = tmp_path / "why.yaml"
    texts.write_text(json.dumps({"good": good, "bad": bad}))  # JSON is YAML
    assert why.render(good, tmp_path) == "a at 12.35"
    lines = why.check(texts, tmp_path)
    assert len(lines) == 2 and all(line.startswith("bad: ") for line in lines)
    assert "KeyError" in lines[0] and "no cite named 'b'" in lines[1]


@pytest.mark.parametrize(
    "literal,value,shown",
    [
        ("45.46", 45.4569, "45.46"),
        ("0.836", 0.83549, "0.835"),
        ("1588", 1588.4, "1588"),
        ("+3.7", 3.66, "+3.7"),
    ],
)
def test_a_number_is_shown_at_its_literals_decimals(literal, value, shown):
    """Rounded once, from the file's value (0.83549 is 0.835: the text had 0.836, rounded twice)."""
    assert why._shown(value, literal) == shown
