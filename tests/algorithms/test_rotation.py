"""Hadamard constructions, the fast Walsh-Hadamard transform and the random orthogonal matrices."""

from __future__ import annotations

import math

import pytest
import torch

from bitmosaic.algorithms.rotation import (
    NoHadamardError,
    hadamard_factor,
    hadamard_matrix,
    hadamard_transform,
    orthogonal_matrix,
    random_orthogonal,
)


@pytest.mark.parametrize("m", [12, 20, 28, 36, 44, 60, 76, 148])
def test_paley_orders_are_hadamard(m):
    H = hadamard_matrix(m)
    assert set(H.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(H @ H.T, m * torch.eye(m, dtype=H.dtype))


@pytest.mark.parametrize(
    "n, m",
    [(576, 36), (1536, 12), (64, 1), (4096, 1), (14336, 28), (640, 20), (896, 28), (18944, 148), (96, 12)],
)
def test_model_sizes_factor_into_known_orders(n, m):
    assert hadamard_factor(n) == m
    if n <= 1536:
        H = hadamard_matrix(n)
        assert torch.equal(H @ H.T, n * torch.eye(n, dtype=H.dtype))


@pytest.mark.parametrize("n", [6, 10, 52, 100, 3])
def test_unknown_orders_refused(n):
    assert hadamard_factor(n) is None
    with pytest.raises(NoHadamardError, match="--rotate random"):
        hadamard_matrix(n)


@pytest.mark.parametrize("n", [1, 2, 16, 12, 96, 576, 1536])
def test_fast_transform_is_the_matrix_product(n):
    x = torch.randn(3, 5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    want = x @ hadamard_matrix(n) / math.sqrt(n)
    assert torch.allclose(hadamard_transform(x), want, atol=1e-12, rtol=0)
    assert torch.allclose(hadamard_transform(x.float()), want.float(), atol=1e-5, rtol=0)


def test_orthogonal_matrices():
    for kind in ("hadamard", "random"):
        Q = orthogonal_matrix(kind, 36, seed=3)
        assert torch.allclose(Q @ Q.T, torch.eye(36, dtype=Q.dtype), atol=1e-12)
    assert torch.equal(random_orthogonal(20, 1), random_orthogonal(20, 1))
    assert not torch.equal(random_orthogonal(20, 1), random_orthogonal(20, 2))
    a, b = orthogonal_matrix("hadamard", 16, 0), orthogonal_matrix("hadamard", 16, 1)
    assert not torch.equal(a, b)  # the seed draws the random signs


def test_half_precision_inputs_transform_in_float32():
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(0)).bfloat16()
    got = hadamard_transform(x)
    assert got.dtype == torch.bfloat16
    want = (x.double() @ hadamard_matrix(576) / 24).bfloat16()
    assert torch.equal(got, want)
