"""The bit-plane LUT matmul (kernels/lut.py + csrc/lutgemv.cpp) against the float64 reference
``x @ ((c - z) * s)ᵀ``: the pure-PyTorch g=8 / 128-entry reference LUT, the compiled GEMV on every
ISA path this CPU has (AVX-512, AVX2, portable), the tiled batch > 1 path and the no-compiler
fallback; every width 1-8 and random mixes, partial groups and blocks, odd shapes, bfloat16 input;
the drop-in API against LowBitWeight."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.formats import bitplane as bp
from bitmosaic.kernels import isa, lut, tiles
from bitmosaic.kernels.lut import BitPlaneWeight, lut_gemv_reference
from bitmosaic.kernels.qmatmul import LowBitWeight
from tests.formats.test_bitplane import random_case

ISAS = isa.available_isas(lut.extension()) if lut.extension() is not None else []


def _weight(N, K, gs, rb, bits, seed, scalar_zero=False):
    codes, bmap = random_case(N, K, gs, rb, bits, seed)
    g = torch.Generator().manual_seed(seed + 1)
    G = bmap.shape[1]
    s = torch.rand(N, G, generator=g) * 0.1 + 1e-3
    z = 3.0 if scalar_zero else torch.randint(0, 4, (N, G), generator=g).float()
    w = BitPlaneWeight.from_codes(codes, bmap, s, z, gs, rb)
    ref = bp.dequantize(codes, s, z, gs)
    # the ±1 form sums ŝ·Σ_i 2^i(±x) and ẑ·Σx: float32 rounding scales with s (2^q - 1) + |z s|
    q = bp.row_bits(w.planes)[:, torch.arange(K) // w.group_size].double()
    zz = torch.full((N, G), z) if scalar_zero else z
    sd = s.double()[:, torch.arange(K) // w.group_size]
    w.err_scale = sd * (2**q - 1) + zz.double()[:, torch.arange(K) // w.group_size].abs() * sd
    return w, ref, g


def _close(y, x, ref, err_scale, bound=1e-5):
    yr = x.double() @ ref.double().T
    scale = x.abs().double() @ err_scale.T + 1e-12
    rel = float(((y.double() - yr).abs() / scale).max()) if y.numel() else 0.0
    assert rel < bound, rel


def _check_all(w, ref, g):
    K = ref.shape[1]
    x = torch.randn(1, K, generator=g)
    _close(lut_gemv_reference(w, x[0]).unsqueeze(0), x, ref, w.err_scale)
    _close(w.matmul(x), x, ref, w.err_scale)
    for name in ISAS:
        _close(w.matmul(x, isa=name), x, ref, w.err_scale)
    for M in (2, 9, 65):  # 2-64 rows: a GEMV per row; 65: tiles
        xm = torch.randn(M, K, generator=g)
        _close(w.matmul(xm), xm, ref, w.err_scale)
    assert torch.equal(w.dequantize(), ref)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    N=st.integers(1, 40),
    K=st.integers(1, 300),
    gs=st.sampled_from([-1, 8, 32, 33, 64, 100, 128]),
    rb=st.sampled_from([None, 1, 7, 16, 20, 33]),
    bits=st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, "mix"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_every_path_matches_reference(N, K, gs, rb, bits, seed):
    w, ref, g = _weight(N, K, gs, rb, bits, seed, scalar_zero=seed % 5 == 0)
    _check_all(w, ref, g)


@pytest.mark.parametrize("q", range(1, 9))
def test_each_width_full_tiles(q):
    # SFMP-like geometry: full 16-row tiles, full 32-column chunks, several blocks
    w, ref, g = _weight(64, 384, 128, 32, q, 100 + q)
    _check_all(w, ref, g)


def test_random_mix_large_blocks():
    w, ref, g = _weight(96, 520, 128, 48, "mix", 7)  # partial last group (8 columns), 3 row blocks
    _check_all(w, ref, g)


def test_bfloat16_input():
    w, ref, g = _weight(33, 200, 64, 16, "mix", 11)
    for shape in ((200,), (1, 200), (2, 3, 200)):
        xb = torch.randn(*shape, generator=g).bfloat16()
        y = w.matmul(xb)
        assert y.dtype == torch.bfloat16 and y.shape == (*shape[:-1], 33)
        torch.testing.assert_close(y.float(), xb.float() @ ref.T, rtol=2e-2, atol=2e-2)


def test_drop_in_for_lowbitweight():
    codes, bmap = random_case(40, 130, 64, 16, "mix", 13)
    s = torch.rand(40, 3) * 0.1 + 1e-3
    z = torch.randint(0, 4, (40, 3)).float()
    a = BitPlaneWeight.from_codes(codes, bmap, s, z, 64, 16)
    b = LowBitWeight.from_codes(codes, bmap, s, z, 64, 16)
    assert torch.equal(a.dequantize(), b.dequantize())
    assert torch.equal(a.dequantize(slice(5, 23)), b.dequantize(slice(5, 23)))
    x = torch.randn(3, 130)
    torch.testing.assert_close(a.matmul(x[:1]), b.matmul(x[:1]), rtol=1e-4, atol=1e-4)
    assert a.nbytes() == sum(t.numel() * t.element_size() for t in (
        a.planes.data, a.planes.offsets, a.planes.bits, a.scales_t, a.zeros_t))  # fmt: skip
    acc = a.bits_accounting()
    assert acc["total_bits"] == 8 * a.nbytes()  # every held byte is accounted for


def test_small_prefill_tiles(monkeypatch):
    monkeypatch.setattr(tiles, "PREFILL_TILE_ELEMS", 64)  # tiles of 8 rows: many tiles, a partial last one
    w, ref, g = _weight(45, 100, 32, 20, "mix", 17)
    x = torch.randn(70, 100, generator=g)  # over 64 rows: the tiled path
    _close(w.matmul(x), x, ref, w.err_scale)


def test_pure_torch_fallback(monkeypatch):
    w, ref, g = _weight(37, 150, 64, 16, "mix", 19)
    monkeypatch.setattr(lut, "extension", lambda: None)
    assert torch.equal(w.dequantize(), ref)
    assert torch.equal(w.dequantize(slice(3, 30)), ref[3:30])
    for M in (1, 4):
        x = torch.randn(M, 150, generator=g)
        _close(w.matmul(x), x, ref, w.err_scale)


def test_compiled_paths_present():
    # this project's CI machine compiles the extension; on x86-64 the AVX2 path is expected
    if lut.extension() is None:
        pytest.skip("no C++ compiler: only the pure-torch path runs here")
    assert "portable" in ISAS


def test_bad_input():
    w, _, _ = _weight(8, 40, 16, None, 3, 23)
    with pytest.raises(ValueError, match="40 input columns"):
        w.matmul(torch.randn(1, 41))
    with pytest.raises(ValueError, match="isa must be one of"):
        w.matmul(torch.randn(1, 40), isa="neon")
    with pytest.raises(ValueError, match=r"scales must be \[out=8, groups=3\]"):
        BitPlaneWeight.from_codes(torch.zeros(8, 40, dtype=torch.int32), 3, torch.ones(8, 2), 0.0, 16)
    with pytest.raises(ValueError, match="zeros must be a number"):
        BitPlaneWeight.from_codes(
            torch.zeros(8, 40, dtype=torch.int32), 3, torch.ones(8, 3), torch.ones(8), 16
        )
    with pytest.raises(ValueError, match="outside its 3-bit range"):
        BitPlaneWeight.from_codes(torch.full((8, 40), 8, dtype=torch.int32), 3, torch.ones(8, 3), 0.0, 16)


@pytest.mark.parametrize("fallback", [False, True])
def test_empty_shapes(monkeypatch, fallback):
    if fallback:
        monkeypatch.setattr(lut, "extension", lambda: None)
    for N, K in ((0, 5), (4, 0), (0, 0)):
        G = -(-K // 2) if K else 0
        w = BitPlaneWeight.from_codes(torch.zeros(N, K, dtype=torch.int32), 3, torch.ones(N, G), 0.0, 2)
        for M in (0, 1, 3):
            y = w.matmul(torch.randn(M, K))
            assert y.shape == (M, N) and not y.any()
        assert w.dequantize().shape == (N, K)


@pytest.mark.parametrize("fallback", [False, True])
def test_fused_permutations_equal_index_select(monkeypatch, fallback):
    """``in_index``/``out_index`` (SFMP's column gather and row un-permutation, done inside the
    compiled call) give exactly ``matmul(x[:, in])[:, out]``, on every path and batch size."""
    if fallback:
        monkeypatch.setattr(lut, "extension", lambda: None)
    w, _, g = _weight(45, 100, 32, 20, "mix", 29)
    cin = torch.randperm(100, generator=g)
    cout = torch.randperm(45, generator=g)[:30]  # a subset in any order is fine too
    for M in (1, 2, 70):
        x = torch.randn(M, 100, generator=g)
        for name in ["auto"] + ([] if fallback else ISAS):
            want = w.matmul(x.index_select(1, cin), isa=name).index_select(1, cout)
            assert torch.equal(w.matmul(x, isa=name, in_index=cin, out_index=cout), want)
            got = w.matmul(x, isa=name, in_index=cin)
            assert torch.equal(got, w.matmul(x.index_select(1, cin), isa=name))
            got32 = w.matmul(x, isa=name, in_index=cin.int(), out_index=cout.int())  # int32 indices too
            assert torch.equal(got32, want)
        assert w.matmul(x.unsqueeze(0), out_index=cout).shape == (1, M, 30)
    if not fallback:
        with pytest.raises(RuntimeError, match="in_index must have K entries"):
            w.matmul(torch.randn(1, 100), in_index=cin[:50])
        with pytest.raises(RuntimeError, match="out_index out of range"):
            w.matmul(torch.randn(1, 100), out_index=torch.tensor([45]))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("N, K, rb", [(1100, 1024, 96), (200, 256, 64)])
def test_gemv_threads_and_a_short_last_row_block(threads, N, K, rb):
    """The GEMV on 1 and 2 threads, above the serial cutoff (281 KB of planes) and below it (13 KB), with
    a last row block shorter than the others (the thread split counts only tiles that hold rows)."""
    if lut.extension() is None:
        pytest.skip("no C++ compiler for the LUT extension")
    g = torch.Generator().manual_seed(N)
    G = -(-K // 64)
    bits = torch.randint(1, 4, (-(-N // rb), G), generator=g).to(torch.uint8)
    bits[:, 0] = 2
    codes = torch.randint(0, 2, (N, K), generator=g, dtype=torch.int32)
    w = BitPlaneWeight.from_codes(
        codes, bits, torch.rand(N, G, generator=g) + 0.1, torch.zeros(N, G), 64, row_block=rb
    )
    x = torch.randn(1, K, generator=g)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = w.matmul(x)
    finally:
        torch.set_num_threads(old)
    ref = x.double() @ w.dequantize().double().T
    assert float((y.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


_SPLIT_SCRIPT = """
import sys, torch
from tests.kernels.test_lut import _weight
torch.set_num_threads(2)
w, ref, g = _weight(200, 300, 64, 64, 2, 7)
x = torch.randn(3, 300, generator=g)
torch.save(w.matmul(x), sys.argv[1])
"""


@pytest.mark.skipif(not ISAS, reason="needs the compiled LUT extension")
def test_gemv_thread_split_gives_the_same_bits(tmp_path):
    """Every GEMV splits its tiles over the threads by default; ``$BITMOSAIC_LUT_SERIAL_KB`` (read once per
    process) keeps small ones on the calling thread. A tile's rows are its own, so both give the same bits."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    outs = []
    for kb in ("", "100000"):  # the default split, and everything serial
        out = tmp_path / f"y{kb or 'split'}.pt"
        env = {**os.environ, "BITMOSAIC_LUT_SERIAL_KB": kb, "PYTHONPATH": f"{root}:{root / 'src'}"}
        subprocess.run([sys.executable, "-c", _SPLIT_SCRIPT, str(out)], env=env, check=True, cwd=root)
        outs.append(torch.load(out))
    assert torch.equal(outs[0], outs[1])
