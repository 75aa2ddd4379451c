"""The Atom-like judge compares with MosaicQuant W4A4 of the same protocol: ``rotation.json`` for a
fast run, ``rotation_verdict.json`` for a verdict one, and refuses a mismatch."""

import pytest

FAST = {"nsamples": 16, "max_windows": 20}
VERDICT = {"nsamples": 128, "max_windows": None}


@pytest.fixture(scope="module")
def claims_mosaic(bench_module):
    return bench_module("claims_mosaic")


def _atom(ppl: float, protocol: str, args: dict) -> dict:
    row = {"name": "atom-like W4A4 (3.1% INT8 channels)", "ppl": ppl, "share": 0.031}
    return {"protocol": protocol, "args": args, "rows": [{**row, "weight_bpw": 4.3, "act_bits": 4.3}]}


def _rot(ppl: float, args: dict) -> dict:
    return {"args": args, "rows": [{"name": "mosaic W4A4", "ppl": ppl, "bits_per_weight": 4.467}]}


@pytest.fixture
def store(claims_mosaic, monkeypatch):
    runs = {"rotation": _rot(150.0, FAST), "rotation_verdict": _rot(40.0, VERDICT)}
    monkeypatch.setattr(claims_mosaic, "load", runs.get)
    return runs


def test_fast_run_takes_the_fast_rotation_row(claims_mosaic, store):
    nums, v = claims_mosaic.mosaic_atom_model(_atom(56.0, "fast", FAST))
    assert "MosaicQuant 150.00" in nums and v.startswith("does not hold here")


def test_verdict_run_takes_the_verdict_rotation_row(claims_mosaic, store):
    nums, v = claims_mosaic.mosaic_atom_model(_atom(56.0, "verdict", VERDICT))
    assert "MosaicQuant 40.00" in nums and v == "holds"


def test_a_protocol_mismatch_is_not_measured(claims_mosaic, store):
    store["rotation_verdict"] = _rot(40.0, {"nsamples": 128, "max_windows": 20})
    with pytest.raises(KeyError):
        claims_mosaic.mosaic_atom_model(_atom(56.0, "verdict", VERDICT))
