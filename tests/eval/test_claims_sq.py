"""SQ-format's |A| importance judge: the paper's importance I = |A·ΣW| is the static default, so the
scales part's static per-bank row (the same model) stands in for the ablation's I=aw row."""

import pytest

SQ6 = "W4A(SQ6) 16-(8/4)-0.5"


@pytest.fixture(scope="module")
def claims_sq(bench_module):
    return bench_module("claims_sq")


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
