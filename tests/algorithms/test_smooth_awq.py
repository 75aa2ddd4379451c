import pytest
import torch

from bitmosaic.algorithms.awq import awq_clip_search, awq_search_scales, awq_weight_magnitude
from bitmosaic.algorithms.rtn import rtn_quantize
from bitmosaic.algorithms.scales import group_scale_zero
from bitmosaic.algorithms.smooth import (
    fold_scales_into_linear_rows,
    fold_scales_into_norm,
    search_alpha,
    smooth_scales,
    smoothing_loss,
)
from bitmosaic.formats.grid import IntGrid, dequantize_codes, fp16_exact, quantize_codes
from tests.conftest import correlated_inputs

F64 = torch.float64


def _weights(n_w: int, out: int, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(out, n, generator=g, dtype=F64) * 0.05 for _ in range(n_w)]


def _int8_per_token(x: torch.Tensor) -> torch.Tensor:
    sc = (x.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
    return (x / sc).round().clamp(-127, 127) * sc


def _rtn(grid: IntGrid, group_size: int | None):
    return lambda W: rtn_quantize(W, grid, group_size).dequantize(F64)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x / x.pow(2).mean(dim=-1, keepdim=True).sqrt()


# ---------------------------------------------------------------- SmoothQuant


def test_smooth_scales_formula_and_dead_channels():
    act = torch.tensor([4.0, 0.0, 1.0, 9.0], dtype=F64)
    W1 = torch.tensor([[1.0, 2.0, 0.0, -0.5], [-4.0, 1.0, 0.0, 0.25]], dtype=F64)
    W2 = torch.tensor([[2.0, -3.0, 0.0, 1.0]], dtype=F64)
    s = smooth_scales(act, [W1, W2], alpha=0.5)
    # wmax over both weights = [4, 3, 0, 1]; channels 1 (act 0) and 2 (wmax 0) -> 1
    expected = torch.tensor([4**0.5 / 4**0.5, 1.0, 1.0, 9**0.5 / 1.0], dtype=F64)
    torch.testing.assert_close(s, expected)
    s32 = smooth_scales(act.float(), [W1, W2], alpha=0.8)
    assert s32.dtype == torch.float32
    torch.testing.assert_close(s32.double(), torch.tensor([4**0.8 / 4**0.2, 1, 1, 9**0.8], dtype=F64))
    assert smooth_scales(torch.full((4,), 1e-30, dtype=F64), [W1], 1.0, eps=1e-5).min() >= 1e-5


def test_smoothing_preserves_float_product_and_folding():
    X = correlated_inputs(128, 64, seed=5)
    (W,) = _weights(1, 32, 64, seed=6)
    s = smooth_scales(X.abs().amax(0), [W], alpha=0.5)
    assert not torch.allclose(s, torch.ones_like(s))
    torch.testing.assert_close((X / s) @ (W * s).T, X @ W.T)
    ident = lambda t: t  # noqa: E731
    assert smoothing_loss(X, [W], s, ident, ident) < 1e-20 * float((X @ W.T).pow(2).sum())

    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, generator=g, dtype=F64) * 0.1
    for offset in (0.0, 1.0):
        w_new = fold_scales_into_norm(w, s, offset=offset)
        torch.testing.assert_close(_rms(X) * (offset + w_new), _rms(X) * (offset + w) / s)

    Z = torch.randn(16, 24, generator=g, dtype=F64)
    W_prev = torch.randn(64, 24, generator=g, dtype=F64)
    b_prev = torch.randn(64, generator=g, dtype=F64)
    W_new, b_new = fold_scales_into_linear_rows(W_prev, b_prev, s)
    torch.testing.assert_close(Z @ W_new.T + b_new, (Z @ W_prev.T + b_prev) / s)
    W_new2, none = fold_scales_into_linear_rows(W_prev, None, s)
    assert none is None
    torch.testing.assert_close(W_new2, W_new)


@pytest.mark.parametrize("grid,group", [(IntGrid(8, symmetric=True), None), (IntGrid(4), 32)])
def test_search_alpha_beats_unsmoothed(grid, group):
    X = correlated_inputs(256, 64, seed=3)
    Ws = _weights(2, 48, 64, seed=4)
    qw = _rtn(grid, group)
    res = search_alpha(X, X.abs().amax(0), Ws, qw, _int8_per_token)
    assert len(res.losses) == 21
    assert res.losses[res.alpha] == min(res.losses.values())
    torch.testing.assert_close(res.scales, smooth_scales(X.abs().amax(0), Ws, res.alpha))
    # the search scores in float32 (losses are only compared); float64 agrees closely
    assert res.losses[res.alpha] == pytest.approx(
        smoothing_loss(X, Ws, res.scales, qw, _int8_per_token), rel=1e-4
    )
    unsmoothed = smoothing_loss(X, Ws, torch.ones(64, dtype=F64), qw, _int8_per_token)
    assert res.losses[res.alpha] < 0.8 * unsmoothed
    assert 0.0 < res.alpha < 1.0


def test_search_alpha_ties_go_to_smaller_alpha():
    X = correlated_inputs(32, 16, seed=8)
    Ws = _weights(1, 8, 16, seed=9)
    zero = lambda t: torch.zeros_like(t)  # noqa: E731  every alpha gives ||X W^T||^2
    res = search_alpha(X, X.abs().amax(0), Ws, zero, zero, alphas=(0.75, 0.25, 0.5))
    assert res.alpha == 0.25
    assert len(set(res.losses.values())) == 1


