"""``benchmarks/sfmp/sfmp.py``'s bookkeeping (no model): the verdict protocol refuses a Fisher from fewer
than 128 samples before anything loads, every row records its protocol, and the ablation rows are
named by their code bits and block rows."""

import pytest

from benchmarks.sfmp import sfmp


@pytest.fixture(scope="module")
def sfmp_bench():
    return sfmp


def _args(mod, argv, salience=None):
    a = mod.base_parser("x").parse_args(argv)
    a.salience_samples = salience
    return a


def test_verdict_needs_a_fisher_from_128_samples(sfmp_bench):
    a = _args(sfmp_bench, ["--protocol", "verdict"], salience=32)
    with pytest.raises(SystemExit, match="error: verdict rows need a Fisher from >= 128 samples; got 32"):
        sfmp_bench.SFMPBench(a)  # refused before the model loads (the test has none)
    # fewer calibration samples are not the verdict protocol: such rows are labelled by their settings
    few = _args(sfmp_bench, ["--protocol", "verdict", "--nsamples", "64"])
    assert sfmp_bench.protocol_of(few) == "64x512 calib, every window"


def test_rows_record_their_protocol_and_ablation_names(sfmp_bench):
    assert sfmp_bench.protocol_of(_args(sfmp_bench, ["--protocol", "fast"])) == "fast"
    assert sfmp_bench.protocol_of(_args(sfmp_bench, ["--protocol", "verdict"])) == "verdict"
    assert sfmp_bench.protocol_of(_args(sfmp_bench, [])) == "32x512 calib, 40 windows"
    assert sfmp_bench._abl("3.25", "gptq", 3.0684678, 64) == "3.25 sfmp-gptq g256 mb=64 b=3.068"
    assert sfmp_bench._abl("3.0", "awq", 2.73, 64, 256) == "3.0 sfmp-awq g128 mb=64 nb=256 b=2.730"


class _Bench:
    """What :func:`matched_bpw` reads of a bench: its args and its rows by name."""

    def __init__(self, budget_bpw, rows=None):
        self.args = type("A", (), {"budget_bpw": budget_bpw})()
        self.rows = rows or {}

    def get(self, name):
        return self.rows.get(name)


def test_budget_comes_from_the_runs_rows_or_from_budget_bpw(sfmp_bench):
    ours, awq, _ = sfmp_bench._baselines("3.25")
    rows = {ours: {"bits_per_weight": 3.316}, awq: {"bits_per_weight": 3.271}}
    assert sfmp_bench.matched_bpw(_Bench(None, rows), "3.25") == 3.271  # the smaller measured one
    # an ablation-only run (say, a second seed) takes the budget measured by an earlier run
    assert sfmp_bench.matched_bpw(_Bench("3.25=3.2708333333333335"), "3.25") == 3.2708333333333335
    with pytest.raises(SystemExit, match=r"point 3.0: run --parts main first .* --budget-bpw 3.0=BPW"):
        sfmp_bench.matched_bpw(_Bench("3.25=3.27"), "3.0")
    for bad in ("3.25", "3.25=x", "3.25=-1"):
        with pytest.raises(SystemExit, match="give POINT=BPW pairs"):
            sfmp_bench.matched_bpw(_Bench(bad), "3.25")


def test_a_copied_row_keeps_the_cpu_that_measured_it(sfmp_bench, tmp_path):
    """``copy_row`` reuses a measured row under another name: it keeps the source's CPU (None for rows
    from before rows named it), not the CPU of the run that copies it."""
    b = sfmp_bench.SFMPBench.__new__(sfmp_bench.SFMPBench)
    b.args, b.rows, b.done, b.partial_path = _args(sfmp_bench, []), [], {}, tmp_path / "s.partial.json"
    src = {"name": "3.25 sfmp-gptq g256", "ppl": 45.0, "bits_per_weight": 3.27, "cpu": "Xeon"}
    b.copy_row("3.25 sfmp-gptq g256 mb=512", src, "the main row")
    old = {k: v for k, v in src.items() if k != "cpu"}
    b.copy_row("3.25 sfmp-gptq g256 old", old, "a row from before rows named their CPU")
    got = {r["name"]: r for r in b.rows}
    assert got["3.25 sfmp-gptq g256 mb=512"]["cpu"] == "Xeon"
    assert got["3.25 sfmp-gptq g256 old"]["cpu"] is None
    assert got["3.25 sfmp-gptq g256 mb=512"]["copied_from"] == "3.25 sfmp-gptq g256"
    # a row measured by this run names this run's CPU
    from benchmarks.harness import cpu_name

    assert b._add({"name": "new", "ppl": 1.0, "bits_per_weight": 4.0})["cpu"] == cpu_name()
