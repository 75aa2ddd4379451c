"""``benchmarks/lattice/ssqr_groups.py``'s columns from real report rows of a tiny model: the paper's bits
per weight (hand count), SSQR's overflow at alpha = 1 (mean, max over layers) and the per-layer wins."""

import copy

import pytest
import torch

from benchmarks.lattice import ssqr_groups
from bitmosaic.methods import get_method
from bitmosaic.pipeline import RunSettings, quantize_model
from tests.pipeline.test_pipeline import tiny_llama


@pytest.fixture(scope="module")
def bench():
    return ssqr_groups


def _row(model, calib, name, method, **opts):
    spec = get_method(method)
    cfg = spec.make_config(**opts)
    settings = RunSettings(progress=False, measure_errors=True)
    rep = quantize_model(copy.deepcopy(model), calib, spec, cfg, settings)
    return {"name": name, "method": method, "options": cfg.to_dict(), "layers": rep.layers}


def test_paper_bits_overflow_and_wins_from_report_rows(bench):
    model = tiny_llama(layers=1)  # linears 64x64 (q, o), 32x64 (k, v), 96x64 (gate, up), 64x96 (down)
    calib = torch.randint(0, 128, (6, 32), generator=torch.Generator().manual_seed(0))
    g = _row(model, calib, "gptq", "gptq", bits=3, group_size=32, static_groups=True, order="act")
    s = _row(model, calib, "ssqr", "ssqr", bits=3, group_size=32, outlier_rate=0.03, order="act")
    # hand count: 3 bits per code, one 16-bit scale per row and group of 32, 32 bits per outlier
    shapes = [(64, 64), (32, 64), (32, 64), (64, 64), (96, 64), (96, 64), (64, 96)]
    assert sorted(tuple(r["shape"]) for r in g["layers"]) == sorted(shapes)
    n = sum(o * i for o, i in shapes)
    scale_bits = sum(o * (i // 32) * 16 for o, i in shapes)
    assert bench.layer_stats(g) == {"paper_bpw": (3 * n + scale_bits) / n}
    outliers = sum(r["outliers"] for r in s["layers"])
    assert outliers > 0
    st = bench.layer_stats(s)
    assert st["paper_bpw"] == pytest.approx((3 * n + scale_bits + 32 * outliers) / n, abs=1e-12)
    assert st["outlier_rate"] == outliers / n
    over = [r["overflow_rate_alpha1"] for r in s["layers"]]
    assert st["overflow_a1_max"] == max(over) and st["overflow_a1_mean"] == pytest.approx(sum(over) / 7)
    # the stored count is higher: asymmetric zeros and the CSR row pointers are stored
    assert st["paper_bpw"] < sum(r["bits_per_weight"] * o * i for r, (o, i) in zip(
        s["layers"], [r["shape"] for r in s["layers"]], strict=True)) / n  # fmt: skip
    won = sum(a["hessian_error"] < b["hessian_error"] for a, b in zip(s["layers"], g["layers"], strict=True))
    assert bench.layer_wins([g, s]) == {"ssqr": {"gptq": f"{won} of 7"}}
