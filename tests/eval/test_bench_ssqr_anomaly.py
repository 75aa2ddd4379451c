"""``benchmarks/lattice/ssqr_anomaly.py``'s bookkeeping on hand-made data (issue 73 item 7): SSQR's
outliers added back (and dropped per projection kind), where they sit (rows, columns, hot input
channels), and the per-token buckets whose parts add up to the whole NLL gap."""

import math

import torch

from benchmarks.lattice import ssqr_anomaly as sa


def _ssqr(n_out=8, n_in=200):
    dense = {
        "model.layers.0.mlp.down_proj": torch.zeros(n_out, n_in),
        "model.layers.0.self_attn.q_proj": torch.ones(n_out, n_in),
    }
    # down_proj: four outliers, all in input column 7; q_proj: four outliers in row 3, columns 0-3
    down = (
        torch.tensor([[0, 7], [1, 7], [2, 7], [5, 7]], dtype=torch.int32),
        torch.tensor([1.0, 2.0, 3.0, 4.0]),
    )
    q = (
        torch.tensor([[3, 0], [3, 1], [3, 2], [3, 3]], dtype=torch.int32),
        torch.tensor([0.5, -0.5, 0.5, -0.5]),
    )
    outliers = {"model.layers.0.mlp.down_proj": down, "model.layers.0.self_attn.q_proj": q}
    return {"weights": dense, "outliers": outliers}


def test_outliers_are_added_back_and_dropped_per_kind():
    q = _ssqr()
    full = sa.weight_set(q)
    assert full["model.layers.0.mlp.down_proj"][:, 7].tolist() == [1, 2, 3, 0, 0, 4, 0, 0]
    assert full["model.layers.0.self_attn.q_proj"][3, :5].tolist() == [1.5, 0.5, 1.5, 0.5, 1.0]
    no_down = sa.weight_set(q, drop="down_proj")
    assert not no_down["model.layers.0.mlp.down_proj"].any()  # only the dense code is left
    assert torch.equal(no_down["model.layers.0.self_attn.q_proj"], full["model.layers.0.self_attn.q_proj"])
    assert not q["weights"]["model.layers.0.mlp.down_proj"].any()  # the stored dense code is untouched


def test_outlier_layout_tells_columns_from_rows():
    q = _ssqr()
    diag = {n: torch.arange(200.0) for n in q["weights"]}
    diag["model.layers.0.mlp.down_proj"][7] = 1e6  # column 7 is the hottest input channel
    lay = sa.outlier_layout(q, diag)
    assert list(lay) == ["q_proj", "down_proj"]  # in KINDS order
    down, qp = lay["down_proj"], lay["q_proj"]
    assert down["outliers"] == 4 and math.isclose(down["rate"], 4 / 1600)
    assert (
        down["top_cols_share"] == 1.0 and down["hot_cols_share"] == 1.0
    )  # a column stripe, on the hot channel
    assert down["top_rows_share"] == 0.25  # the top 1% of 8 rows is one row: one outlier of four
    assert qp["top_rows_share"] == 1.0 and qp["hot_cols_share"] == 0.0  # a row, away from the hot channels
    assert qp["top_cols_share"] == 0.5  # the top 1% of 200 columns: two columns, one outlier each of four


def test_token_buckets_add_up_to_the_whole_gap():
    g = torch.Generator().manual_seed(0)
    n = 2 * (sa.SEQLEN - 1)  # two windows
    t = {
        "nll_float": torch.rand(n, generator=g) * 3,
        "target": torch.randint(0, 50, (n,), generator=g),
        "pos": torch.arange(sa.SEQLEN - 1).repeat(2),
        "float_right": torch.rand(n, generator=g) > 0.6,
    }
    for w, shift in (("gptq", 0.10), ("ssqr", 0.12)):
        t[f"nll_{w}"] = t["nll_float"] + shift * torch.rand(n, generator=g) * 2
        t[f"kl_{w}"] = torch.rand(n, generator=g) * shift
    counts = torch.randint(0, 3000, (50,), generator=g)
    out = sa.summarize_tokens(t, counts)
    a = out["all"]
    assert math.isclose(a["nll_gap"], float((t["nll_ssqr"] - t["nll_gptq"]).double().mean()), rel_tol=1e-9)
    for group in ("pos_", "freq_", "float_top"):
        parts = sum(r["gap_part"] for k, r in out.items() if k.startswith(group))
        assert math.isclose(parts, a["nll_gap"], rel_tol=1e-6), group  # each split covers every token once
        assert sum(r["tokens"] for k, r in out.items() if k.startswith(group)) == n
    assert a["windows"] == 2 and a["gap_ci95_lo"] <= a["nll_gap"] <= a["gap_ci95_hi"]
    assert math.isclose(a["ppl_gptq"], math.exp(float(t["nll_gptq"].double().mean())), rel_tol=1e-9)


def test_the_report_shows_every_part():
    """The markdown of a report built from the summaries (hand-made linears, tokens and variants)."""
    rows = [
        {
            "name": f"model.layers.15.{p}.{k}",
            "gptq_calib": 0.02,
            "gptq_test": 0.03,
            "ssqr_calib": 0.01,
            "ssqr_test": 0.04,
        }
        for p, k in [("self_attn", k) for k in sa.KINDS[:4]] + [("mlp", k) for k in sa.KINDS[4:]]
    ]
    lay = sa.summarize_layers({"rows": rows})
    assert lay["ssqr_lower_calib"] == 7 and lay["ssqr_lower_test"] == 0
    assert math.isclose(lay["ssqr_test_over_calib"], 4.0) and math.isclose(lay["gptq_test_over_calib"], 1.5)
    n = sa.SEQLEN - 1
    t = {"nll_float": torch.ones(n), "target": torch.zeros(n, dtype=torch.long), "pos": torch.arange(n)}
    t |= {"float_right": torch.ones(n, dtype=torch.bool), "nll_gptq": torch.full((n,), 1.1)}
    t |= {
        "nll_ssqr": torch.full((n,), 1.2),
        "kl_gptq": torch.full((n,), 0.2),
        "kl_ssqr": torch.full((n,), 0.1),
    }
    out = {
        "protocol": "hand-made",
        "linear_errors": lay,
        "tokens": sa.summarize_tokens(t, torch.tensor([5000])),
        "outliers": sa.outlier_layout(_ssqr(), {n: torch.arange(200.0) for n in _ssqr()["weights"]}),
        "variants": [{"name": "ssqr without outliers", "ppl": 3.1, "nll_over_gptq": 0.05, "gap_closed": 0.5}],
        "verdict_alpha": {"mean": 0.94, "min": 0.92, "max": 0.96, "layers": 210},
    }
    md = sa.markdown(out)
    assert "SSQR lower in 7 of 7 linears on the calibration text, 0 on held-out text" in md
    assert "| down_proj | 0.02 | 0.03 | 0.01 | 0.04 | 0 of 1 |" in md
    assert "+0.10000 nats" in md and "| ssqr without outliers | 3.100 | +0.05000 | +0.50 |" in md
