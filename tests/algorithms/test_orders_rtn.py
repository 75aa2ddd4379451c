import pytest
import torch

from bitmosaic.algorithms import groups_contiguous, make_order, min_pivot_sequence, rtn_quantize
from bitmosaic.algorithms.scales import find_scale_zero
from bitmosaic.formats.grid import IntGrid


@pytest.mark.parametrize("order", ["natural", "act", "gar", "min-pivot"])
@pytest.mark.parametrize("direction", ["front", "back"])
def test_orders_are_permutations(layer64, order, direction):
    _, _, H = layer64
    p = make_order(H, order, 16, direction)
    assert torch.equal(torch.sort(p).values, torch.arange(64))


def test_act_order_descending(layer64):
    _, _, H = layer64
    d = torch.diagonal(H)[make_order(H, "act")]
    assert torch.all(d[:-1] >= d[1:])


def test_gar_keeps_groups_contiguous_and_sorted(layer64):
    _, _, H = layer64
    p = make_order(H, "gar", 16)
    assert groups_contiguous(p, 16)
    d = torch.diagonal(H)
    runs = p.reshape(4, 16)
    for run in runs:
        assert len(set((run // 16).tolist())) == 1
        assert torch.all(d[run][:-1] >= d[run][1:])
    maxes = torch.stack([d[run].max() for run in runs])
    assert torch.all(maxes[:-1] >= maxes[1:])
    assert not groups_contiguous(make_order(H, "act", 16), 16)


def test_min_pivot_takes_smallest_schur_pivot(layer64):
    _, _, H = layer64
    seq = min_pivot_sequence(H)
    A = H[seq][:, seq]
    D = torch.diagonal(torch.linalg.cholesky(A)) ** 2
    # brute-force check of the greedy rule on the first few steps
    remaining = list(range(64))
    S = H.clone()
    for k in range(6):
        cand = torch.tensor(remaining)
        j = cand[torch.argmin(torch.diagonal(S)[cand])]
        assert int(seq[k]) == int(j)
        assert torch.isclose(S[j, j], D[k])
        S = S - torch.outer(S[:, j], S[j, :]) / S[j, j]
        remaining.remove(int(j))


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_rtn_error_within_half_step(bits, sym):
    W = torch.randn(16, 96, generator=torch.Generator().manual_seed(bits), dtype=torch.float64)
    res = rtn_quantize(W, IntGrid(bits, sym), 32)
    err = (W - res.dequantize(torch.float64)).abs()
    assert torch.all(err <= res.scales[:, res.g_idx] * 0.5 + 1e-12)
    assert res.codes.min() >= 0 and res.codes.max() <= (1 << bits) - 1
    if sym:
        assert torch.all(res.zeros == 1 << (bits - 1))


def test_mse_scale_search_lowers_error_with_outliers():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 128, generator=g, dtype=torch.float64)
    w[:, 0] = 12.0  # heavy outlier per row
    grid = IntGrid(3)
    s_mm, z_mm = find_scale_zero(w, grid, "minmax")
    s_mse, z_mse = find_scale_zero(w, grid, "mse")
    from bitmosaic.formats.grid import dequantize_codes, quantize_codes

    def err(s, z):
        return (
            (dequantize_codes(quantize_codes(w, s[:, None], z[:, None], 7), s[:, None], z[:, None]) - w).abs()
            ** 2.4
        ).sum()

    assert err(s_mse, z_mse) <= err(s_mm, z_mm)
    assert torch.all(s_mse <= s_mm)


def test_bad_order_and_direction_messages(layer64):
    _, _, H = layer64
    with pytest.raises(ValueError, match="unknown order"):
        make_order(H, "random")
    with pytest.raises(ValueError, match="direction"):
        make_order(H, "act", direction="sideways")


def _min_pivot_reference(H: torch.Tensor) -> torch.Tensor:
    """The original left-looking O(n^3) loop (one column per step), kept as the reference."""
    A = H.to(torch.float64)
    n = A.shape[0]
    L = torch.zeros(n, n, dtype=torch.float64)
    d = torch.diagonal(A).clone()
    taken = torch.zeros(n, dtype=torch.bool)
    seq = torch.empty(n, dtype=torch.long)
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    for k in range(n):
        j = int(torch.argmin(torch.where(taken, inf, d)))
        seq[k] = j
        piv = d[j]
        if piv <= 0:
            rest = (~taken).nonzero().flatten()
            rest = rest[rest != j]
            rest = rest[torch.argsort(torch.diagonal(A)[rest], stable=True)]
            seq[k + 1 :] = rest
            break
        col = A[:, j] - L[:, :k] @ L[j, :k]
        col = col / piv.sqrt()
        col[taken] = 0
        col[j] = piv.sqrt()
        L[:, k] = col
        taken[j] = True
        d = d - col * col
    return seq


def _pivot_test_matrices():
    """Hessians as min-pivot sees them (damped, so the pivots are not rounding noise), ties, and
    indefinite matrices whose Schur complement turns negative (the fallback branch)."""
    from tests.conftest import correlated_inputs

    out = []
    for seed, (tokens, n) in enumerate([(300, 50), (120, 200), (2000, 300)]):
        X = correlated_inputs(tokens, n, seed=seed)
        H = 2 / tokens * X.T @ X  # rank-deficient when tokens < n
        out.append(H + 1e-4 * torch.diagonal(H).mean() * torch.eye(n, dtype=H.dtype))
    out.append(torch.eye(70, dtype=torch.float64))  # all ties
    B = torch.randn(90, 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out.append(B @ B.T - 2.0 * torch.eye(90, dtype=torch.float64))  # positive diagonal, indefinite
    return out


@pytest.mark.parametrize("k", range(5))
def test_min_pivot_blocked_equals_reference(k):
    H = _pivot_test_matrices()[k]
    if k == 4:  # the fallback is reached after a few real pivots, inside the first panel and later
        assert (torch.diagonal(H) > 0).all() and torch.linalg.cholesky_ex(H)[1] > 1
        for bs in (3, 64):
            assert torch.equal(min_pivot_sequence(H, block_size=bs), _min_pivot_reference(H))
    assert torch.equal(min_pivot_sequence(H), _min_pivot_reference(H))
    assert torch.equal(min_pivot_sequence(H.float()), _min_pivot_reference(H.float()))
