"""SQ-format's judges that borrow rows of part scales: the paper's importance I = |A·ΣW| is the static
default, so the scales part's static per-bank row (the same model) stands in for the ablation's I=aw row;
likewise its (8/4) rows stand in for the gap part's (8/4) rows."""

import pytest

from benchmarks.findings import claims_sq as module

SQ6 = "W4A(SQ6) 16-(8/4)-0.5"


@pytest.fixture(scope="module")
def claims_sq():
    return module


def _res(ablate: dict, scales: dict) -> dict:
    rows = [
        {"part": "ablate", "name": f"{SQ6} static I={k} scales=bank", "ppl": v} for k, v in ablate.items()
    ]
    rows += [{"part": "scales", "name": f"{SQ6} {k} scales=bank", "ppl": v} for k, v in scales.items()]
    return {"rows": rows}


def test_scales_row_stands_in_for_the_default_importance(claims_sq):
    nums, v = claims_sq.sq_importance_ablation(_res({"a": 50.0, "abs-aw": 41.0}, {"static": 40.0}))
    assert "I=|A·ΣW| 40.00" in nums and "|A| alone 50.00" in nums and v == "holds"
    nums, v = claims_sq.sq_importance_ablation(_res({"a": 40.5, "abs-aw": 41.0}, {"static": 40.0}))
    assert v.startswith("does not hold here")


def test_the_ablation_row_wins_over_the_scales_row(claims_sq):
    res = _res({"aw": 46.0, "a": 50.0, "abs-aw": 41.0}, {"static": 40.0})
    assert "I=|A·ΣW| 46.00" in claims_sq.sq_importance_ablation(res)[0]


def test_a_missing_ablation_row_is_not_measured(claims_sq):
    with pytest.raises(KeyError):
        claims_sq.sq_importance_ablation(_res({"abs-aw": 41.0}, {"static": 40.0}))


GAP = {4: "W4A(SQ6) 16-(8/4)-0.5", 3: "W4A(SQ5.5) 16-(8/3)-0.5", 2: "W4A(SQ5) 16-(8/2)-0.5"}


def _gap(gap: dict, scales: dict) -> dict:
    """``gap``/``scales``: {(low, strategy): ppl} as rows of those parts, per-bank scales."""
    cells = {"gap": gap, "scales": scales}
    return {
        "rows": [
            {"part": part, "name": f"{GAP[lo]} {st} scales=bank", "ppl": v}
            for part, by in cells.items()
            for (lo, st), v in by.items()
        ]
    }


LOW = {(3, "dynamic"): 40.0, (3, "static"): 48.0, (2, "dynamic"): 50.0, (2, "static"): 300.0}


def test_scales_rows_stand_in_for_the_gap_at_8_4(claims_sq):
    nums, v = claims_sq.sq_static_falls_at_int2(_gap(LOW, {(4, "dynamic"): 36.0, (4, "static"): 37.8}))
    assert "(8/4): dynamic 36.00, static 37.80 (+5%)" in nums and v == "holds"
    # a gap at (8/4) wider than at (8/3) breaks the steady widening
    nums, v = claims_sq.sq_static_falls_at_int2(_gap(LOW, {(4, "dynamic"): 36.0, (4, "static"): 50.0}))
    assert v.startswith("does not hold here")


def test_the_gap_row_wins_over_the_scales_row(claims_sq):
    res = _gap(
        {**LOW, (4, "dynamic"): 30.0, (4, "static"): 31.0}, {(4, "dynamic"): 36.0, (4, "static"): 50.0}
    )
    nums, v = claims_sq.sq_static_falls_at_int2(res)
    assert "(8/4): dynamic 30.00, static 31.00" in nums and v == "holds"


def test_a_missing_gap_row_is_not_measured(claims_sq):
    with pytest.raises(KeyError):
        claims_sq.sq_static_falls_at_int2(
            _gap({(3, "dynamic"): 40.0}, {(4, "dynamic"): 36.0, (4, "static"): 37.8})
        )
