"""The findings report judges each claim on the verdict-protocol run (``<source>_verdict.json``) when
that run holds every row the claim needs, and on the benchmark's own JSON otherwise."""

import pytest

from benchmarks.findings import claims
from benchmarks.findings import findings as findings_module


@pytest.fixture(scope="module")
def findings():
    return findings_module


def _claim(findings):
    def judge(res):
        r = {row["name"]: row for row in res["rows"]}
        return f"{r['a']['ppl']} vs {r['b']['ppl']}", "holds" if r["a"]["ppl"] < r["b"]["ppl"] else "no"

    return findings.Finding("P", "a beats b", "bench", judge)


def _rows(**ppl):
    return {"rows": [{"name": k, "ppl": v} for k, v in ppl.items()]}


def test_verdict_run_wins_when_complete(findings, monkeypatch):
    store = {"bench": _rows(a=2.0, b=1.0), "bench_verdict": _rows(a=1.0, b=2.0)}
    monkeypatch.setattr(findings, "load", store.get)
    assert findings.judge(_claim(findings)) == ("1.0 vs 2.0", "holds", "bench_verdict")


def test_falls_back_when_verdict_lacks_a_row(findings, monkeypatch):
    store = {"bench": _rows(a=2.0, b=1.0), "bench_verdict": _rows(a=1.0)}
    monkeypatch.setattr(findings, "load", store.get)
    assert findings.judge(_claim(findings)) == ("2.0 vs 1.0", "no", "bench")


def test_missing_everywhere_names_the_run(findings, monkeypatch):
    monkeypatch.setattr(findings, "load", {"bench_verdict": _rows(a=1.0)}.get)
    nums, v, used = findings.judge(_claim(findings))
    assert nums == "" and "bench_verdict.json has no 'b'" in v and used == "bench"
    monkeypatch.setattr(findings, "load", {}.get)
    assert findings.judge(_claim(findings))[1].startswith(
        "not measured: run python -m benchmarks.<topic>.bench"
    )


def test_two_seeds_must_agree(findings, monkeypatch, tmp_path):
    """A second seed's verdict run (``<source>_verdict_s1.json``) joins the judgement: agreeing seeds
    keep the verdict (both seeds' numbers shown), disagreeing ones make it undecided."""
    (tmp_path / "bench_verdict_s1.json").write_text("{}")
    monkeypatch.setattr(findings, "RESULTS", tmp_path)
    agree = {"bench_verdict": _rows(a=1.0, b=2.0), "bench_verdict_s1": _rows(a=1.5, b=2.5)}
    monkeypatch.setattr(findings, "load", agree.get)
    nums, v, used = findings.judge(_claim(findings))
    assert (nums, v, used) == ("1.0 vs 2.0; bench_verdict_s1: 1.5 vs 2.5", "holds", "bench_verdict")
    assert findings.judge_seeds(_claim(findings))[3] == 2  # the report's protocol column says "2 seeds"
    monkeypatch.setattr(findings, "load", {"bench_verdict": _rows(a=1.0, b=2.0)}.get)
    assert findings.judge_seeds(_claim(findings))[3] == 1  # a seed-1 file lacking the rows does not count
    # a seed-2 run still going (or cut short) has only its partial file: not a seed
    (tmp_path / "bench_verdict_s2.partial.json").write_text("{}")
    assert findings.verdict_runs("bench") == ["bench_verdict", "bench_verdict_s1"]
    split = {"bench_verdict": _rows(a=1.0, b=2.0), "bench_verdict_s1": _rows(a=3.0, b=2.5)}
    monkeypatch.setattr(findings, "load", split.get)
    assert findings.judge(_claim(findings))[1] == "undecided (the seeds disagree: holds / no)"


