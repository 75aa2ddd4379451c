"""The compiled lattice codebook search (kernels/lattice_search.py, csrc/latticesearch.cpp; issue 72): the
torch reference ``nearest_many``'s indices and values bit for bit, on every ISA this CPU runs, and the
search's choice is the exact best point under the type's sign rule (brute force over the codebook)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.algorithms import gguf_lattice as L
from bitmosaic.formats import gguf_lattice as gl
from bitmosaic.kernels import isa, lattice_search

compiled = pytest.mark.skipif(
    lattice_search.extension() is None, reason="no C++ compiler: pure-torch path only"
)


def _inputs(t, n, C, seed, zeros=False):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, t.dim, generator=g).abs() * 10.0 ** torch.randint(-4, 1, (n, 1), generator=g)
    if zeros:  # exact zeros and ties: every codebook point scored alike somewhere
        a[::3] = 0
    m = torch.rand(n, t.dim, generator=g) ** 3
    s = a.amax(-1, keepdim=True) * (0.5 + torch.rand(n, C, generator=g)) / 15
    return a, m, s


@compiled
@settings(max_examples=20, deadline=None)
@given(typ=st.sampled_from(sorted(gl.LATTICE_TYPES)), n=st.integers(1, 300), C=st.integers(1, 10),
       seed=st.integers(0, 2**31 - 1), zeros=st.booleans())  # fmt: skip
def test_kernel_equals_the_torch_reference_bit_for_bit(typ, n, C, seed, zeros):
    t = gl.LATTICE_TYPES[typ]
    a, m, s = _inputs(t, n, C, seed, zeros)
    G = gl.codebook(t)
    prev = L.set_fast_nearest(None)
    try:
        ref = L.nearest_many(a, m, s, G, t.parity)
    finally:
        L.set_fast_nearest(prev)
    ext = lattice_search.extension()
    for name in isa.available_isas(ext):
        got = ext.nearest_many(a, m, s, G.T.contiguous(), t.parity, isa.ISAS.index(name))
        for x, y in zip(ref, got, strict=True):
            assert x.dtype == y.dtype and torch.equal(x.view(torch.int32), y.view(torch.int32)), name


@compiled
@settings(max_examples=20, deadline=None)
@given(typ=st.sampled_from(sorted(gl.LATTICE_TYPES)), n=st.integers(1, 300), k=st.integers(1, 12),
       seed=st.integers(0, 2**31 - 1), zeros=st.booleans())  # fmt: skip
def test_kernel_top_k_equals_the_stable_sort_bit_for_bit(typ, n, k, seed, zeros):
    """The vector GPTQ's candidates: the k first points by r (a stable sort's), indices and values."""
    t = gl.LATTICE_TYPES[typ]
    a, m, s = _inputs(t, n, 1, seed, zeros)
    G = gl.codebook(t)
    prev = L.set_fast_nearest(None)
    try:
        ref = L.nearest_k(a, m, s[:, 0], G, k)
        r_all = L.nearest_many(a, m, s, G, False)
    finally:
        L.set_fast_nearest(prev)
    assert torch.equal(ref[0][:, 0], r_all[0][:, 0]) and torch.equal(ref[1][:, 0], r_all[1][:, 0])
    ext = lattice_search.extension()
    for name in isa.available_isas(ext):
        got = ext.nearest_k(a, m, s[:, 0].contiguous(), G.T.contiguous(), k, isa.ISAS.index(name))
        for x, y in zip(ref, got, strict=True):
            assert x.dtype == y.dtype and torch.equal(x.view(torch.int32), y.view(torch.int32)), name


@pytest.mark.parametrize("typ", sorted(gl.LATTICE_TYPES))
def test_points_are_the_exact_best_under_the_sign_rule(typ):
    """Brute force: every codebook point for every point of a sign group, signs those of the weights, and
    where their parity is odd every single flip; the search's choice has the least weighted error."""
    t = gl.LATTICE_TYPES[typ]
    G = gl.codebook(t).double()
    g = torch.Generator().manual_seed(3)
    k = t.run // t.dim
    w = torch.randn(40 * k, t.dim, generator=g, dtype=torch.float64).float() * 0.05
    m = torch.rand(40 * k, t.dim, generator=g) ** 2
    s = (w.abs().amax(-1) / 12).reshape(-1, k)[:, :1].repeat_interleave(k, 0)  # one scale per sign group
    _, neg, q = L._points(w, m, s, t)
    err_of = lambda q_: (m.double() * (w.double() - s.double() * q_.double()) ** 2).sum(-1)  # noqa: E731
    got = err_of(q[:, 0]).reshape(-1, k).sum(-1)
    wd, md = w.double().reshape(-1, k, t.dim), m.double().reshape(-1, k, t.dim)
    for i in range(wd.shape[0]):
        sd = float(s[i * k, 0])
        # per point of the group: each codebook point's error with the weights' signs, and with a flip of j
        base = [(md[i, p] * (wd[i, p].abs() - sd * G) ** 2).sum(-1) for p in range(k)]  # [P] each
        flip = [base[p][:, None] + 4 * sd * md[i, p] * wd[i, p].abs() * G for p in range(k)]  # [P, dim]
        odd = bool((wd[i] < 0).sum() % 2) and t.parity
        if not odd:
            best = sum(float(b.min()) for b in base)
        else:
            best = min(float(flip[p].min()) + sum(float(base[o].min()) for o in range(k) if o != p)
                       for p in range(k))  # fmt: skip
        assert float(got[i]) <= best * (1 + 1e-5) + 1e-12
        assert not t.parity or int(neg[i * k : i * k + k, 0].sum()) % 2 == 0
