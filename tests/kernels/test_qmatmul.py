"""The compiled low-bit matmul (kernels/qmatmul.py) against the float64 reference
``x @ ((c - z) * s)ᵀ``, for every width 1-8, mixes per block, group sizes with partial groups, odd
shapes, decode and prefill batches, float32 and bfloat16 inputs -- on every instruction set this CPU
runs (portable, AVX2, AVX-512; ``BITMOSAIC_KERNEL_ISA``); and its pure-torch fallback."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.kernels import isa, qmatmul, tiles
from bitmosaic.kernels.qmatmul import LowBitWeight
from tests.helpers import env_var


def _case(N, K, gs, bits, row_block, seed, scalar_zero=False):
    g = torch.Generator().manual_seed(seed)
    gsz = K if gs < 0 or gs >= K else gs
    G = -(-K // gsz)
    rb = row_block or N
    n_rb = -(-N // rb)
    bmap = bits if torch.is_tensor(bits) else torch.full((n_rb, G), bits)
    codes = torch.empty(N, K, dtype=torch.int32)
    for r in range(n_rb):
        for j in range(G):
            hi = 1 << int(bmap[r, j])
            blk = codes[r * rb : (r + 1) * rb, j * gsz : (j + 1) * gsz]
            blk.copy_(torch.randint(0, hi, blk.shape, generator=g))
    s = torch.rand(N, G, generator=g) * 0.1 + 1e-3
    z = 3.0 if scalar_zero else torch.randint(0, 4, (N, G), generator=g).float()
    gi = torch.arange(K) // gsz
    zz = torch.full((N, G), z) if scalar_zero else z
    ref = (codes.float() - zz[:, gi]) * s[:, gi]
    w = LowBitWeight.from_codes(codes, bits, s, z, gs, row_block)
    # the kernel folds the zero-point (s * (sum c x - z sum x)): its float32 rounding scales with
    # |c s| + |z s|, not with |(c - z) s|
    w.err_scale = (codes.float() * s[:, gi]).abs() + (zz[:, gi] * s[:, gi]).abs()
    return w, ref, g


def _isa(name):
    return env_var(isa.ISA_ENV, name)


def _available():
    ext = qmatmul.extension()
    return isa.available_isas(ext) if ext is not None else []


def _isas():
    return _available() or ["fallback"]


def _check_all(w, ref, g, batches, rows=None):
    """Every instruction set: dequantize is bitwise the reference, matmul within float rounding."""
    for name in _isas():
        with _isa(name) if name != "fallback" else contextlib.nullcontext():
            assert torch.equal(w.dequantize(), ref), name
            if rows is not None:
                assert torch.equal(w.dequantize(rows), ref[rows]), name
            _check_matmul(w, ref, g, batches)


def _check_matmul(w, ref, g, batches=(1, 3, 8, 9, 33)):
    K = ref.shape[1]
    for M in batches:
        x = torch.randn(M, K, generator=g)
        y = w.matmul(x)
        yr = x.double() @ ref.double().T
        scale = x.abs().double() @ w.err_scale.double().T + 1e-12
        assert float(((y.double() - yr).abs() / scale).max()) < 1e-5, M
    xb = torch.randn(2, 3, K, generator=g).bfloat16()
    yb = w.matmul(xb)
    assert yb.dtype == torch.bfloat16 and yb.shape == (2, 3, ref.shape[0])
    torch.testing.assert_close(yb.float(), (xb.float() @ ref.T), rtol=2e-2, atol=2e-2)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    N=st.integers(1, 40),
    K=st.integers(1, 300),
    gs=st.sampled_from([-1, 8, 32, 64, 100, 128, 256]),
    bits=st.integers(1, 8),
    scalar_zero=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_uniform_widths_match_reference(N, K, gs, bits, scalar_zero, seed):
    w, ref, g = _case(N, K, gs, bits, None, seed, scalar_zero)
    _check_all(w, ref, g, batches=(1, 5, 12))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    N=st.integers(1, 50),
    G=st.integers(1, 5),
    gs=st.sampled_from([8, 24, 64, 128]),
    tail=st.integers(0, 7),
    row_block=st.integers(1, 20),
    seed=st.integers(0, 2**16),
)
def test_mixed_widths_per_block_match_reference(N, G, gs, tail, row_block, seed):
    K = max(1, G * gs - tail)  # a partial last group when tail > 0
    G = -(-K // gs)
    bmap = torch.randint(1, 9, (-(-N // row_block), G), generator=torch.Generator().manual_seed(seed))
    w, ref, g = _case(N, K, gs, bmap, row_block, seed)
    _check_all(w, ref, g, batches=(1, 4, 11), rows=slice(N // 3, N))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(N=st.integers(1, 30), G=st.integers(1, 6), gs=st.sampled_from([8, 40, 64, 128, 200]),
       bits=st.integers(1, 8), seed=st.integers(0, 2**16))  # fmt: skip
def test_one_width_packs_all_groups_at_once_to_the_per_group_bytes(N, G, gs, bits, seed):
    """The one-call packing of a block whose groups share a width (qmatmul._pack_row_block) writes the
    bytes and offsets of packing each group on its own (the layout's definition)."""
    codes = torch.randint(0, 1 << bits, (N, G * gs), generator=torch.Generator().manual_seed(seed))
    w = LowBitWeight.from_codes(codes, bits, torch.ones(N, G), 0.0, gs)
    parts = [qmatmul._pack_any(codes[:, g * gs : (g + 1) * gs], bits) for g in range(G)]
    want = torch.cat(parts, 1)
    assert torch.equal(w.data[: want.numel()], want.reshape(-1)) and w.data.numel() == want.numel() + 64
    assert w.goff[0].tolist() == [sum(p.shape[1] for p in parts[:g]) for g in range(G)]


@pytest.mark.parametrize("gs", [16, 32])
@pytest.mark.parametrize("bits", range(1, 9))
def test_shared_spans_hold_small_groups_without_padding(bits, gs):
    """Groups of 16 / 32 codes of one width share their row's 64-code spans (layout 3): the codes take
    their bits and no more, and every ISA, the torch fallback and every batch path give the reference."""
    N, K = 37, 64 * 5
    w, ref, g = _case(N, K, gs, bits, None, 2)
    assert w.data.numel() - 64 == N * K * bits // 8  # no padding (the buffer's 64 bytes of slack aside)
    assert w.goff[0, 1] == w.goff[0, 0]  # the second group starts in the first one's span
    _check_all(w, ref, g, batches=(1, 2, 8, 9, 33), rows=slice(5, 30))


def test_shared_and_padded_row_blocks_in_one_matrix():
    """Row blocks of one width (shared spans) beside a block of mixed widths (padded spans)."""
    N, K, gs, rb = 30, 128, 32, 10
    bmap = torch.tensor([[4, 4, 4, 4], [2, 2, 2, 2], [3, 8, 1, 5]])
    w, ref, g = _case(N, K, gs, bmap, rb, 3)
    assert w.goff[0, 1] == w.goff[0, 0] and w.goff[1, 1] == w.goff[1, 0] and w.goff[2, 1] > w.goff[2, 0]
    _check_all(w, ref, g, batches=(1, 3, 9, 33), rows=slice(7, 23))


@pytest.mark.parametrize("bits", range(1, 9))
def test_spans_large_groups(bits):
    """Whole spans and a partial last group (40 codes: a span's last lanes unused), every batch path."""
    w, ref, g = _case(70, 128 * 3 + 40, 128, bits, None, 1)
    _check_all(w, ref, g, batches=(1, 2, 8, 9, 33))


@pytest.mark.parametrize("shared", [False, True])
def test_mixed_common_widths_every_isa(monkeypatch, shared):
    """2/3/4/8-bit blocks side by side (the benchmark's mixes), row blocks not dividing N, several
    prefill tiles (per-thread and shared)."""
    monkeypatch.setattr(qmatmul, "_TILE_SHARED", shared)
    monkeypatch.setattr(tiles, "PREFILL_TILE_ELEMS", 8 * 600)  # 8-row tiles: 5 of them, the last partial
    gen = torch.Generator().manual_seed(5)
    bmap = torch.tensor([2, 3, 4, 8])[torch.randint(0, 4, (4, 5), generator=gen)]
    w, ref, g = _case(37, 64 * 9 + 17, 128, bmap, 10, 3)
    _check_all(w, ref, g, batches=(1, 3, 8, 17), rows=slice(5, 29))


def test_isa_can_be_forced(monkeypatch):
    avail = _available()
    if not avail:
        pytest.skip("no compiled extension here")
    assert avail[0] == "portable"
    monkeypatch.setenv(isa.ISA_ENV, "portable")
    assert isa.kernel_isa() == "portable"
    monkeypatch.setenv(isa.ISA_ENV, "auto")
    assert isa.kernel_isa() == avail[-1]
    monkeypatch.setenv(isa.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="not one of auto, portable, avx2, avx512"):
        isa.kernel_isa()
    missing = [i for i in isa.ISAS if i not in avail]
    if missing:
        monkeypatch.setenv(isa.ISA_ENV, missing[0])
        with pytest.raises(ValueError, match="this CPU runs only"):
            isa.kernel_isa()


def test_fallback_equals_reference(monkeypatch):
    w, ref, g = _case(30, 200, 64, torch.tensor([[4, 2, 3, 8]]), None, 2)
    monkeypatch.setattr(qmatmul, "extension", lambda: None)
    assert torch.equal(w.dequantize(), ref)
    _check_matmul(w, ref, g, batches=(1, 9))


def test_bad_inputs_are_one_line_errors():
    codes = torch.randint(0, 16, (4, 32), dtype=torch.int32)
    s = torch.ones(4, 1)
    with pytest.raises(ValueError, match="outside the 3-bit range"):
        LowBitWeight.from_codes(codes.clamp(min=8), 3, s, 0.0, -1)
    with pytest.raises(ValueError, match="bits must be in 1..8"):
        LowBitWeight.from_codes(codes, 9, s, 0.0, -1)
    with pytest.raises(ValueError, match=r"scales must be \[out=4, groups=2\]"):
        LowBitWeight.from_codes(codes, 4, s, 0.0, 16)
    with pytest.raises(ValueError, match="2-D integer"):
        LowBitWeight.from_codes(codes.float(), 4, s, 0.0, -1)
    w = LowBitWeight.from_codes(codes, 4, s, 0.0, -1)
    with pytest.raises(ValueError, match="x has 31 features"):
        w.matmul(torch.randn(1, 31))


def test_extension_builds_here():
    """This machine has a compiler: the compiled path must be the one under test (not the fallback)."""
    import shutil

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine: the pure-torch path runs instead")
    assert qmatmul.extension() is not None


@pytest.mark.parametrize("mode", ["inference", "no_grad", "plain"])
def test_prefill_under_inference_mode_on_several_threads(mode):
    """The prefill workers run tensor ops: they must see the caller's inference/grad mode (the
    perplexity loop runs under ``torch.inference_mode``; a worker without it may not write the output)."""
    g = torch.Generator().manual_seed(3)
    N, K = 3 * max(8, tiles.PREFILL_TILE_ELEMS // 1024) + 5, 1024  # several per-thread tiles
    codes = torch.randint(0, 16, (N, K), generator=g)
    scales, zeros = torch.rand(N, 8, generator=g) + 0.1, torch.full((N, 8), 7.0)
    ctx = {"inference": torch.inference_mode, "no_grad": torch.no_grad, "plain": contextlib.nullcontext}[mode]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with ctx():
            w = LowBitWeight.from_codes(codes, 4, scales, zeros, 128)
            x = torch.randn(40, K, generator=g)
            y = w.matmul(x)
            ref = x.double() @ w.dequantize().double().T
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-3)
