"""bitmosaic compare: config grammar, Pareto frontier, the plot, and a resumable run on a tiny model."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.cli.compare import parse_configs
from bitmosaic.errors import BitmosaicError
from bitmosaic.eval.compare import collect_rows
from bitmosaic.eval.plots import CLIP, pareto_front, pareto_plot
from tests.helpers import compare_in_process, save_hf_dir, words


def test_config_grammar_maps_onto_quantize_flags():
    c = parse_configs("rtn:w4g128, gptq:w3gch;order=natural;static-groups, smoothquant:w8a8, dpq:w4a8-fp8")
    assert [x.name for x in c] == ["rtn:w4g128", "gptq:w3gch;order=natural;static-groups",
                                   "smoothquant:w8a8", "dpq:w4a8-fp8"]  # fmt: skip
    assert c[0].flags == ["--method", "rtn", "--group-size", "128", "--bits", "4"]
    assert c[1].flags == ["--method", "gptq", "--group-size", "-1", "--bits", "3", "--order", "natural",
                          "--static-groups"]  # fmt: skip
    assert c[2].flags == ["--method", "smoothquant", "--scheme", "W8A8"]
    assert c[3].flags == ["--method", "dpq", "--scheme", "W4A8-FP8"]
    assert parse_configs("sfmp:bpw3.25")[0].flags == ["--method", "sfmp", "--bpw", "3.25"]


@pytest.mark.parametrize(
    "bad, why",
    [("gptq:w4x9", "cannot read"), ("gptq:a8", "weight bits"), (":w4", "method:setting"),
     ("rtn:w4, rtn:w4", "more than once"), (" , ", "empty")],  # fmt: skip
)
def test_bad_configs_are_one_line_errors(bad, why):
    with pytest.raises(BitmosaicError, match=why):
        parse_configs(bad)


def test_long_config_list_with_slashes_is_not_taken_for_a_path():
    """'(8/4)' splits the text into path parts; a part over 255 bytes made is_file() raise."""
    head = ", ".join(f"{m}:w{b}g{g}" for m in ("rtn", "gptq") for b in (2, 3, 4, 8) for g in (32, 64, 128))
    spec = head + ", sq-weights:;sq=32-(8/4)-0.75, sq-acts:w4;sq=16-(8/4)-0.5;strategy=static"
    assert len(spec.split("/")[0]) > 255
    c = parse_configs(spec)
    assert len(c) == 26 and c[-1].flags[-2:] == ["--strategy", "static"]


def test_configs_file_json(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps([{"name": "a", "method": "gptq", "bits": 3, "order": "act", "sym": True}]))
    (c,) = parse_configs(str(p))
    assert c.flags == ["--method", "gptq", "--bits", "3", "--order", "act", "--sym"]
    p.write_text("[1, 2]")
    with pytest.raises(BitmosaicError, match="list of mappings"):
        parse_configs(str(p))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(1, 50)), min_size=1, max_size=12))
def test_pareto_front_is_exactly_the_undominated_points(pts):
    pts = [(float(b), float(p)) for b, p in pts]
    front = set(pareto_front(pts))
    for i, (b, p) in enumerate(pts):
        dominated = any(b2 <= b and p2 <= p and (b2, p2) != (b, p) for b2, p2 in pts)
        assert (i in front) == (not dominated)


def test_pareto_plot_png_has_size_and_data(tmp_path):
    import matplotlib.image as mpimg

    rng = random.Random(0)
    rows = [{"name": f"m{i}", "method": "gptq" if i % 2 else "rtn", "bits_per_weight": 2 + i * 0.5,
             "ppl": 10 + rng.random() * 100} for i in range(8)]  # fmt: skip
    fig = pareto_plot(rows, tmp_path / "p.png", float_ppl=9.0)
    img = mpimg.imread(tmp_path / "p.png")
    assert img.shape[:2] == (600, 900)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    plotted = sum(len(c.get_offsets()) for c in ax.collections)
    assert plotted == len(rows)
    front = pareto_front([(r["bits_per_weight"], r["ppl"]) for r in rows])
    line = next(ln for ln in ax.lines if ln.get_label() == "Pareto frontier")
    assert list(line.get_xdata()) == [rows[i]["bits_per_weight"] for i in front]
    assert (img[..., :3] < 0.5).any()  # something dark was drawn


def test_pareto_plot_puts_a_collapsed_config_on_the_top_edge(tmp_path):
    rows = [{"name": "good", "method": "gptq", "bits_per_weight": 4.0, "ppl": 20.0},
            {"name": "ok", "method": "rtn", "bits_per_weight": 3.0, "ppl": 60.0},
            {"name": "broken", "method": "rtn", "bits_per_weight": 2.0, "ppl": 8e5}]  # fmt: skip
    ax = pareto_plot(rows, tmp_path / "p.png").axes[0]
    ys = sorted(y for c in ax.collections for _, y in c.get_offsets())
    assert ys[-1] == pytest.approx(CLIP * 20.0) and ys[:2] == [20.0, 60.0]
    assert any("broken (8e+05, off scale)" == t.get_text() for t in ax.texts)
    assert ax.get_ylim()[1] < 8e5


def test_compare_end_to_end_is_resumable(tmp_path, capsys):
    from bitmosaic.cli import main

    model = save_hf_dir(tmp_path / "tiny")
    text = tmp_path / "text.txt"
    text.write_text(words(4000))
    out = tmp_path / "cmp"
    argv = ["compare", "--model", str(model), "--configs", "rtn:w4g32, rtn:w8g32, rtn:w4g32;no-such-flag",
            "--calib", str(text), "--eval", str(text), "--nsamples", "2", "--seqlen", "32",
            "--eval-seqlen", "32", "--max-windows", "4", "--out", str(out), "--no-progress"]  # fmt: skip
    # the configs run in this process except the failing one: compare's own subprocess path still runs
    with compare_in_process(subprocess_if=lambda cmd: "no-such-flag" in " ".join(cmd)):
        assert main(argv) == 1  # one config fails; the others finish
    rows = collect_rows(out)
    assert [r["name"] for r in rows] == ["float", "rtn:w4g32", "rtn:w8g32"]
    w4, w8 = rows[1], rows[2]
    assert w4["bits_per_weight"] < w8["bits_per_weight"] and w4["size_mb"] < w8["size_mb"]
    assert w8["kl_mean"] <= w4["kl_mean"] and 0 <= w4["top1_agreement"] <= 1
    fails = json.loads((out / "failures.json").read_text())
    assert list(fails) == ["rtn:w4g32;no-such-flag"] and "no-such-flag" in fails["rtn:w4g32;no-such-flag"]
    assert (out / "pareto.png").is_file() and "rtn:w8g32" in (out / "results.md").read_text()
    header = (out / "results.csv").read_text().splitlines()[0]
    assert header.startswith("name,method,bits_per_weight,size_mb,ppl,kl_mean,kl_p99,top1_agreement")
    stamp = (out / "runs" / "rtn_w4g32.json").stat().st_mtime_ns
    (out / "logs" / "rtn_w4g32.log").unlink()
    assert main(argv[:4] + ["rtn:w4g32, rtn:w8g32"] + argv[5:]) == 0  # resumes: nothing is rerun
    assert (out / "runs" / "rtn_w4g32.json").stat().st_mtime_ns == stamp
    assert not (out / "logs" / "rtn_w4g32.log").exists()


def test_compare_without_keeping_models_keeps_their_sizes(tmp_path, capsys):
    """``--no-keep-models``: the table still has each model's size (measured before deletion), no
    model stays on disk, and the run says how much disk the folder takes."""
    from bitmosaic.cli import main

    model = save_hf_dir(tmp_path / "tiny")
    text = tmp_path / "text.txt"
    text.write_text(words(4000))
    out = tmp_path / "cmp"
    argv = ["compare", "--model", str(model), "--configs", "rtn:w4g32, rtn:w8g32", "--calib", str(text),
            "--eval", str(text), "--nsamples", "2", "--seqlen", "32", "--eval-seqlen", "32",
            "--max-windows", "2", "--out", str(out), "--no-progress", "--no-keep-models"]  # fmt: skip
    with compare_in_process():
        assert main(argv) == 0
    rows = collect_rows(out)
    w4, w8 = rows[1], rows[2]
    assert 0 < w4["size_mb"] < w8["size_mb"]
    assert not any((out / "models").glob("*/*.safetensors"))
    assert "disk: " in capsys.readouterr().out
