"""The MosaicQuant judges compare rows of one protocol and device: the Atom-like, ablation and thin-block
judges take the run's own MosaicQuant W4A4 row, else the main table's of the same protocol and device
(``mosaic_main.json``, ``mosaic_main_verdict.json``), and refuse a mismatch."""

import pytest

from benchmarks.findings import claims_mosaic as module

FAST = {"nsamples": 16, "max_windows": 20}
VERDICT = {"nsamples": 128, "max_windows": None}


@pytest.fixture(scope="module")
def claims_mosaic():
    return module


def _atom(ppl: float, protocol: str, args: dict) -> dict:
    row = {"name": "atom-like W4A4 (3.1% INT8 channels)", "ppl": ppl, "share": 0.031}
    return {"protocol": protocol, "args": args, "rows": [{**row, "weight_bpw": 4.3, "act_bits": 4.3}]}


@pytest.fixture
def store(claims_mosaic, monkeypatch):
    runs = {
        "mosaic_main": _main(150.0, FAST, None),  # a run older than --device: the CPU
        "mosaic_main_verdict": _main(40.0, VERDICT, "cpu"),
    }
    monkeypatch.setattr(claims_mosaic, "load", runs.get)
    return runs


def _main(ppl: float, args: dict, device: str | None) -> dict:
    return _part("", args, {"mosaic W4A4": ppl}, device)


def test_fast_run_takes_the_fast_main_row(claims_mosaic, store):
    nums, v = claims_mosaic.mosaic_atom_model(_atom(56.0, "fast", FAST))
    assert "MosaicQuant 150.00" in nums and v.startswith("does not hold here")


def test_verdict_run_takes_the_verdict_main_row(claims_mosaic, store):
    nums, v = claims_mosaic.mosaic_atom_model(_atom(56.0, "verdict", {**VERDICT, "device": "cpu"}))
    assert "MosaicQuant 40.00" in nums and v == "holds"


def test_a_protocol_or_device_mismatch_is_not_measured(claims_mosaic, store):
    with pytest.raises(KeyError):  # a GPU run is not judged against the CPU's main table
        claims_mosaic.mosaic_atom_model(_atom(56.0, "verdict", {**VERDICT, "device": "cuda"}))
    store["mosaic_main_verdict"] = _main(40.0, {"nsamples": 128, "max_windows": 20}, "cpu")
    with pytest.raises(KeyError):
        claims_mosaic.mosaic_atom_model(_atom(56.0, "verdict", VERDICT))


def test_the_runs_own_mosaic_row_wins_over_the_main_table(claims_mosaic, store):
    res = _atom(56.0, "verdict", {**VERDICT, "device": "cuda"})
    res["rows"].append({"name": "mosaic W4A4", "ppl": 140.0, "bits_per_weight": 4.467})
    nums, v = claims_mosaic.mosaic_atom_model(res)
    assert "MosaicQuant 140.00" in nums and v.startswith("does not hold here")


# -- the ablation and thin-block judges: their comparator is the run's own MosaicQuant W4A4 row, else
# the main table's of the same protocol and device, never a row of another protocol or device


def _part(protocol: str, args: dict, rows: dict, device: str | None = None) -> dict:
    return {
        "protocol": protocol,
        "args": {**args, "device": device},
        "rows": [{"name": k, "ppl": v, "bits_per_weight": 4.47} for k, v in rows.items()],
    }


ABLATION = {
    k: 200.0
    for k in ("magnitude", "residual norm", "random", "no sparse, alpha re-searched", "no sparse, alpha kept")
}


def test_ablation_prefers_its_own_reference_row(claims_mosaic, store):
    res = _part("verdict", VERDICT, {**ABLATION, "mosaic W4A4": 250.0}, "cuda")
    nums, v = claims_mosaic.mosaic_selection_ablation(res)
    assert "Δ-Hessian 250.00" in nums and v.startswith("does not hold here")


def test_ablation_without_one_takes_main_of_its_protocol(claims_mosaic, store):
    nums, v = claims_mosaic.mosaic_selection_ablation(_part("verdict", VERDICT, ABLATION, "cpu"))
    assert "Δ-Hessian 40.00" in nums and v == "holds"
    nums, _ = claims_mosaic.mosaic_selection_ablation(_part("fast", FAST, ABLATION))
    assert "Δ-Hessian 150.00" in nums


def test_ablation_never_mixes_devices(claims_mosaic, store):
    with pytest.raises(KeyError):
        claims_mosaic.mosaic_selection_ablation(_part("verdict", VERDICT, ABLATION, "cuda"))


def test_thin_blocks_against_the_runs_own_64x64(claims_mosaic, store):
    res = _part("verdict", VERDICT, {"mosaic W4A4": 120.0, "block 1x128": 110.0}, "cuda")
    nums, v = claims_mosaic.mosaic_thin_blocks(res)
    assert "64x64 120.00" in nums and v == "holds"
    res = _part("verdict", VERDICT, {"mosaic W4A4": 100.0, "block 1x128": 110.0}, "cuda")
    assert claims_mosaic.mosaic_thin_blocks(res)[1].startswith("does not hold here")


# -- block against channel selection: the per-layer shares, then the perplexity rows of the verdict run
# of the channel part where there is one (against main's row of that protocol), else the fast run's


