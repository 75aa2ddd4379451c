"""The benchmarks' shared flags (``benchmarks/harness/``): ``--protocol`` fills the calibration and
test-window counts of the project's two protocols, explicit values win, and the label a result gets
names the protocol only when the settings are that protocol's."""

import pytest

from benchmarks import harness
from benchmarks.harness import bench as harness_bench
from benchmarks.waq import int_ppl


@pytest.fixture(scope="module")
def common():
    return harness


@pytest.mark.parametrize(
    "argv,nsamples,windows,fidelity,label",
    [
        ([], 32, 40, False, "custom"),  # the historical defaults
        (["--protocol", "fast"], 16, 20, False, "fast"),
        (["--protocol", "verdict"], 128, None, True, "verdict"),  # the whole test set, KL and top-1
        (["--protocol", "verdict", "--nsamples", "256"], 256, None, True, "verdict"),
        (["--protocol", "fast", "--nsamples", "32"], 32, 20, False, "custom"),
        (["--nsamples", "128", "--max-windows", "0", "--fidelity"], 128, None, True, "verdict"),
        (["--nsamples", "128", "--max-windows", "0"], 128, None, False, "custom"),  # no KL, top-1
    ],
)
def test_protocol_flags(common, argv, nsamples, windows, fidelity, label):
    a = common.base_parser("x").parse_args(argv)
    assert (a.nsamples, a.max_windows, a.fidelity) == (nsamples, windows, fidelity)
    assert common.protocol_label(a) == label
    assert a.device == "cpu"


def test_only_picks_rows(common):
    """``--only`` names the rows a run measures; a row it leaves out is not quantized at all."""
    a = common.base_parser("x").parse_args(["--only", "W4A8 dpq gar,float"])
    bench = common.Bench.__new__(common.Bench)  # no model: run() must return before touching one
    bench.args = a
    assert bench.wants("W4A8 dpq gar") and not bench.wants("W4A8 dpq")
    assert bench.run("W4A8 rtn", "no-such-method") is None
    bench.args = common.base_parser("x").parse_args(["--only", "W4A8 dpq gar"])
    assert bench.float_row() is None  # left out: not evaluated
    everything = common.Bench.__new__(common.Bench)
    everything.args = common.base_parser("x").parse_args([])
    assert everything.wants("anything")


def test_only_rows_join_the_same_run(common, tmp_path):
    """Rows of an ``--only`` run join an earlier run of the same settings (replacing a row measured
    again); a run of other settings, or a run without ``--only``, is not merged."""
    import json

    path = tmp_path / "b.json"
    a = common.base_parser("x").parse_args(["--protocol", "verdict", "--only", "y,z"])
    old = {"args": vars(a) | {"only": "x,y"}, "rows": [{"name": "x", "ppl": 1}, {"name": "y", "ppl": 2}]}
    path.write_text(json.dumps(old))
    rows = [{"name": "y", "ppl": 3}, {"name": "z", "ppl": 4}]
    assert common.merged_rows(path, a, rows) == [{"name": "x", "ppl": 1}, rows[0], rows[1]]
    other = common.base_parser("x").parse_args(["--protocol", "verdict", "--seed", "1", "--only", "y"])
    assert common.merged_rows(path, other, rows) == rows
    full = common.base_parser("x").parse_args(["--protocol", "verdict"])
    assert common.merged_rows(path, full, rows) == rows
    # a run written before --fidelity/--device were recorded: their defaults
    fast = common.base_parser("x").parse_args(["--protocol", "fast", "--only", "y"])
    older = {k: v for k, v in vars(fast).items() if k not in ("fidelity", "device")}
    path.write_text(json.dumps({"args": older, "rows": [{"name": "x", "ppl": 1}]}))
    assert common.merged_rows(path, fast, rows[:1]) == [{"name": "x", "ppl": 1}, rows[0]]


