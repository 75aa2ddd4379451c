import warnings

import pytest
import torch

from bitmosaic.algorithms import (
    DampingError,
    damp_hessian,
    gptq_quantize,
    hessian_error,
    make_order,
    rtn_quantize,
)
from bitmosaic.algorithms.types import QuantResult
from bitmosaic.formats.grid import IntGrid
from bitmosaic.formats.layout import is_trivial_g_idx


def _err(W, res: QuantResult, H):
    return float(hessian_error(W, res.dequantize(torch.float64), H).sum())


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group", [None, 16])
def test_gptq_beats_rtn(layer64, bits, group):
    W, _, H = layer64
    grid = IntGrid(bits)
    rtn = rtn_quantize(W, grid, group)
    gptq = gptq_quantize(W, H, grid, group)
    assert _err(W, gptq, H) < 0.9 * _err(W, rtn, H)


def test_gptq_codes_in_range_and_groups(layer64):
    W, _, H = layer64
    for order in ("natural", "act", "gar", "min-pivot"):
        res = gptq_quantize(W, H, IntGrid(3), 16, perm=make_order(H, order, 16))
        assert res.codes.min() >= 0 and res.codes.max() <= 7
        assert res.scales.shape == (48, 4)
        trivial = is_trivial_g_idx(res.g_idx, 16)
        assert trivial == (order in ("natural", "gar"))  # act/min-pivot need a g_idx gather
        # scales are exactly representable in fp16 (what a packed model stores)
        assert torch.equal(res.scales.half().double(), res.scales)


def test_gptq_blocking_does_not_change_result(layer64):
    W, _, H = layer64
    a = gptq_quantize(W, H, IntGrid(4), 16, block_size=128)
    b = gptq_quantize(W, H, IntGrid(4), 16, block_size=5)
    assert torch.equal(a.codes, b.codes)


def test_gptq_partial_last_group():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(200, 40, generator=g, dtype=torch.float64)
    W = torch.randn(8, 40, generator=g, dtype=torch.float64)
    H = 2 / 200 * X.T @ X
    res = gptq_quantize(W, H, IntGrid(4), 16)  # groups 16, 16, 8
    assert res.scales.shape == (8, 3)
    assert res.g_idx.tolist() == [0] * 16 + [1] * 16 + [2] * 8


def test_gptq_dead_inputs_are_zeroed(layer64):
    W, X, _ = layer64
    X = X.clone()
    X[:, 5] = 0
    H = 2 / X.shape[0] * X.T @ X
    res = gptq_quantize(W, H, IntGrid(4), None)
    Wq = res.dequantize(torch.float64)
    assert torch.isfinite(Wq).all()
    assert torch.all(Wq[:, 5].abs() <= res.scales[:, 0] * 0.5 + 1e-12)


def test_damping_raises_with_warning_then_error():
    H = torch.ones(4, 4, dtype=torch.float64) - 0.02 * torch.eye(
        4, dtype=torch.float64
    )  # slightly indefinite
    with pytest.warns(RuntimeWarning, match="not positive-definite"):
        Hd, _, pd = damp_hessian(H, 0.01)
    assert pd > 0.01
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(DampingError, match="calibration"):
            damp_hessian(-torch.eye(3, dtype=torch.float64) * 1e3 + torch.ones(3, 3), 0.01, max_tries=2)


def test_gptq_static_groups_use_original_weights(layer64):
    W, _, H = layer64
    from bitmosaic.algorithms import group_scale_zero

    res = gptq_quantize(W, H, IntGrid(3), 16, perm=make_order(H, "act", 16), static_groups=True)
    s, z = group_scale_zero(W, IntGrid(3), 16)
    assert torch.equal(res.scales, s) and torch.equal(res.zeros, z)
    assert is_trivial_g_idx(res.g_idx, 16)


def test_gptq_float32_matches_float64_closely(layer64):
    W, _, H = layer64
    a = gptq_quantize(W, H, IntGrid(4), 16)
    b = gptq_quantize(W.float(), H.float(), IntGrid(4), 16)
    assert (a.codes != b.codes).float().mean() < 0.01


def test_gptq_mse_scales_not_worse_than_minmax_at_low_bits(layer64):
    W, _, H = layer64
    mm = gptq_quantize(W, H, IntGrid(2), 16, scale_method="minmax")
    mse = gptq_quantize(W, H, IntGrid(2), 16, scale_method="mse")
    assert _err(W, mse, H) < _err(W, mm, H)


def test_gptq_method_defaults_are_act_order_with_mse_scales():
    """``--method gptq --bits 4`` alone gets the best measured setting: act-order, MSE scales and auto
    groups, which resolve to static groups at 4 bits (no g_idx: every export format holds the result)."""
    from dataclasses import replace

    from bitmosaic.methods.common import static_groups_for
    from bitmosaic.methods.gptq import GPTQConfig
    from bitmosaic.methods.registry import get_method

    cfg = get_method("gptq").make_config(bits=4, group_size=2)
    assert isinstance(cfg, GPTQConfig)
    assert (cfg.order, cfg.scale_method, cfg.static_groups, cfg.direction) == ("act", "mse", None, "front")
    scattered = torch.tensor([3, 0, 2, 1])  # an act order that splits groups of 2
    assert static_groups_for(cfg, scattered) is True
    assert static_groups_for(replace(cfg, bits=3), scattered) is False
    assert static_groups_for(replace(cfg, bits=8), scattered) is True


@pytest.mark.parametrize(
    "order,given,bits,static",
    [("act", None, 4, True), ("min-pivot", None, 4, True), ("act", None, 3, False),
     ("min-pivot", None, 2, False), ("natural", None, 4, False), ("gar", None, 4, False),
     ("act", False, 4, False), ("natural", True, 3, True)],
)  # fmt: skip
def test_auto_static_groups_follow_the_order_and_width(layer64, order, given, bits, static):
    """Auto: static groups where the order scatters the groups (then no g_idx) at 4 bits and more,
    dynamic below (measured best at 3 bits) and where the order keeps the groups contiguous (the
    original GPTQ); an explicit value wins.  The result is the explicit run's."""
    from bitmosaic.methods.base import LayerStats
    from bitmosaic.methods.common import processing_order, quantize_gptq, static_groups_for
    from bitmosaic.methods.gptq import GPTQConfig

    W, _, H = layer64
    cfg = GPTQConfig(bits=bits, group_size=16, order=order, static_groups=given, solver_dtype="float64")
    perm = processing_order(H, cfg)
    assert static_groups_for(cfg, perm) is static
    got = quantize_gptq(W, LayerStats(hessian=H.clone()), cfg)
    kw = dict(perm=perm, static_groups=static, scale_method="mse", dtype=torch.float64)
    want = gptq_quantize(W, H, IntGrid(bits), 16, **kw)
    assert torch.equal(got.codes, want.codes) and torch.equal(got.g_idx, want.g_idx)
    if static:
        assert torch.equal(got.g_idx, torch.arange(W.shape[1]) // 16)
