"""benchmarks/mosaic/alpha_tokens.py measures the α search's own loss, split by token."""

from __future__ import annotations

import torch

from benchmarks.mosaic.alpha_tokens import token_errors
from bitmosaic.algorithms.smooth import smooth_scales, smoothing_loss
from bitmosaic.formats.act import ActQuantSpec, fake_quant


def test_token_errors_sum_to_the_searchs_loss_and_vanish_without_quantization():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(64, 48, generator=g) * torch.linspace(0.1, 8, 48)
    weights = [torch.randn(32, 48, generator=g), torch.randn(16, 48, generator=g)]
    s = smooth_scales(X.abs().amax(0), weights, 0.5).float()
    spec = ActQuantSpec("int", 8)

    def qw(W):
        return torch.round(W * 7 / W.abs().amax(1, keepdim=True)) * W.abs().amax(1, keepdim=True) / 7

    def qx(A):
        return fake_quant(A, spec)

    e, n = token_errors(X, weights, s, lambda Ws, s_: qw(Ws), qx)
    loss = smoothing_loss(X, weights, s, qw, qx, dtype=torch.float32)
    torch.testing.assert_close(float(e.sum()), loss, rtol=1e-4, atol=0)
    ref = sum((X.double() @ W.double().T).pow(2).sum(1) for W in weights)
    torch.testing.assert_close(n, ref, rtol=1e-5, atol=0)
    e0, _ = token_errors(X, weights, s, lambda Ws, s_: Ws, lambda A: A)
    assert float(e0.max()) < 1e-6 * float(n.min())  # smoothing alone changes no output