def test_int_ppl_paired_ratio_interval():
    """``benchmarks/waq/int_ppl.py``'s integer-vs-simulated ratio: exp of the mean per-window NLL difference
    (what the two perplexities' ratio is, windows being equally long), with an interval that is empty
    for a constant shift and widens with window-to-window spread."""
    import math

    import torch

    mod = int_ppl
    ref = torch.tensor([3.0, 3.2, 2.9, 3.4], dtype=torch.float64)  # window_nll sums in float64
    shifted = mod.paired_ratio(ref + 0.001, ref)
    assert shifted["ppl_ratio_minus_1"] == pytest.approx(math.expm1(0.001), rel=1e-9)
    lo, hi = shifted["ppl_ratio_ci95"]
    assert lo == pytest.approx(hi, abs=1e-12)  # no spread: the shift is known exactly
    ratio = math.exp(float((ref + 0.001).mean())) / math.exp(float(ref.mean())) - 1
    assert shifted["ppl_ratio_minus_1"] == pytest.approx(ratio, rel=1e-9)
    noisy = mod.paired_ratio(ref + torch.tensor([0.01, -0.01, 0.02, -0.02]), ref)
    lo, hi = noisy["ppl_ratio_ci95"]
    assert lo < noisy["ppl_ratio_minus_1"] < hi and lo < 0 < hi


def test_only_takes_row_names_with_commas(common, capsys, tmp_path):
    """A row name with commas of its own (``no sparse, alpha kept``) is picked where it stands whole in
    the list, and is not reported as unknown pieces."""
    only = ["--only", "random,no sparse, alpha kept,typo", "--json", str(tmp_path / "x.json")]
    a = common.base_parser("x").parse_args(only)
    bench = common.Bench.__new__(common.Bench)
    bench.args, bench.rows, bench._seen, bench.device = a, [], set(), "cpu"
    assert bench.wants("no sparse, alpha kept") and bench.wants("random")
    assert not bench.wants("magnitude") and not bench.wants("alpha kept")
    bench.finish("x", [])
    note = capsys.readouterr().out.splitlines()[0]
    assert note == "note: --only names no row of this benchmark: typo"
    # a run of several parts offers every part's names first: the first part's finish does not call
    # the next part's rows unknown
    a.only = "random,block 1x128"
    bench._seen = set()
    bench.offer(["random", "block 1x128"])
    assert bench.wants("random")
    bench.finish("x", [])
    assert "note: --only" not in capsys.readouterr().out


def test_a_partial_run_resumes_with_only(common, tmp_path, monkeypatch):
    """The partial file of a run cut short carries the run's settings: copied to the JSON's path, the
    rows of a later ``--only`` run of the same settings join it; each row names the CPU it ran on (rows
    accumulate over sessions and machines)."""
    import json

    monkeypatch.setattr(harness_bench, "peak_rss_mb", lambda: 0.0)
    a = common.base_parser("x").parse_args(["--protocol", "verdict"])
    cut = common.Bench.__new__(common.Bench)
    cut.args, cut.rows, cut.partial_path = a, [], tmp_path / "b.partial.json"
    cut._add({"name": "x", "ppl": 1.0, "bits_per_weight": 4.0})
    resumed = common.base_parser("x").parse_args(["--protocol", "verdict", "--only", "y"])
    (tmp_path / "b.json").write_text(cut.partial_path.read_text())
    rows = [{"name": "y", "ppl": 2.0}]
    assert common.merged_rows(tmp_path / "b.json", resumed, rows) == [
        {"name": "x", "ppl": 1.0, "bits_per_weight": 4.0, "cpu": common.cpu_name()},
        rows[0],
    ]
    assert (
        common.cpu_name() and json.loads(cut.partial_path.read_text())["rows"][0]["cpu"] == common.cpu_name()
    )
    assert json.loads(cut.partial_path.read_text())["protocol"] == "verdict"