def test_seeds_agree_on_the_verdict_not_on_its_reason(findings, monkeypatch, tmp_path):
    """Two seeds that both say "does not hold" agree though their reasons quote different numbers (the
    first seed's reason is kept); before, the reasons made them "disagree"."""

    def judge(res):
        x = res["rows"][0]["ppl"]
        return f"{x}", f"does not hold here (best {x}x)"

    (tmp_path / "bench_verdict_s1.json").write_text("{}")
    monkeypatch.setattr(findings, "RESULTS", tmp_path)
    runs = {"bench_verdict": _rows(a=1.6), "bench_verdict_s1": _rows(a=2.3)}
    monkeypatch.setattr(findings, "load", runs.get)
    claim = findings.Finding("P", "a within 1.5x", "bench", judge)
    assert findings.judge(claim)[1] == "does not hold here (best 1.6x)"


def test_three_seeds_take_the_majority(findings, monkeypatch, tmp_path):
    """With three seeds that disagree the verdict most of them give stands, counted; a tie stays
    undecided."""
    for n in (1, 2):
        (tmp_path / f"bench_verdict_s{n}.json").write_text("{}")
    monkeypatch.setattr(findings, "RESULTS", tmp_path)
    runs = {
        "bench_verdict": _rows(a=3.0, b=2.5),
        "bench_verdict_s1": _rows(a=1.0, b=2.0),
        "bench_verdict_s2": _rows(a=1.5, b=2.0),
    }
    monkeypatch.setattr(findings, "load", runs.get)
    assert findings.judge(_claim(findings))[1] == "holds (2 of 3 seeds; the others: no)"
    runs["bench_verdict_s2"] = _rows(a=2.5, b=2.0)
    assert findings.judge(_claim(findings))[1] == "no (2 of 3 seeds; the others: holds)"
    assert findings.majority(["holds", "no"]) == "undecided (the seeds disagree: holds / no)"
    # two seeds say "no" for different reasons: still two of three
    assert findings.majority(["no (x 1)", "holds", "no (x 2)"]) == "no (2 of 3 seeds; the others: holds)"
    assert findings.majority(["holds", "no", "holds", "no"]).startswith("undecided")


def test_the_protocol_summary_counts_each_kind(findings):
    kinds = ("verdict, 2 seeds", "verdict, one seed", "fast", "-", "16x512 calib, every window")
    kinds += ("fresh (8x256 calib)", "128x512 calib, per layer (no perplexity)")
    rows = [{"protocol": p} for p in kinds]
    line = findings.protocol_summary(rows)
    assert line == (
        "Of 7 claims: 2 on the verdict protocol, 2 on no perplexity (timings, per-layer errors), "
        "2 on other settings, 1 on the fast protocol."
    )


def test_a_per_layer_result_names_its_calibration_not_windows(findings):
    """A per-layer measurement (calibration, no perplexity pass) is not labelled as scoring every window."""
    layers = {"args": {"nsamples": 128, "seqlen": 512}, "layers": {}}
    assert findings.protocol_of(layers) == "128x512 calib, per layer (no perplexity)"
    ppl = {"args": {"nsamples": 64, "seqlen": 512, "max_windows": None}, "rows": [{"ppl": 1.0}]}
    assert findings.protocol_of(ppl) == "64x512 calib, every window"
    assert findings.protocol_of({"args": {"nsamples": 16, "max_windows": 20}, "rows": []}) == "fast"


def test_seeds_that_agree_but_add_different_notes_agree(findings, monkeypatch, tmp_path):
    """A verdict's notes after "; " (a pair under 10% on one seed only) do not make two seeds disagree."""
    (tmp_path / "bench_verdict_s1.json").write_text("{}")
    monkeypatch.setattr(findings, "RESULTS", tmp_path)

    def judge(res):
        r = {row["name"]: row for row in res["rows"]}
        close = r["b"]["ppl"] / r["a"]["ppl"] < 1.1
        return "n", "holds" + ("; under 10% apart" if close else "") if r["a"]["ppl"] < r["b"][
            "ppl"
        ] else "no"

    runs = {"bench_verdict": _rows(a=1.0, b=1.05), "bench_verdict_s1": _rows(a=1.0, b=2.0)}
    monkeypatch.setattr(findings, "load", runs.get)
    claim = findings.Finding("P", "a beats b", "bench", judge)
    assert findings.judge(claim)[1] == "holds; under 10% apart"
    runs["bench_verdict_s1"] = _rows(a=2.0, b=1.0)
    assert findings.judge(claim)[1].startswith("undecided (the seeds disagree")


