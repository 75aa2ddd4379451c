"""GPTQ's factorisation in the Hessian's own memory (``overwrite``): the same numbers, one matrix less."""

import warnings

import pytest
import torch

from bitmosaic.algorithms import HessianAccumulator, gptq_quantize, make_order
from bitmosaic.algorithms.hessian import HessianSpentError, _permute_sym_, gptq_factor
from bitmosaic.formats.grid import IntGrid
from tests.conftest import correlated_inputs


def _hessian(n: int, seed: int, dead=(), dtype=torch.float32) -> torch.Tensor:
    X = correlated_inputs(4 * n, n, seed=seed).to(dtype)
    X[:, list(dead)] = 0
    acc = HessianAccumulator(n, dtype=dtype)
    acc.add(X)
    return acc.H


def test_symmetric_permutation_in_place():
    g = torch.Generator().manual_seed(0)
    M = torch.randn(37, 37, generator=g)
    for p in (torch.randperm(37, generator=g), torch.arange(37).flip(0), torch.arange(37)):
        assert torch.equal(_permute_sym_(M.clone(), p), M[p][:, p])


@pytest.mark.parametrize("order", ["natural", "act", "min-pivot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_factor_in_place_is_bit_identical(order, dtype):
    H = _hessian(96, seed=3, dead=(5, 40), dtype=dtype)
    perm = make_order(H, order, 32, "front")
    ref = gptq_factor(H.clone(), 0.01, perm)
    Hw = H.clone()
    got = gptq_factor(Hw, 0.01, perm, overwrite=True)
    for a, b in zip(ref[:3], got[:3], strict=True):
        assert torch.equal(a, b)
    assert ref[3] == got[3]
    assert got[1].data_ptr() == Hw.data_ptr()  # U is H's own memory


@pytest.mark.parametrize("static_groups", [False, True])
def test_gptq_with_a_disposable_hessian_is_bit_identical(static_groups):
    H = _hessian(128, seed=4, dead=(7,))
    W = torch.randn(24, 128, generator=torch.Generator().manual_seed(5)) * 0.05
    W0 = W.clone()
    perm = make_order(H, "act", 32, "front")
    kw = dict(perm=perm, scale_method="mse", static_groups=static_groups)
    ref = gptq_quantize(W, H.clone(), IntGrid(4), 32, **kw)
    got = gptq_quantize(W, H.clone(), IntGrid(4), 32, overwrite_hessian=True, **kw)
    assert torch.equal(W, W0)  # W is read only (no clone of it is made any more)
    for f in ("codes", "scales", "zeros", "g_idx", "step_errors", "pivots", "hessian_diag"):
        assert torch.equal(getattr(ref, f), getattr(got, f)), f


def test_a_failed_factorisation_in_place_asks_for_the_matrix_again():
    """Torch zeroes the other triangle, so a try that fails cannot be retried in place: the solver
    says so (no warning); on a kept matrix the same input retries with more damping and warns."""
    H = _hessian(64, seed=6)
    H[3, 3] = -H[3, 3]  # not positive-definite at small damping
    perm = torch.arange(64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(HessianSpentError):
            gptq_factor(H.clone(), 0.01, perm, overwrite=True)
    with pytest.warns(RuntimeWarning, match="retrying"):
        gptq_factor(H.clone(), 0.01, perm)
