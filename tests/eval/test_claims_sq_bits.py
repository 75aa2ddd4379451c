"""Issue 73: SQ-format claims judged at equal activation bits (scales and masks counted), the W(SQ)A4
claims on the paper's Algorithm 1 rows with ours beside them, and the backfill that recomputes a
result row's activation bits from its name."""

import json

import pytest

from benchmarks.findings import claims_sq, claims_sq_bits
from benchmarks.findings.findings_lib import RESULTS
from benchmarks.sq.sq_act_bits import row_bits, row_layout
from bitmosaic.formats.act import ActQuantSpec
from bitmosaic.formats.sq_act import SQActLayout

SQ = "W4A(SQ6) 16-(8/4)-0.5"


def _row(part, name, ppl, bits):
    return {"part": part, "name": name, "ppl": ppl, "act_bits": bits}


INT = [
    _row("acts", "W4A4", 1700.0, 4.02),
    _row("a4group", "W4A4 a4-g128", 100.0, 4.14),
    _row("abits", "W4A6", 50.0, 6.02),
    _row("acts", "W4A8", 40.0, 8.02),
]


def test_int_baseline_is_measured_interpolated_or_the_top_row():
    res = {"rows": INT}
    assert claims_sq_bits.int_at(res, 6.0) == (50.0, "W4A6 @ 6.02")  # within 0.05 bits: measured
    p, how = claims_sq_bits.int_at(res, 7.0)  # between A6 and A8: log-linear
    assert p == pytest.approx((50.0 * 40.0) ** 0.5, rel=2e-2) and "interpolated" in how
    assert claims_sq_bits.int_at(res, 10.0) == (40.0, "W4A8 @ 8.02, fewer bits")
    # the per-token W4A4 is off the front (A4 per 128 beats it with 0.1 bit more)
    assert [r["name"] for r in claims_sq_bits.int_front(res)] == ["W4A4", "W4A4 a4-g128", "W4A6", "W4A8"]
    with pytest.raises(KeyError):
        claims_sq_bits.int_at(res, 3.0)


def test_between_a4_a8_is_judged_at_equal_bits():
    good = [
        _row("scales", f"{SQ} static scales=bank", 39.0, 8.0),
        _row("agrid", "W4A(SQ) 32-(8/4)-0.5 static scales=bank", 44.0, 7.0),  # INT at 7 bits: 44.7
    ]
    nums, v = claims_sq_bits.sq_between_a4_a8({"rows": INT + good})
    assert v == "holds" and "b16 s0.5 static 39.00 @ 8.00 vs INT 40.00 (W4A8 @ 8.02, -2.5%)" in nums
    # at W4A8's bits a static split 2.5% worse than W4A8 fails, however far it is from W4A4
    bad = [_row("scales", f"{SQ} static scales=bank", 41.0, 8.0)]
    nums, v = claims_sq_bits.sq_between_a4_a8({"rows": INT + bad})
    assert v.startswith("does not hold here (1 of 1 worse")


def test_static_is_paired_with_dynamic_at_equal_bits():
    rows = [
        _row("scales", f"{SQ} dynamic scales=bank", 36.0, 10.0),  # y 6 + scales 2 + v_mask 2
        _row("scales", f"{SQ} static scales=bank", 40.0, 8.0),  # same bank, 2 bits fewer: +11%
        _row("agrid", "W4A(SQ) 8-(8/4)-0.5 static scales=bank", 37.0, 10.0),  # equal bits: +2.8%
    ]
    nums, v = claims_sq_bits.sq_static_close_at_84({"rows": rows})
    assert "vs b8 s0.5 static 37.00 @ 10.00 (+2.8%)" in nums and "same bank b16" in nums and v == "holds"
    rows[2]["ppl"] = 38.0  # +5.6% at equal bits
    assert claims_sq_bits.sq_static_close_at_84({"rows": rows})[1].startswith("does not hold here")
    with pytest.raises(KeyError):  # no static row of the dynamic's bits
        claims_sq_bits.sq_static_close_at_84({"rows": rows[:2]})


W_SQ = ("W(SQ4.5)A4 64-(8/4)-0.9375", "W(SQ5)A4 64-(8/4)-0.875", "W(SQ6)A4 32-(8/4)-0.75")


def _w(paper: list[float] | None, ours: list[float], base: float = 100.0) -> dict:
    rows = [{"part": "a4group", "name": "W4A4 a4-g128", "ppl": base, "act_bits": 4.14, "measured_bits": 4.3}]
    for k, p in zip(W_SQ, ours, strict=True):
        rows.append(
            {"part": "a4group", "name": f"{k} a4-g128", "ppl": p, "act_bits": 4.14, "measured_bits": 5.0}
        )
    for k, p in zip(W_SQ, paper or [], strict=False):
        rows.append({"part": "a4paper", "name": f"{k} a4-g128 mask=paper", "ppl": p, "act_bits": 4.14,
                     "measured_bits": 5.0})  # fmt: skip
    return {"rows": rows}


def test_w_sq_a4_claims_judge_the_papers_rows_with_ours_beside():
    nums, v = claims_sq.sq_weights_improve_as_s_falls(_w([90.0, 85.0, 80.0], [80.0, 85.0, 70.0]))
    assert v == "holds" and "paper A4 g128: 90.00 / 85.00 / 80.00" in nums and "ours A4 g128" in nums
    # only the paper's W(SQ6) ran (the verdict protocol): ours are judged, the paper's row reported
    nums, v = claims_sq.sq_weights_improve_as_s_falls(_w([75.0], [90.0, 85.0, 80.0]))
    assert v == "holds" and "not every setting" in nums
    nums, v = claims_sq.sq_w_sq_a4_beats_w4a4(_w([101.0], [90.0, 85.0, 80.0]))
    assert "W(SQ4.5)A4 paper 101.00, ours 90.00" in nums and v.startswith(
        "does not hold here (W(SQ4.5)A4 g128"
    )


def test_backfill_reproduces_every_stored_act_bits_from_the_row_names():
    shapes = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)] * 30
    n = 0
    for name in ("sq_format", "sq_format_verdict", "sq_format_verdict_s1"):
        for r in json.loads((RESULTS / f"{name}.json").read_text())["rows"]:
            if "ppl" in r and r.get("paper_act_bits_scales") is not None:
                assert row_bits(r["name"], shapes) == pytest.approx(
                    (r["act_bits"], r["paper_act_bits_scales"])
                )
                n += 1
    assert n > 50


def test_row_names_state_their_layouts():
    assert row_layout("W4A8") == ActQuantSpec("int", 8)
    assert row_layout("W4A16") is None
    assert row_layout("W(SQ6)A4 32-(8/4)-0.75 a4-g128 mask=paper") == ActQuantSpec(
        "int", 4, granularity="group", group_size=128
    )
    lay = row_layout(f"{SQ} static scales=group128/calibrated")
    assert isinstance(lay, SQActLayout) and (lay.strategy, lay.scale, lay.group, lay.calibrated) == (
        "static", "group", 128, True
    )  # fmt: skip
    assert row_layout(f"{SQ} static I=a scales=bank").scale == "bank"
    assert row_layout(f"{SQ} static, mask from 8 samples").scale == "token"
    with pytest.raises(KeyError):
        row_layout("32-(8/4)-0.75 obs/lazy")