def test_a_pooled_claim_sees_every_seed_at_once_and_never_a_later_seed_alone(findings, monkeypatch, tmp_path):
    """A pooled claim (SFMP's main table, whose second seed repeats only the pairs under 10%) is judged
    once on seed 0 with the other seeds beside it (``res["seeds"]``), says itself how many seeds its
    pairs rest on, and falls back to the benchmark's own run, never to a later seed judged alone."""
    (tmp_path / "bench_verdict_s1.json").write_text("{}")
    monkeypatch.setattr(findings, "RESULTS", tmp_path)
    seen = []

    def judge(res):
        seen.append(sorted(res["seeds"]))
        r = {row["name"]: row for row in res["rows"]}
        return f"{r['a']['ppl']} vs {r['b']['ppl']}", "holds", 1 + len(res["seeds"])

    claim = findings.Finding("P", "a beats b", "bench", judge, pooled=True)
    runs = {"bench_verdict": _rows(a=1.0, b=2.0), "bench_verdict_s1": _rows(a=1.5)}
    monkeypatch.setattr(findings, "load", runs.get)
    assert findings.judge_seeds(claim) == ("1.0 vs 2.0", "holds", "bench_verdict", 2)
    assert seen == [["bench_verdict_s1"]]
    # seed 0 lacks a row: the benchmark's own run (no seeds beside it), not seed 1 alone
    runs.update(bench_verdict=_rows(a=1.0), bench_verdict_s1=_rows(a=1.5, b=2.5), bench=_rows(a=3.0, b=4.0))
    assert findings.judge_seeds(claim) == ("3.0 vs 4.0", "holds", "bench", 0)
    del runs["bench"]
    assert (
        findings.judge_seeds(claim)[1]
        == "not measured: bench_verdict.json has no 'b'; rerun python -m benchmarks.<topic>.bench"
    )


def test_every_why_text_names_a_claim():
    """Each claim's "why this may differ" text is keyed by the claim's words: a key that names no claim
    (a claim reworded, its text left behind) stops the report instead of leaving the column blank."""
    assert all(f.differ for f in claims.FINDINGS if f.claim in claims.WHY)
    assert {k.removeprefix(claims.SECOND) for k in claims.WHY} <= {f.claim for f in claims.FINDINGS}
    assert set(claims.SECOND_WHY) <= claims.SECOND_MODEL  # a second-model text is for a claim run there
    f = claims.Finding("P", "a claim", "bench", None)
    claims.attach_why([f], {"a claim": "its text"})
    assert f.differ == "its text"
    with pytest.raises(KeyError, match="a claim reworded since"):
        claims.attach_why([f], {"a claim": "its text", "a claim reworded since": "its old text"})


def test_a_missing_run_names_the_module_that_measures_it(findings):
    """The "not measured" line and ``--run`` name the benchmark that writes a result, as a module of
    the package: the script of that name in its topic folder, or the one whose part it is."""
    assert findings.module_of("dpq") == "benchmarks.waq.dpq"
    assert findings.module_of("ssqr_groups_verdict") == "benchmarks.lattice.ssqr_groups"
    assert findings.module_of("mosaic_thin") == "benchmarks.mosaic.mosaic"  # mosaic.py --parts thin
    assert findings.module_of("sfmp_decode") == "benchmarks.sfmp.sfmp"  # sfmp.py --parts decode


