"""The paired bootstrap over evaluation windows (:func:`bitmosaic.eval.bootstrap.bootstrap_ratio`) on
known distributions: identical rows give an interval that contains 1 and is narrow, a constant shift an
interval that excludes 1 (at exactly exp(shift)), a shift under window noise an interval around it."""

import math

import pytest
import torch

from bitmosaic.eval.bootstrap import bootstrap_ratio


def _windows(n: int = 300, seed: int = 0) -> torch.Tensor:
    """Mean NLLs of ``n`` windows as a real run's vary (around 3.5 nats, sd 0.4)."""
    return 3.5 + 0.4 * torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_identical_rows_give_an_interval_around_one():
    b = _windows()
    assert bootstrap_ratio(b, b.clone()) == (1.0, 1.0)  # no difference on any window
    # two models equal up to window-level noise (sd 0.002 nats): contains 1, within a few tenths of 1%
    a = b + 0.002 * torch.randn(b.numel(), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lo, hi = bootstrap_ratio(a, b)
    assert lo < 1 < hi and hi - lo < 0.001


def test_a_constant_shift_excludes_one():
    b = _windows()
    lo, hi = bootstrap_ratio(b + 0.01, b)  # every window 0.01 nats worse
    assert lo == pytest.approx(math.exp(0.01), rel=1e-9) and hi == pytest.approx(math.exp(0.01), rel=1e-9)
    assert bootstrap_ratio(b - 0.01, b)[1] < 1  # better by the same: the interval is below 1


def test_a_shift_under_window_noise_is_found():
    """A 1% perplexity gain with window-to-window noise (sd 0.02 nats): the interval holds the true ratio
    and excludes 1; with 10x the noise it includes 1 -- what the findings call "within noise"."""
    b = _windows()
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(b.numel(), generator=g, dtype=torch.float64)
    noise -= noise.mean()  # the measured mean difference is the true one: the interval is around it
    true = math.exp(-0.01)
    lo, hi = bootstrap_ratio(b - 0.01 + 0.02 * noise, b)
    assert lo < true < hi < 1
    lo, hi = bootstrap_ratio(b - 0.01 + 0.2 * noise, b)
    assert lo < 1 < hi


def test_summed_nll_with_tokens_per_window_is_the_same_interval_and_seeded():
    a, b = _windows(seed=4), _windows(seed=5)
    mean = bootstrap_ratio(a, b)
    summed = bootstrap_ratio(a * 511, b * 511, tokens_per_window=511)
    assert summed == pytest.approx(mean, rel=1e-12)
    assert bootstrap_ratio(a.tolist(), b.tolist()) == mean  # a fixed generator seed: the same interval
    assert bootstrap_ratio(a, b, seed=1) != mean
    lo90, hi90 = bootstrap_ratio(a, b, level=0.9)
    assert mean[0] < lo90 < hi90 < mean[1]


def test_windows_must_pair():
    with pytest.raises(ValueError, match="same windows"):
        bootstrap_ratio([3.0, 3.1], [3.0])
    with pytest.raises(ValueError, match="same windows"):
        bootstrap_ratio([], [])
    with pytest.raises(ValueError, match="level"):
        bootstrap_ratio([3.0], [3.0], level=1.5)
