"""``benchmarks/mosaic/atom_model.py``: the model-level Atom-like W4A4 baseline computes, per linear, what the
per-linear one of ``mosaic_layers.py`` computes, keeps the largest-activation channels in INT8 and
replaces every decoder linear."""

from __future__ import annotations

import copy

import torch

from benchmarks.mosaic import atom_model, mosaic_layers
from tests.helpers import tiny_llama


def test_atom_like_linear_is_the_per_linear_baseline():
    atom, layers = atom_model, mosaic_layers
    g = torch.Generator().manual_seed(0)
    X = torch.randn(64, 96, generator=g)
    X[:, 5] *= 30  # an outlier channel: it must land among the INT8 ones
    W = torch.randn(40, 96, generator=g)
    H = 2 / X.shape[0] * X.T.double() @ X.double()
    amax = X.abs().amax(0)
    Y, bits = layers.atom_like(X, W, H, amax, layers.A4, share=0.05)
    lo, hi, w_lo, w_hi, _ = layers.atom_like_weights(W, H, amax, layers.A4, share=0.05)
    assert 5 in hi.tolist() and len(hi) == bits["atom_8bit_channels"] == 5
    lin = torch.nn.Linear(96, 40, bias=True)
    with torch.no_grad():
        lin.bias.normal_(generator=g)
    mod = atom.AtomLikeLinear(lin, lo, hi, w_lo, w_hi, layers.A4)
    assert torch.equal(mod(X), Y + lin.bias)


def test_quantize_atom_like_replaces_every_decoder_linear():
    atom = atom_model
    m = tiny_llama()
    ref = copy.deepcopy(m)
    calib = torch.randint(0, 128, (6, 32), generator=torch.Generator().manual_seed(0))
    bits = atom.quantize_atom_like(m, calib)
    n_lin = sum(isinstance(x, torch.nn.Linear) for x in ref.model.layers.modules())
    assert sum(isinstance(x, atom.AtomLikeLinear) for x in m.modules()) == n_lin
    assert not any(isinstance(x, torch.nn.Linear) for x in m.model.layers.modules())
    assert 4 < bits["weight_bpw"] < 8 and 4 < bits["act_bits"] < 8
    with torch.no_grad():
        a, b = ref(calib[:2]).logits, m(calib[:2]).logits
    assert torch.isfinite(b).all() and float((a - b).norm() / a.norm()) < 0.5