# ---------------------------------------------------------------- AWQ


def test_awq_weight_magnitude_hand_example():
    W1 = torch.tensor([[1.0, -2.0, 4.0, 0.5]], dtype=F64)
    W2 = torch.tensor([[2.0, 2.0, -1.0, 1.0]], dtype=F64)
    torch.testing.assert_close(
        awq_weight_magnitude([W1, W2], 2), torch.tensor([0.75, 1.0, 1.0, 0.5625], dtype=F64)
    )
    torch.testing.assert_close(
        awq_weight_magnitude([W1, W2], None), torch.tensor([0.625, 0.75, 0.75, 0.3125], dtype=F64)
    )
    m = awq_weight_magnitude(_weights(3, 20, 96, seed=10), 40)  # partial last group (16 columns)
    assert m.shape == (96,) and bool((m > 0).all()) and bool((m <= 1).all())


def test_awq_search_beats_rtn_and_loss_is_output_error():
    X = correlated_inputs(256, 64, seed=3)
    Ws = _weights(2, 48, 64, seed=4)
    H = X.T @ X
    qw = _rtn(IntGrid(4), 32)
    res = awq_search_scales(X.abs().mean(0), Ws, H, qw, group_size=32)
    assert res.ratio is not None and len(res.losses) == 20
    best = res.losses[res.ratio]
    assert best == min(res.losses.values())
    assert best < 0.8 * res.identity_loss

    def explicit(s: torch.Tensor) -> float:
        return sum(float((X @ W.T - X @ (qw(W * s) / s).T).pow(2).sum()) for W in Ws)

    assert explicit(res.scales) == pytest.approx(best, rel=1e-6)
    assert explicit(torch.ones(64, dtype=F64)) == pytest.approx(res.identity_loss, rel=1e-6)
    assert float(res.scales.max() * res.scales.min()) == pytest.approx(1.0, rel=1e-9)

    plain = awq_search_scales(X.abs().mean(0), Ws, H, qw, duo_scaling=False)
    assert plain.losses[0.0] == pytest.approx(plain.identity_loss)  # r = 0 is s = 1
    assert min(plain.losses.values()) < plain.identity_loss


def test_awq_search_keeps_identity_when_strictly_best():
    X = correlated_inputs(64, 16, seed=11)
    Ws = _weights(1, 8, 16, seed=12)
    # a quantizer that is exact only when the weight is left unscaled
    qw = lambda W: W if torch.equal(W, Ws[0]) else torch.zeros_like(W)  # noqa: E731
    res = awq_search_scales(X.abs().mean(0), Ws, X.T @ X, qw, n_grid=4, duo_scaling=False)
    # duo_scaling=False has r = 0 -> s = 1, a tie with the identity, which keeps the ratio
    assert res.ratio == 0.0 and res.identity_loss == 0.0
    res = awq_search_scales(X.abs().mean(0), Ws, X.T @ X, qw, n_grid=4)
    assert res.ratio is None and res.identity_loss == 0.0
    torch.testing.assert_close(res.scales, torch.ones(16, dtype=F64))


def _block_errors(W, H, scales, zeros, grid, g):
    errs = []
    for k in range(scales.shape[1]):
        sl = slice(k * g, min((k + 1) * g, W.shape[1]))
        sc, z = scales[:, k : k + 1], zeros[:, k : k + 1]
        e = W[:, sl] - dequantize_codes(quantize_codes(W[:, sl], sc, z, grid.maxq), sc, z)
        errs.append(((e @ H[sl, sl]) * e).sum(dim=1))
    return torch.stack(errs, dim=1)


@pytest.mark.parametrize("grid,group", [(IntGrid(4), 32), (IntGrid(3, symmetric=True), 48)])
def test_awq_clip_search_never_worse_than_minmax(grid, group):
    X = correlated_inputs(256, 128, seed=13)
    H = X.T @ X
    W = torch.randn(40, 128, generator=torch.Generator().manual_seed(14), dtype=F64) * 0.05
    scales, zeros = awq_clip_search(W, H, grid, group)
    G = -(-128 // group)
    assert scales.shape == zeros.shape == (40, G)
    torch.testing.assert_close(scales, fp16_exact(scales), rtol=0, atol=0)
    assert bool((zeros >= 0).all()) and bool((zeros <= grid.maxq).all())
    s0, z0 = group_scale_zero(W, grid, group, "minmax")
    clipped = _block_errors(W, H, scales, zeros, grid, group)
    minmax = _block_errors(W, H, s0, z0, grid, group)
    assert bool((clipped <= minmax).all())
    assert float(clipped.sum()) < 0.98 * float(minmax.sum())
    assert bool((scales <= s0).all())  # clipping only ever shrinks the range


def test_smoothquant_keeps_its_own_weight_defaults():
    """SmoothQuantConfig stands on the GPTQ solver fields (common.GPTQSolverConfig), not on GPTQConfig;
    GPTQ's act-order + MSE defaults must not leak in."""
    from bitmosaic.methods.smoothquant import SmoothQuantConfig

    cfg = SmoothQuantConfig()
    assert (cfg.scale, cfg.order, cfg.solver) == ("minmax", "natural", "rtn")