def test_act_paths_name_the_compute_each_row_ran(common):
    """A row records how its activation-quantized layers computed: the integer kernel, or simulated
    (``$BITMOSAIC_ACT_COMPUTE=sim``, FP8 activations, a layer the integer path refuses); weight-only
    layers are not counted and a model without activation quantizers records nothing."""
    import torch

    from bitmosaic.algorithms.rtn import rtn_quantize
    from bitmosaic.formats.act import ActQuantSpec
    from bitmosaic.formats.grid import IntGrid
    from bitmosaic.modules import QuantLinear, attach_input_quant
    from bitmosaic.modules.intact import ACT_COMPUTE_ENV
    from tests.helpers import env_var

    def layer(spec):
        res = rtn_quantize(
            torch.randn(8, 96, generator=torch.Generator().manual_seed(0)), IntGrid(4, True), 32
        )
        m = QuantLinear.from_result(res, bits=4, group_size=32, symmetric=True)
        if spec is not None:
            attach_input_quant(m, spec, 96)
        return m

    refused = ActQuantSpec("int", 8, granularity="group", group_size=48)  # groups that cut weight groups
    model = torch.nn.Sequential(layer(ActQuantSpec("int", 8)), layer(refused), layer(None))
    x = torch.randn(3, 96)
    with torch.inference_mode():
        for m in model:
            m(x)
    assert common.act_paths(model) == {"integer": 1, "simulated": 1}
    assert common.act_paths(model, "meta") == {"simulated": 2}  # the integer kernels are the CPU's
    with env_var(ACT_COMPUTE_ENV, "sim"):
        assert common.act_paths(model) == {"simulated": 2}
    assert common.act_paths(torch.nn.Sequential(layer(None))) == {}


def test_every_measured_row_keeps_its_window_nlls_on_one_json_line(common, tmp_path):
    """``Bench.measure`` keeps each window's mean NLL (``window_nll``, 6 significant digits) beside the
    perplexity, for the findings' paired bootstrap of a close pair (issue 73); the results' JSON writes
    that list on one line (a verdict row has 589 windows) and reads back the same."""
    import json
    import math

    import torch

    from bitmosaic.testing import VOCAB, tiny_llama, word_tokenizer

    bench = common.Bench.__new__(common.Bench)
    bench.args = common.base_parser("x").parse_args(["--seqlen", "16", "--max-windows", "3"])
    bench.model, bench.tok, bench.reference = tiny_llama(), word_tokenizer(), None
    bench.device, bench.progress = "cpu", False
    bench.eval_ids = torch.randint(4, VOCAB, (1, 16 * 5), generator=torch.Generator().manual_seed(0))
    row = bench.measure(bench.model)
    assert len(row["window_nll"]) == 3 == row["windows"]
    assert all(float(f"{v:.6g}") == v for v in row["window_nll"])
    assert math.exp(sum(row["window_nll"]) / 3) == pytest.approx(row["ppl"], rel=1e-5)
    out = {"rows": [{"name": "float", **row}], "args": {"seed": 0}}
    text = common.dumps_results(out)
    assert json.loads(text) == out
    assert '"window_nll": [' + ",".join(map(str, row["window_nll"])) + "]" in text
    path = common.write_results(tmp_path / "r.json", "x", dict(out, machine={}))
    assert json.loads(path.read_text())["rows"] == out["rows"]


def test_no_benchmark_sets_protocol_counts_as_defaults():
    """``set_defaults(nsamples=..)`` / ``max_windows`` makes them look explicit, so ``--protocol verdict``
    would silently run with the default counts (it did: int_ppl's verdict run calibrated on 16 samples);
    a benchmark's own default protocol goes through ``set_defaults(protocol=...)`` instead."""
    import re
    from pathlib import Path

    root = Path(harness.__file__).resolve().parents[1]
    bad = [
        str(f.relative_to(root))
        for f in root.rglob("*.py")
        if re.search(r"set_defaults\([^)]*\b(nsamples|max_windows)\s*=", f.read_text())
    ]
    assert not bad, f"set_defaults of nsamples/max_windows in {bad}: use set_defaults(protocol=...)"
