"""Paired bootstrap over evaluation windows: how far the perplexity ratio of two models evaluated on the
same windows could sit from where it did, given how much it moves window to window (issue 73, item 8).

Every window predicts the same number of tokens (:mod:`bitmosaic.eval.perplexity`), so
``ppl(a) / ppl(b) = exp(mean over windows of (nll_a - nll_b) / tokens_per_window)`` with ``nll`` a
window's summed NLL (or its mean NLL with ``tokens_per_window`` 1).  The two models share the windows'
text, so each window's difference is one paired sample; resampling windows with replacement (a fixed
generator seed: the same inputs give the same interval) gives the interval's percentiles.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["bootstrap_ratio"]


def bootstrap_ratio(
    a_nll: Sequence[float] | torch.Tensor,
    b_nll: Sequence[float] | torch.Tensor,
    tokens_per_window: int = 1,
    n: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """The ``level`` (default 95%) interval of ``ppl(a) / ppl(b)`` over ``n`` paired resamples of the
    windows: ``a_nll[i]`` and ``b_nll[i]`` are the two models' NLL on window ``i`` (summed over its
    tokens, with ``tokens_per_window`` the number of tokens it predicts; or its mean, with 1)."""
    a = torch.as_tensor(a_nll, dtype=torch.float64).flatten()
    b = torch.as_tensor(b_nll, dtype=torch.float64).flatten()
    if a.numel() != b.numel() or a.numel() == 0:
        raise ValueError(
            f"a paired bootstrap needs both models' NLL on the same windows: got {a.numel()} and "
            f"{b.numel()} windows"
        )
    if not 0 < level < 1 or n < 1 or tokens_per_window < 1:
        raise ValueError(
            f"need 0 < level < 1, n >= 1, tokens_per_window >= 1; got {level}, {n}, {tokens_per_window}"
        )
    d = a - b
    idx = torch.randint(0, d.numel(), (n, d.numel()), generator=torch.Generator().manual_seed(seed))
    r = torch.exp(d[idx].mean(dim=1) / tokens_per_window)
    tail = (1 - level) / 2
    return float(torch.quantile(r, tail)), float(torch.quantile(r, 1 - tail))