def test_second_model_rows_and_flips(findings, monkeypatch):
    """Issue 73: a claim of ``claims.SECOND_MODEL`` gets a Gemma-3-270m row judged by the same judge on
    ``<source>_gemma*.json``; where the two models' verdicts differ, both rows say so; a claim outside
    the set keeps one row; a second-model run not yet made says which command makes it."""
    f = _claim(findings)
    monkeypatch.setattr(findings, "SECOND_MODEL", frozenset({f.claim}))
    store = {"bench_verdict": _rows(a=1.0, b=2.0), "bench_gemma": _rows(a=3.0, b=2.0)}
    monkeypatch.setattr(findings, "load", store.get)
    rows = findings.flag_flips(findings.model_rows(f, None))
    assert [(r["model"], r["source"]) for r in rows] == [
        ("SmolLM2-135M", "bench_verdict"), ("Gemma-3-270m", "bench_gemma")
    ]
    assert rows[0]["verdict"].startswith("holds; flips between models: SmolLM2-135M holds")
    assert rows[1]["verdict"].startswith("no; flips between models:")
    assert rows[1]["may_differ"] == findings.GEMMA_DIFFERS  # no Gemma text in the yaml: the shared one
    store["bench_gemma"] = _rows(a=1.5, b=2.0)  # the same verdict: nothing flagged
    rows = findings.flag_flips(findings.model_rows(f, None))
    assert [r["verdict"] for r in rows] == ["holds", "holds"]
    del store["bench_gemma"]
    rows = findings.flag_flips(findings.model_rows(f, None))
    assert rows[0]["verdict"] == "holds"  # a second model not measured is no flip
    assert rows[1]["verdict"].endswith("second_model --only bench --protocol verdict")
    monkeypatch.setattr(findings, "SECOND_MODEL", frozenset())
    assert len(findings.model_rows(f, None)) == 1


def test_second_model_claims_exist_and_runs_are_defined():
    """Every claim named for the second model is a claim of the report whose source the Gemma driver
    knows how to run (same rows, ``--model gemma3-270m``)."""
    from benchmarks.findings import second_model

    by_claim = {f.claim: f for f in claims.FINDINGS}
    assert claims.SECOND_MODEL <= set(by_claim)
    assert {by_claim[c].source for c in claims.SECOND_MODEL} <= set(second_model.RUNS)
    cmd = second_model.command("lattice", "verdict", 1)
    assert cmd[cmd.index("--model") + 1] == "gemma3-270m"
    assert cmd[cmd.index("--json") + 1].endswith("lattice_gemma_verdict_s1.json")


def test_a_qualified_verdict_is_no_flip(findings):
    """"holds at BPW 4.25 only" on one model and "holds" on the other agree (the word counts, not its
    qualifiers); "holds" against "within noise" is a flip."""
    rows = [{"model": "A", "verdict": "holds", "protocol": "verdict, 3 seeds"},
            {"model": "B", "verdict": "holds at BPW 4.25 only; 2 pairs close", "protocol": "fast"}]
    same = findings.flag_flips([dict(r) for r in rows])
    assert [r["verdict"] for r in same] == [r["verdict"] for r in rows]
    rows[1]["verdict"] = "within noise (interval includes 1)"
    flagged = findings.flag_flips(rows)
    assert flagged[0]["verdict"] == "holds; flips between models: A holds (verdict) / B within noise (fast)"


def test_a_run_that_names_its_protocol_only_in_its_arguments(findings):
    """``static_groups.py``'s older runs say ``"protocol": "verdict"`` only among their arguments (their
    windows key is ``windows``, not ``max_windows``): that word is taken; a run's own top-level word wins
    over its arguments' (a mixed table is not called verdict because its last arguments were)."""
    old = {"args": {"protocol": "verdict", "nsamples": 128, "windows": None}, "rows": [{"ppl": 1.0}]}
    assert findings.protocol_of(old) == "verdict"
    mixed = {"protocol": "fast+verdict", "args": {"protocol": "verdict", "nsamples": 16, "max_windows": 20}}
    assert findings.protocol_of(mixed) == "fast"  # the settings, not the arguments' word
