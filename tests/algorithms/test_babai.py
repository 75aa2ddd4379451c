"""Babai's nearest plane vs GPTQ (Babai paper Thm. 4) and the no-clip error bound (Thm. 5)."""

import pytest
import torch

from bitmosaic.algorithms import (
    HessianAccumulator,
    babai_bound,
    babai_nearest_plane,
    damp_hessian,
    gptq_quantize,
    group_scale_zero,
    hessian_error,
    ldl_diagonal,
    make_order,
)
from bitmosaic.formats.grid import IntGrid
from bitmosaic.formats.layout import default_g_idx
from tests.conftest import correlated_inputs


def _random_layer(seed, out=24, n=80, tokens=300):
    X = correlated_inputs(tokens, n, seed=seed)
    W = torch.randn(out, n, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64)
    acc = HessianAccumulator(n, dtype=torch.float64)
    acc.add(X)
    return W, X, acc.H


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("order", ["natural", "act", "min-pivot", "gar"])
@pytest.mark.parametrize("clip", [False, True])
def test_babai_equals_back_to_front_gptq(seed, order, clip):
    W, _, H = _random_layer(seed)
    grid = IntGrid(3, symmetric=seed % 2 == 0)
    P = make_order(H, order, group_size=16)  # Babai basis order; GPTQ processes it back-to-front
    res = gptq_quantize(W, H, grid, 16, perm=P.flip(0), clip=clip, static_groups=True)
    s, z = group_scale_zero(W, grid, 16)
    g = default_g_idx(W.shape[1], 16)
    codes = babai_nearest_plane(W, res.damped_hessian(H), grid, s[:, g], z[:, g], basis_order=P, clip=clip)
    assert torch.equal(codes, res.codes)
    if not clip:  # the no-clip lattice really is unbounded here, so the test covers overflow
        assert int(res.codes.min()) < 0 or int(res.codes.max()) > grid.maxq


def test_babai_direction_flag_is_the_reversal():
    W, _, H = _random_layer(5)
    grid = IntGrid(4)
    back = gptq_quantize(
        W, H, grid, None, perm=make_order(H, "natural", direction="back"), clip=False, static_groups=True
    )
    s, z = group_scale_zero(W, grid, None)
    codes = babai_nearest_plane(
        W, back.damped_hessian(H), grid, s.expand(-1, W.shape[1]), z.expand(-1, W.shape[1]), clip=False
    )
    assert torch.equal(codes, back.codes)
    front = gptq_quantize(W, H, grid, None, clip=False, static_groups=True)
    assert not torch.equal(front.codes, back.codes)  # the direction matters


@pytest.mark.parametrize("order", ["natural", "act", "min-pivot"])
@pytest.mark.parametrize("direction", ["front", "back"])
def test_babai_bound_holds_without_clipping(order, direction):
    W, X, H = _random_layer(7, out=32, n=96, tokens=400)
    grid = IntGrid(2)
    perm = make_order(H, order, 32, direction)
    res = gptq_quantize(W, H, grid, 32, perm=perm, clip=False)
    Wq = res.dequantize(torch.float64)
    err = hessian_error(W, Wq, res.damped_hessian(H))
    bound = babai_bound(res.damped_hessian(H), res.scales[:, res.g_idx], res.perm)
    assert (err <= bound * (1 + 1e-9)).all()
    # ||X(w - w_hat)||^2 with the undamped H = 2/n X^T X: damping only adds a PSD term
    out_err = ((X @ (W - Wq).T) ** 2).sum(0) * 2 / X.shape[0]
    assert (out_err <= bound * (1 + 1e-9)).all()
    assert (err > 0.05 * bound).all()  # not vacuous: the bound is within a small factor


def test_babai_bound_tight_at_corner():
    """Equality when every rounding decision lands exactly half a step away (Thm. 5 tightness)."""
    n = 6
    X = correlated_inputs(50, n, seed=3)
    H = 2 / 50 * X.T @ X
    Hd, L, _ = damp_hessian(H, 0.0)
    s = torch.full((1, n), 0.25, dtype=torch.float64)
    R = L.T
    # Choose w so that the Babai residual is +s/2 * R_kk at every step: y_k = R_kk * (q_k + 1/2) * s
    # with q = 0 -> target y = R diag(s) (1/2) -> w = R^-1 y.
    y = torch.diagonal(R) * s[0] * 0.5
    w = torch.linalg.solve_triangular(R, y[:, None], upper=True).T
    grid = IntGrid(8, symmetric=True)
    z = torch.full_like(s, float(grid.sym_zero))
    codes = babai_nearest_plane(w, Hd, grid, s, z, clip=False)
    w_hat = (codes.double() - z) * s
    err = hessian_error(w, w_hat, Hd)
    bound = 0.25 * (ldl_diagonal(Hd) * s[0] ** 2).sum()
    # rounding ties may go either way; both give the same |residual|, so the error equals the bound
    assert torch.allclose(err, bound.reshape(1), rtol=1e-6)


def test_babai_gptq_step_errors_equal_hessian_error(layer64):
    W, _, H = layer64
    res = gptq_quantize(W, H, IntGrid(3), 16, perm=make_order(H, "act", 16))
    err = hessian_error(W, res.dequantize(torch.float64), res.damped_hessian(H))
    assert torch.allclose(err, res.step_errors, rtol=1e-9, atol=1e-12)


def test_babai_min_pivot_bound_not_worse_than_act(layer64):
    W, _, H = layer64
    Hd = damp_hessian(H, 0.01)[0]
    s = torch.ones(1, H.shape[0], dtype=torch.float64)
    b_act = babai_bound(Hd, s, make_order(Hd, "act"))
    b_min = babai_bound(Hd, s, make_order(Hd, "min-pivot"))
    b_nat = babai_bound(Hd, s, make_order(Hd, "natural"))
    assert b_min <= b_act * (1 + 1e-9)
    assert b_act < b_nat


@pytest.mark.parametrize("order", ["natural", "act", "gar", "min-pivot"])
@pytest.mark.parametrize("direction", ["front", "back"])
@pytest.mark.parametrize("clip", [True, False])
def test_babai_method_equals_gptq_static_groups_method(order, direction, clip):
    """Methods ``babai`` and ``gptq --static-groups`` give the same integers for every order and
    direction (Thm. 4): both take the processing order from the same (once-)damped Hessian."""
    from bitmosaic.methods.babai import BabaiConfig, quantize_babai
    from bitmosaic.methods.common import quantize_gptq
    from bitmosaic.methods.gptq import GPTQConfig
    from bitmosaic.methods.registry import LayerStats

    W, _, H = _random_layer(11, out=16, n=64, tokens=120)  # few tokens: a stiff, correlated H
    common = dict(bits=3, group_size=16, scale_method="minmax", clip=clip, order=order, direction=direction)
    stats = LayerStats(hessian=H)
    b = quantize_babai(W, stats, BabaiConfig(**common, percdamp=0.01, dtype="float64"))
    g = quantize_gptq(W, stats, GPTQConfig(**common, static_groups=True, dtype="float64"))
    assert torch.equal(b.perm, g.perm)
    assert torch.equal(b.codes, g.codes)
    assert torch.equal(b.scales, g.scales) and torch.equal(b.zeros, g.zeros)
    assert torch.allclose(b.pivots, g.pivots, rtol=1e-10, atol=0)