def _layers(blocks: float, channels: float) -> dict:
    curves = {"delta-hessian": [blocks], "channel-act": [channels], "channel": [channels + 0.1]}
    return {"budgets": [0.1], "layers": {"10": {"linears": {"q_proj": {"curves": curves}}}}}


PAPER_CH = "channel (paper: outlier max|X|)"


def test_block_vs_channel_takes_the_verdict_channel_run_first(claims_mosaic, store):
    store["mosaic_channel"] = _part("fast", FAST, {PAPER_CH: 140.0})
    nums, v = claims_mosaic.mosaic_block_beats_channel(_layers(0.3, 0.2))
    assert "W4A4 ppl (fast): blocks 150.00" in nums and "channels 140.00" in nums
    assert v.startswith("does not hold here")  # the fast perplexities favour the channels
    store["mosaic_channel_verdict"] = _part("verdict", VERDICT, {PAPER_CH: 45.0}, "cpu")
    store["mosaic_thin_verdict"] = _part("verdict", VERDICT, {"block 1x128": 35.0}, "cpu")
    nums, v = claims_mosaic.mosaic_block_beats_channel(_layers(0.3, 0.2))
    assert "W4A4 ppl (verdict): blocks 40.00" in nums and "channels 45.00" in nums
    assert "1x128 blocks (ours) 35.00" in nums and v == "holds"
    # the per-layer shares decide against blocks whatever the perplexities say
    assert claims_mosaic.mosaic_block_beats_channel(_layers(0.2, 0.3))[1].startswith("does not hold here")


def test_block_vs_channel_never_takes_main_of_another_device(claims_mosaic, store):
    store["mosaic_channel_verdict"] = _part("verdict", VERDICT, {PAPER_CH: 45.0}, "cuda")
    nums, v = claims_mosaic.mosaic_block_beats_channel(_layers(0.3, 0.2))
    assert "W4A4 ppl" not in nums and v == "holds"  # the shares alone, no cross-device perplexity pair


# -- Table 1's other comparators (issue 73): every row of one protocol, the GQA-folded row preferred ------
def _table1(store, mosaic_ppl: float, args: dict, device: str = "cpu") -> dict:
    verdict = args is VERDICT
    tag = "_verdict" if verdict else ""
    store["rotation" + tag] = _part("", args, {module.QUAROT: 55.1, module.SPINQUANT: 49.6}, device)
    store["atom_model" + tag] = {**_atom(48.1, "", {**args, "device": device})}
    store["sfmp" + tag] = _part("", args, {"4.25 gptq w4g128": 35.8, "4.25 awq w4g128": 36.6}, device)
    main = _part("", args, {"mosaic W4A4": mosaic_ppl, "mosaic W4A8": 54.0, "float": 30.0}, device)
    for run in (main, store["rotation" + tag], store["atom_model" + tag], store["sfmp" + tag]):
        run["protocol"] = "verdict" if verdict else "fast"
    return main


def test_table1_w4a4_judges_rows_of_one_protocol(claims_mosaic, store):
    res = _table1(store, 146.8, VERDICT)
    nums, v = claims_mosaic.mosaic_vs_table1_w4a4(res)
    assert "MosaicQuant 146.80" in nums and "QuaRot-like" in nums and "ResQ: no row" in nums
    assert v.startswith("does not hold here") and "QuaRot, SpinQuant, Atom lower" in v
    store["mosaic_fold_verdict"] = _part("verdict", VERDICT, {"mosaic W4A4": 45.0}, "cpu")
    nums, v = claims_mosaic.mosaic_vs_table1_w4a4(res)  # the folded row is the method now
    assert "MosaicQuant 45.00" in nums and "before: 146.80" in nums and v == "holds"


def test_table1_refuses_a_comparator_of_another_protocol_or_device(claims_mosaic, store):
    res = _table1(store, 40.0, VERDICT)
    store["rotation_verdict"] = _part("verdict", {**VERDICT, "max_windows": 20}, {module.QUAROT: 55.1}, "cpu")
    with pytest.raises(KeyError):
        claims_mosaic.mosaic_vs_table1_w4a4(res)
    res = _table1(store, 40.0, VERDICT, device="cuda")
    res["args"]["device"] = "cpu"
    with pytest.raises(KeyError):
        claims_mosaic.mosaic_vs_table1_w4a4(res)
    # another device: unused
    store["mosaic_fold_verdict"] = _part("verdict", VERDICT, {"mosaic W4A4": 1.0}, "cuda")
    res = _table1(store, 146.8, VERDICT)
    assert "before" not in claims_mosaic.mosaic_vs_table1_w4a4(res)[0]


def test_w4a8_near_w4a16_is_five_percent_of_the_best(claims_mosaic, store):
    res = _table1(store, 146.8, VERDICT)
    nums, v = claims_mosaic.mosaic_w4a8_near_w4a16(res)
    assert "GPTQ 35.80" in nums and "1.51x" in nums and v.startswith("does not hold here")
    store["mosaic_fold_verdict"] = _part("verdict", VERDICT, {"mosaic W4A8": 37.5}, "cpu")  # 1.047x GPTQ
    assert claims_mosaic.mosaic_w4a8_near_w4a16(res)[1] == "holds"
