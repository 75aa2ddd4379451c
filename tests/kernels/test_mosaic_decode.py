"""MosaicQuant decode path: the compiled residual pass (``csrc/mosaic.cpp``) equals the torch
``sparse_only`` reference (edge blocks, 1..8 rows, empty selection), ``decode`` equals the reference
forward, and the pure-torch fallback still runs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.kernels import build, isa, mosaic
from bitmosaic.kernels.mosaic import DECODE_ROWS, MosaicWeight
from bitmosaic.kernels.qmatmul import LowBitWeight
from tests.methods.test_mosaic import _module

needs_ext = pytest.mark.skipif(mosaic.extension() is None, reason="no C++ compiler for the extension")


def _weight(N, K, block, density, seed):
    """A random dense 4-bit base plus a random ``density`` of residual blocks (int4 codes)."""
    g = torch.Generator().manual_seed(seed)
    bm, bk = block
    dense = LowBitWeight.from_codes(
        torch.randint(0, 16, (N, K), generator=g), 4, torch.rand(N, 1, generator=g) * 0.1, 8.0, -1
    )
    nblocks = -(-N // bm) * -(-K // bk)
    mask = torch.rand(nblocks, generator=g) < density
    mask[int(torch.randint(nblocks, (1,), generator=g))] |= density > 0  # at least one block
    index = torch.nonzero(mask).reshape(-1)
    codes = torch.randint(-7, 8, (index.numel(), bm, bk), generator=g, dtype=torch.int8)
    scales = torch.rand(index.numel(), bm, generator=g) * 0.01
    return MosaicWeight(dense, index, codes, scales, (N, K), block)


def _compiled_residual(k, x, y0):
    y = y0.clone()
    ext = mosaic.extension()
    ext.residual_accumulate(x, k.codes_t, k.scales, k.cb, k.starts_t, y, k.bm, isa.isa_number(ext=ext))
    return y


def _close(a, b):
    tol = 1e-5 * max(float(b.abs().max()), 1e-6)
    assert a.shape == b.shape and float((a - b).abs().max()) <= tol


@needs_ext
@pytest.mark.parametrize(
    "N,K,block",
    [
        (100, 70, (64, 64)),
        (576, 1536, (64, 64)),
        (1536, 576, (64, 64)),
        (70, 100, (24, 40)),
        (64, 64, (64, 64)),
    ],
)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_compiled_residual_equals_sparse_only(N, K, block, rows):
    k = _weight(N, K, block, 0.3, seed=N + K + rows)
    assert k.codes.shape[0] > 0
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    ref = k.sparse_only(x)
    _close(_compiled_residual(k, x, torch.zeros(rows, N)), ref)
    y0 = torch.randn(rows, N)  # it accumulates into what y holds
    _close(_compiled_residual(k, x, y0), y0 + ref)
    _close(k.decode(x), k.dense_only(x) + ref)


@needs_ext
@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    N=st.integers(1, 90),
    K=st.integers(1, 90),
    bm=st.integers(1, 40),
    bk=st.integers(1, 40),
    rows=st.integers(1, DECODE_ROWS),
    density=st.sampled_from([0.0, 0.2, 1.0]),
    seed=st.integers(0, 1000),
)
def test_compiled_residual_property(N, K, bm, bk, rows, density, seed):
    k = _weight(N, K, (bm, bk), density, seed)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(seed))
    _close(_compiled_residual(k, x, torch.zeros(rows, N)), k.sparse_only(x))


@needs_ext
def test_empty_selection_leaves_the_dense_output():
    k = _weight(100, 70, (64, 64), 0.0, seed=1)
    assert k.codes.shape[0] == 0
    x = torch.randn(4, 70)
    assert torch.equal(k.decode(x), k.dense_only(x))


@needs_ext
def test_bad_inputs_are_refused():
    k = _weight(100, 70, (64, 64), 0.5, seed=2)
    with pytest.raises(ValueError, match="at most 8 rows"):
        k.decode(torch.randn(DECODE_ROWS + 1, 70))
    with pytest.raises(RuntimeError, match="at most 8"):
        _compiled_residual(k, torch.randn(9, 70), torch.zeros(9, 100))


@pytest.mark.parametrize("no_ext", [False, True])
def test_module_forward_at_decode_equals_the_reference(monkeypatch, no_ext):
    if no_ext:
        monkeypatch.setattr(mosaic, "extension", lambda: None)
    res, m = _module(block=(24, 40))  # partial edge blocks on both axes
    ref_w = m.dequantize_reference(torch.float32)
    for shape in [(1, 96), (1, 1, 96), (2, 3, 96)]:  # 1 and 6 rows: the decode path
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape)))
        _close(m(x), torch.nn.functional.linear(x, ref_w))
        _close(m.kernel().decode(x), torch.nn.functional.linear(x, ref_w))


def test_no_ext_environment_disables_the_build(monkeypatch):
    monkeypatch.setenv("BITMOSAIC_NO_EXT", "1")
    monkeypatch.setattr(build, "_warned", False)
    with pytest.warns(RuntimeWarning, match=r"C\+\+ kernels unavailable \(\$BITMOSAIC_NO_EXT=1\)"):
        assert mosaic.extension() is None
