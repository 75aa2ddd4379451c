"""``benchmarks/microscaling.py`` (issue 75) without a model: every row of the table is a valid recipe of
the setting it names (format, solver, activations, rotation), the verdict protocol is accepted, and the
report fills the right cells and compares with the published orderings only where both rows exist."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import microscaling as ms
from benchmarks.harness import base_parser, protocol_label


def test_every_row_is_a_recipe_of_its_setting():
    names = [ms.name_of(*c) for c in ms.CONFIGS]
    assert len(names) == len(set(names)) == 4 * 2 * 2 * 3 + 3 * 2  # the 4-bit matrix + W8A8
    for fmt, method, acts, rot in ms.CONFIGS:
        r = ms.recipe_of(fmt, method, acts, rot)
        s = r.settings
        assert r.method == method and r.rotate == rot
        act = s["act"]
        if acts == "A16":
            assert act is None
        elif fmt.startswith("INT4"):  # A4 per group of the weights' own group
            assert act["fmt"] == "int" and act["bits"] == 4 and act["group_size"] == s["group_size"]
        elif fmt in ("MXFP4", "NVFP4", "MXFP8"):
            assert act["mx"] == s["wfmt"] == fmt.lower()  # the same format's microscaled activations
        elif fmt == "FP8-block":  # llm-compressor's FP8_BLOCK inputs
            assert (act["fmt"], act["granularity"], act["group_size"]) == ("e4m3", "group", 128)
        else:
            assert (act["fmt"], act["bits"], act["granularity"]) == ("int", 8, "token")


@pytest.mark.parametrize("protocol,nsamples,windows", [("fast", 16, 20), ("verdict", 128, None)])
def test_protocols(protocol, nsamples, windows):
    a = base_parser(ms.__doc__).parse_args(["--protocol", protocol])
    assert (a.nsamples, a.max_windows) == (nsamples, windows)
    assert protocol_label(SimpleNamespace(**{**vars(a), "fidelity": True})) == protocol


def _row(fmt, method, acts, rot, ppl):
    return {"name": ms.name_of(fmt, method, acts, rot), "format": fmt, "method": method, "acts": acts,
            "rotate": rot, "rotation": rot, "bits_per_weight": 4.25, "ppl": ppl, "kl_mean": 0.1,
            "top1_agreement": 0.9, "quant_seconds": 1.0}  # fmt: skip


def test_report_cells_and_publishedpublished_checks():
    rows = [{"name": "float", "ppl": 10.0}, _row("NVFP4", "rtn", "A16", "none", 12.0),
            _row("MXFP4", "rtn", "A16", "none", 13.5), _row("MXFP4", "gptq", "A4", "none", 30.0)]  # fmt: skip
    args = {"model": "smollm2-135m", "nsamples": 16, "seqlen": 512, "max_windows": 20, "seed": 0}
    md = ms.markdown(rows, args)
    assert "*fast* protocol" in md and "| rtn W4A16 |  |  | 13.50 (0.100) | 12.00 (0.100) |" in md
    assert "NVFP4 vs MXFP4, rtn W4A16: 12.00 vs 13.50 (as published)" in md
    assert "gptq W4A4" not in "".join(
        ms.published_checks({r["name"]: r for r in rows})
    )  # NVFP4's row is missing
    rows[1]["ppl"] = 14.0
    assert "differs from the published order" in ms.markdown(rows, args)
    rows.append(_row("MXFP4", "gptq", "A4", "block", 20.0))  # a rotation before the other one ran
    checks = ms.published_checks({r["name"]: r for r in rows})
    assert "MXFP4 gptq W4A4: none 30.00, block Hadamard 20.00." in checks, checks
    rows.append(_row("MXFP4", "gptq", "A4", "hadamard", 25.0))
    checks = ms.published_checks({r["name"]: r for r in rows})
    assert any("global Hadamard 25.00, block Hadamard 20.00 (best: block Hadamard)." in c
               for c in checks), checks  # fmt: skip
