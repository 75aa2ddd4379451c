"""The GPTQ solver core: LDL pivots, factorisation retries, thread state, scale floor."""

import warnings

import pytest
import torch

from bitmosaic.algorithms import (
    DampingError,
    babai_bound,
    gptq_quantize,
    hessian_error,
    make_order,
    rtn_quantize,
)
from bitmosaic.algorithms.lattice import entropy_coded_quantize, ssqr_quantize
from bitmosaic.formats.grid import IntGrid


@pytest.mark.parametrize("order", ["natural", "act", "gar", "min-pivot"])
@pytest.mark.parametrize("direction", ["front", "back"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_pivots_give_the_babai_bound(layer64, order, direction, dtype):
    """``pivots`` are D_kk of the damped Hessian in processing order (1 / U_kk^2): the Babai bound
    (Thm. 5) follows from them without a second factorisation."""
    W, _, H = layer64
    W, H = W.to(dtype), H.to(dtype)
    perm = make_order(H, order, 16, direction)
    res = gptq_quantize(W, H, IntGrid(3), 16, perm=perm, clip=False)
    assert res.pivots is not None and res.pivots.shape == (64,)
    s = res.scales[:, res.g_idx].double()
    from_pivots = 0.25 * (res.pivots.double()[None, :] * s[:, res.perm] ** 2).sum(dim=1)
    ref = babai_bound(res.damped_hessian(H).double(), s, res.perm)
    rtol = 1e-12 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(from_pivots, ref, rtol=rtol, atol=0.0)


def test_pivots_on_lattice_paths(layer64):
    W, _, H = layer64
    W, H = W.float(), H.float()
    perm = make_order(H, "act")
    for res in (
        ssqr_quantize(W, H, 3, 16, 0.05, perm=perm, max_iter=2),
        entropy_coded_quantize(W, H, 3.0, perm=perm, max_iter=2),
    ):
        assert res.pivots is not None
        s = res.scales[:, res.g_idx].double()
        bound = 0.25 * (res.pivots.double()[None, :] * s[:, res.perm] ** 2).sum(dim=1)
        torch.testing.assert_close(
            bound, babai_bound(res.damped_hessian(H).double(), s, res.perm), rtol=1e-4, atol=0
        )


def _ill_conditioned(seed: int = 11, n: int = 64, cond_exp: int = 8):
    """float32 H with eigenvalues 1 .. 1e-8: its Cholesky succeeds, but the Cholesky of the
    explicitly inverted matrix (GPTQ's ``chol(cholesky_inverse(L))``) does not."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    H = (Q * torch.logspace(0, -cond_exp, n, dtype=torch.float64)) @ Q.T
    return torch.randn(4, n, generator=g).float(), H.float()


def test_ill_conditioned_hessian_does_not_crash_the_second_factorisation():
    W, H = _ill_conditioned()
    assert torch.linalg.cholesky_ex(H)[1] == 0  # the first factorisation is fine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a damping retry is allowed (and warned)
        res = gptq_quantize(W, H, IntGrid(4), None, percdamp=0.0)
    assert res.codes.min() >= 0 and res.codes.max() <= 15
    assert torch.isfinite(res.step_errors).all() and torch.isfinite(res.pivots).all()
    err = hessian_error(W.double(), res.dequantize(torch.float64), res.damped_hessian(H).double())
    torch.testing.assert_close(res.step_errors.double(), err, rtol=1e-2, atol=1e-6)


def test_gptq_factorisation_retries_with_warning_then_raises():
    W = torch.randn(4, 8)
    H = torch.ones(8, 8) - 0.02 * torch.eye(8)  # indefinite: needs more damping
    with pytest.warns(RuntimeWarning, match="not positive-definite"):
        res = gptq_quantize(W, H, IntGrid(4), None, percdamp=0.01)
    assert torch.isfinite(res.step_errors).all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(DampingError, match="--damp"):
            gptq_quantize(W, -1e3 * torch.eye(8) + torch.ones(8, 8), IntGrid(4), None)


def test_gptq_sets_threads_once_per_call_not_per_block(layer64, monkeypatch):
    """The solve runs in one thread setting (set once, restored), not toggled per block: toggling
    left the factorisations and block products in multi-threaded OpenMP regions that stall.  Only
    group fits (the vectorised MSE search) return to the caller's setting: one call for all static groups,
    one per group for dynamic ones."""
    W, _, H = layer64
    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda k: (calls.append(k), real(k)))
    before = torch.get_num_threads()
    real(2)
    try:
        for static in (True, False):
            for block_size in (4, 64):
                # 4 groups: dynamic groups fit each when reached (4 fits); static ones all in one call
                fits = 1 if static else 4
                for threads, expect in [(1, [1] + [2, 1] * fits + [2]), (None, [])]:
                    calls.clear()
                    kw = dict(perm=make_order(H, "act", 16), static_groups=static, scale_method="mse")
                    gptq_quantize(
                        W.float(), H.float(), IntGrid(4), 16, block_size=block_size, threads=threads, **kw
                    )
                    assert calls == expect, (static, block_size, threads, calls)
                    assert torch.get_num_threads() == 2
    finally:
        real(before)


@pytest.mark.parametrize("sym", [False, True])
def test_small_magnitude_group_keeps_precision(sym):
    """Weights ~1e-6: the old 2^-14 scale floor rounded the whole group to the zero-point; fp16
    subnormal scales (down to 2^-24) keep the error at a fraction of the weights."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(8, 64, generator=g, dtype=torch.float64) * 1e-6
    res = rtn_quantize(W, IntGrid(4, sym), 32)
    assert torch.equal(res.scales.half().double(), res.scales)  # still fp16-exact
    assert (res.scales > 0).all() and (res.scales < 2.0**-14).all()
    err = (res.dequantize(torch.float64) - W).abs().max()
    assert err < 0.1 * W.abs().max()  # the old floor gave err == max|W|
    assert err <= res.scales.max() / 2 * (1 + 1e-12)


def test_zero_group_gets_smallest_positive_scale():
    res = rtn_quantize(torch.zeros(2, 8, dtype=torch.float64), IntGrid(4), None)
    assert torch.equal(res.scales, torch.full((2, 1), 2.0**-24, dtype=torch.float64))
    assert torch.equal(res.dequantize(torch.float64), torch.zeros(2, 8, dtype=torch.float64))


def test_order_bound_table_uses_gptq_pivots(layer64):
    from bitmosaic.algorithms import damp_hessian, group_scale_zero, ldl_diagonal
    from bitmosaic.algorithms.lattice import order_bound_table
    from bitmosaic.formats.layout import default_g_idx

    W, _, H = layer64
    table = order_bound_table(W, H, IntGrid(3), 16, orders=("natural", "act", "min-pivot"))
    Hd = damp_hessian(H, 0.01)[0]
    s = group_scale_zero(W, IntGrid(3), 16, "mse")[0][:, default_g_idx(64, 16)]
    for order, row in table.items():
        perm = make_order(Hd, order, 16)
        basis = perm.flip(0)
        assert row["bound"] == pytest.approx(float(babai_bound(Hd, s, perm).sum()), rel=1e-10)
        assert row["trace_D"] == pytest.approx(float(ldl_diagonal(Hd[basis][:, basis]).sum()), rel=1e-10)
        assert 0 < row["noclip_error"] <= row["bound"]


def _reference_gptq(W, H, grid, g, perm, static, clip, percdamp=0.01):
    """GPTQ one column at a time, unblocked, with ``U = chol(inv(H_p))`` (GPTQ paper Alg. 1)."""
    from bitmosaic.algorithms import group_scale_zero, groups_contiguous

    n = W.shape[1]
    Hd = H + percdamp * torch.diagonal(H).mean() * torch.eye(n, dtype=H.dtype)
    U = torch.linalg.cholesky(torch.linalg.inv(Hd[perm][:, perm]), upper=True)
    Wp = W[:, perm].clone()
    codes = torch.empty_like(Wp)
    S, Z = group_scale_zero(W, grid, g)
    aligned = static or groups_contiguous(perm, g)
    s = z = None
    for i in range(n):
        k = int(perm[i]) // g
        if static:
            s, z = S[:, k], Z[:, k]
        elif aligned and (i == 0 or int(perm[i - 1]) // g != k):
            s, z = group_scale_zero(Wp[:, i : i + min(g, n - k * g)], grid, None)
            s, z = s[:, 0], z[:, 0]
        elif not aligned and i % g == 0:
            s, z = group_scale_zero(Wp[:, i : i + g], grid, None)
            s, z = s[:, 0], z[:, 0]
        q = torch.round(Wp[:, i] / s) + z
        q = q.clamp(0, grid.maxq) if clip else q
        err = (Wp[:, i] - (q - z) * s) / U[i, i]
        Wp[:, i:] -= err[:, None] * U[i, i:][None, :]
        codes[:, i] = q
    out = torch.empty_like(codes)
    out[:, perm] = codes
    return out.to(torch.int32)


@pytest.mark.parametrize("order", ["natural", "act", "gar"])
@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("clip", [True, False])
def test_blocked_solver_equals_unblocked_reference(layer64, order, static, clip):
    """One Cholesky + triangular inverse, inner/outer lazy blocks, transposed layout: the same
    integers as the textbook loop (float64)."""
    W, _, H = layer64
    grid = IntGrid(3)
    perm = make_order(H, order, 16)
    res = gptq_quantize(W, H, grid, 16, perm=perm, static_groups=static, clip=clip, block_size=40)
    assert torch.equal(res.codes, _reference_gptq(W, H, grid, 16, perm, static, clip))


@pytest.mark.parametrize("n", [5, 128, 300, 301])
def test_in_place_triangular_inverse_and_flip(n):
    """gptq_factor inverts its Cholesky factor and flips it in place (memory: one n x n matrix
    besides H); both equal the allocating operations they replace."""
    from bitmosaic.algorithms.hessian import _flip_both_, _transpose_, _tril_inverse_

    g = torch.Generator().manual_seed(n)
    L = torch.tril(torch.randn(n, n, generator=g, dtype=torch.float64)) + 4 * n**0.5 * torch.eye(
        n, dtype=torch.float64
    )
    ref = torch.linalg.solve_triangular(L, torch.eye(n, dtype=torch.float64), upper=False)
    got = _tril_inverse_(L.clone())
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    assert torch.equal(_flip_both_(got.clone(), rows=7), got.flip(0, 1))
    assert torch.equal(_transpose_(got.clone(), block=64), got.T)


def test_gptq_factor_returns_the_damped_diagonal(layer64):
    from bitmosaic.algorithms.hessian import damp_hessian, gptq_factor

    _, _, H = layer64
    H = H.double().clone()
    H[3, :] = 0
    H[:, 3] = 0  # a dead input: diagonal 1 + damping
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    diag, U, pivots, pd = gptq_factor(H, 0.01, perm)
    Hd = damp_hessian(H, 0.01)[0]
    assert torch.equal(diag, torch.diagonal(Hd))
    Hp = Hd[perm][:, perm]
    torch.testing.assert_close(
        U, torch.linalg.cholesky(torch.linalg.inv(Hp), upper=True), rtol=1e-8, atol=1e-10
    )
    torch.testing.assert_close(pivots, 1 / torch.diagonal(U) ** 2, rtol=1e-10, atol=0)


@pytest.mark.parametrize("wide_from, expect", [(64, 2), (65, 1)])
def test_wide_factorisation_runs_in_the_callers_threads(layer64, monkeypatch, wide_from, expect):
    """GPTQ's column loop runs in ``threads``; the factorisation and the between-block updates of a
    Hessian at least WIDE_SOLVE_MIN wide (a few large ops) in the caller's threads."""
    import bitmosaic.algorithms.gptq as G

    W, _, H = layer64
    seen = []
    real_factor = G.gptq_factor
    monkeypatch.setattr(G, "WIDE_SOLVE_MIN", wide_from)
    monkeypatch.setattr(
        G, "gptq_factor", lambda *a, **k: (seen.append(torch.get_num_threads()), real_factor(*a, **k))[1]
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gptq_quantize(W.float(), H.float(), IntGrid(4), 16, threads=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [expect]
