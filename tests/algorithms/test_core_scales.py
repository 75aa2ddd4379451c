"""The vectorised MSE scale search equals GPTQ's sequential candidate loop."""

import pytest
import torch

from bitmosaic.algorithms.scales import find_scale_zero, group_scale_zero, range_scale_zero
from bitmosaic.formats.grid import IntGrid, dequantize_codes, quantize_codes


def _mse_loop(w, grid, mse_grid=100, max_shrink=0.8, norm=2.4):
    """The sequential search (GPTQ's ``Quantizer.find_params(mse=True)``), kept as the slow reference:
    candidates ``p = 1 - i/grid`` in order, a strictly smaller error replaces the best (first wins)."""
    xmin, xmax = w.amin(dim=1), w.amax(dim=1)
    scale, zero = range_scale_zero(xmin, xmax, grid)
    best = torch.full_like(scale, float("inf"))
    for i in range(int(max_shrink * mse_grid)):
        p = 1 - i / mse_grid
        s1, z1 = range_scale_zero(p * xmin, p * xmax, grid)
        q = dequantize_codes(quantize_codes(w, s1[:, None], z1[:, None], grid.maxq), s1[:, None], z1[:, None])
        err = (q - w).abs_().pow_(norm).sum(dim=1)
        better = err < best
        best = torch.where(better, err, best)
        scale = torch.where(better, s1, scale)
        zero = torch.where(better, z1, zero)
    return scale, zero


def _groups(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g, dtype=torch.float64)
    w[:, 0] *= 9.0  # outliers: the search shrinks the range
    w[:8] = torch.randint(-3, 4, (8, 64), generator=g).double() * 0.125  # exact grid: many ties
    w[8:12] = 0.0  # all-zero rows
    w[12:16] *= 1e-6  # tiny rows (fp16 subnormal scales)
    w[16, :] = 0.37  # constant row
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grid", [IntGrid(2), IntGrid(3), IntGrid(4), IntGrid(4, symmetric=True), IntGrid(8)])
def test_vectorised_mse_equals_sequential_loop(dtype, grid):
    w = _groups(dtype)
    s, z = find_scale_zero(w, grid, "mse")
    s_ref, z_ref = _mse_loop(w, grid)
    assert torch.equal(s, s_ref) and torch.equal(z, z_ref)


def test_mse_chunking_and_options_do_not_change_the_choice():
    w = _groups(torch.float32)
    grid = IntGrid(3)
    ref = _mse_loop(w, grid, mse_grid=37, max_shrink=0.6, norm=2.0)
    for chunk in (1, 7, 1000):
        got = find_scale_zero(
            w, grid, "mse", mse_grid=37, max_shrink=0.6, norm=2.0, chunk_elems=chunk * w.numel()
        )
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_mse_ties_keep_the_first_candidate():
    """Rows already on a grid: many shrink factors give the same error; the first (largest) wins."""
    w = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]], dtype=torch.float64)
    s, z = find_scale_zero(w, IntGrid(3), "mse")
    assert float(s) == 1.0 and float(z) == 0.0
    assert torch.equal(torch.stack([s, z]), torch.stack(_mse_loop(w, IntGrid(3))))


def test_group_scale_zero_mse_matches_loop_per_group():
    g = torch.Generator().manual_seed(1)
    W = torch.randn(32, 200, generator=g)
    s, z = group_scale_zero(W, IntGrid(4), 64, "mse")
    for k in range(4):
        rs, rz = _mse_loop(W[:, 64 * k : 64 * (k + 1)], IntGrid(4))
        assert torch.equal(s[:, k], rs) and torch.equal(z[:, k], rz)


def test_unknown_scale_method_message():
    with pytest.raises(ValueError, match="unknown scale method 'l1'; use 'minmax' or 'mse'"):
        find_scale_zero(torch.ones(2, 4), IntGrid(4), "l1")
