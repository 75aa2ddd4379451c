"""The compiled MSE scale search (kernels/scale_search.py, csrc/scalesearch.cpp; issue 74): the same
chosen scales and zeros, bit for bit, as the pure-torch reference ``_mse_search``."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bitmosaic.algorithms import scales
from bitmosaic.algorithms.gptq import gptq_quantize
from bitmosaic.formats.grid import IntGrid
from bitmosaic.kernels import isa, scale_search

compiled = pytest.mark.skipif(
    scale_search.extension() is None, reason="no C++ compiler: pure-torch path only"
)


@contextlib.contextmanager
def _reference_only():
    prev = scales.set_fast_mse_search(None)
    try:
        yield
    finally:
        scales.set_fast_mse_search(prev)


def _same(a, b):
    """Bit for bit (NaN scales of NaN rows included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _ref(w, grid):
    with _reference_only():
        return scales.find_scale_zero(w, grid, "mse")


def _fast(w, grid):
    """The fast path itself (asserting it applies), through find_scale_zero's own preparation."""
    xmin, xmax = w.amin(dim=1), w.amax(dim=1)
    scale, zero = scales.range_scale_zero(xmin, xmax, grid)
    got = scale_search.mse_search(w, xmin, xmax, grid, scale, zero, 100, 0.8, 2.4, scales._MSE_CHUNK_ELEMS)
    assert got is not None, "the fast path did not apply"
    return got


@compiled
@pytest.mark.parametrize("name", isa.ISAS)
def test_pow_approximation_within_its_bound_every_mantissa(monkeypatch, name):
    """|d|^2.4 approximated within APPROX_REL: every float32 mantissa at the five exponent residues
    the kernel's table distinguishes ((k + 23) mod 5), and every exponent at a spread of mantissas
    (the rest of the exponent is an exact power of two); zero and subnormals give 0."""
    ext = scale_search.extension()
    if name not in isa.available_isas(ext):
        pytest.skip(f"this CPU has no {name}")
    number = isa.ISAS.index(name)
    mant = torch.arange(1 << 23, dtype=torch.int32)
    worst = 0.0
    for k in (1, 2, 3, 4, 5):  # r = 4, 0, 1, 2, 3
        d = (mant | (k << 23)).view(torch.float32)
        worst = max(worst, float((ext.pow24(d, number) / d.double() ** 2.4 - 1).abs().max()))
    spread = mant[:: 1 << 13]
    d = (
        (spread[None, :] | (torch.arange(1, 255, dtype=torch.int32)[:, None] << 23))
        .view(torch.float32)
        .flatten()
    )
    worst = max(worst, float((ext.pow24(d, number) / d.double() ** 2.4 - 1).abs().max()))
    assert worst < scale_search.APPROX_REL
    tiny = torch.tensor([0.0, 2.0**-149, 2.0**-127, 1e-40], dtype=torch.float32)
    assert torch.equal(ext.pow24(tiny, number), torch.zeros(4, dtype=torch.float64))


def _rows(draw_kind: str, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    if draw_kind == "normal":
        return torch.randn(rows, cols, generator=gen)
    if draw_kind == "heavy":  # Cauchy-like tails: a few weights dominate each group
        u = torch.rand(rows, cols, generator=gen) * 0.98 + 0.01
        return torch.tan(torch.pi * (u - 0.5))
    if draw_kind == "repeated":  # few distinct values: exact ties between candidates
        return (torch.randint(-3, 4, (rows, cols), generator=gen) * 0.25).float()
    if draw_kind == "constant":
        return torch.full((rows, cols), 0.37) * torch.randn(rows, 1, generator=gen)
    if draw_kind == "zero":
        return torch.zeros(rows, cols)
    if draw_kind == "tiny":  # near the smallest fp16 scale 2^-24, and below
        return torch.randn(rows, cols, generator=gen) * 2.0 ** -torch.randint(
            18, 40, (rows, 1), generator=gen
        )
    if draw_kind == "bf16":  # the grid of values a bf16 checkpoint holds
        return torch.randn(rows, cols, generator=gen).bfloat16().float() * 0.02
    raise AssertionError(draw_kind)


KINDS = ("normal", "heavy", "repeated", "constant", "zero", "tiny", "bf16")


@compiled
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 40),
    cols=st.sampled_from([16, 32, 48, 64, 96, 100, 128, 256]),
    bits=st.integers(2, 8),
    sym=st.booleans(),
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3),
    special=st.sampled_from(["none", "nan", "inf", "-inf"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_same_scales_as_the_reference(rows, cols, bits, sym, kinds, special, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.cat([_rows(k, rows, cols, gen) for k in kinds])
    if special != "none":
        r = int(torch.randint(0, w.shape[0], (1,), generator=gen))
        w[r, int(torch.randint(0, cols, (1,), generator=gen))] = float(special)
    grid = IntGrid(bits, sym)
    s_ref, z_ref = _ref(w, grid)
    s, z = _fast(w, grid)
    assert _same(s, s_ref) and _same(z, z_ref)


@compiled
@pytest.mark.parametrize("cols", [128, 16, 100])
@pytest.mark.parametrize("name", isa.ISAS)
def test_each_isa_and_the_exact_tie_path(monkeypatch, name, cols):
    """Every ISA gives the reference's scales, including rows where several candidates survive the
    approximate pass (exact ties: repeated and constant values) and are decided by torch; with 16 or
    100 columns the exact blocks are padded to 32-element multiples."""
    ext = scale_search.extension()
    if name not in isa.available_isas(ext):
        pytest.skip(f"this CPU has no {name}")
    monkeypatch.setenv(isa.ISA_ENV, name)
    gen = torch.Generator().manual_seed(1)
    w = torch.cat([_rows(k, 64, cols, gen) for k in KINDS])
    grid = IntGrid(4, False)
    xmin, xmax = w.amin(dim=1), w.amax(dim=1)
    ps = torch.tensor([1 - i / 100 for i in range(80)])
    S, Z = scales.range_scale_zero(xmin[:, None] * ps, xmax[:, None] * ps, grid, check=False)
    kappa, alpha2 = scale_search.error_bound(cols)
    win, _ = ext.mse_survivors(
        w, S.contiguous(), Z.contiguous(), grid.maxq, kappa, alpha2, isa.ISAS.index(name)
    )
    assert (win == -1).any() and (win >= 0).any()  # both paths run
    for g in (grid, IntGrid(3, True), IntGrid(8, False)):
        s_ref, z_ref = _ref(w, g)
        s, z = _fast(w, g)
        assert _same(s, s_ref) and _same(z, z_ref)


@compiled
def test_fast_path_declines_where_the_reference_differs_by_position():
    """A chunk of the reference not a multiple of 32 elements (torch's pow would take its scalar tail:
    80 candidates x 3 rows x 7 columns), float64, another norm: no fast path, and find_scale_zero
    runs the reference."""
    w = torch.randn(3, 7)
    xmin, xmax = w.amin(dim=1), w.amax(dim=1)
    grid = IntGrid(4)
    s, z = scales.range_scale_zero(xmin, xmax, grid)
    assert scale_search.mse_search(w, xmin, xmax, grid, s, z, 100, 0.8, 2.4, 1 << 21) is None
    w64 = torch.randn(8, 128, dtype=torch.float64)
    a, b = w64.amin(dim=1), w64.amax(dim=1)
    s, z = scales.range_scale_zero(a, b, grid)
    assert scale_search.mse_search(w64, a, b, grid, s, z, 100, 0.8, 2.4, 1 << 21) is None
    w = torch.randn(8, 128)
    assert (
        scale_search.mse_search(w, w.amin(1), w.amax(1), grid, s.float(), z.float(), 100, 0.8, 2.0, 1 << 21)
        is None
    )
    w = torch.randn(3, 7)
    assert all(
        torch.equal(x, y) for x, y in zip(scales.find_scale_zero(w, grid, "mse"), _ref(w, grid), strict=True)
    )


@compiled
@pytest.mark.parametrize("group_size", [16, 32, 128, None])
def test_batched_groups_and_gptq_static_groups_unchanged(group_size):
    """group_scale_zero takes all groups in one fast call, and GPTQ's static groups with MSE scales
    give the same scales, zeros and codes as with the reference search."""
    gen = torch.Generator().manual_seed(3)
    W = torch.randn(48, 256, generator=gen)
    W[:, 40] = 0  # a dead input
    X = torch.randn(512, 256, generator=gen)
    H = X.T @ X
    H[40, :] = 0
    H[:, 40] = 0
    grid = IntGrid(4, False)
    got = scales.group_scale_zero(W, grid, group_size, "mse")
    res = gptq_quantize(W, H, grid, group_size, scale_method="mse", static_groups=True)
    with _reference_only():
        ref = scales.group_scale_zero(W, grid, group_size, "mse")
        res_ref = gptq_quantize(W, H, grid, group_size, scale_method="mse", static_groups=True)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert torch.equal(res.scales, res_ref.scales) and torch.equal(res.zeros, res_ref.zeros)
    assert torch.equal(res.codes, res_ref.codes)


_EDGE = [0.0, -0.0, 1e-45, -1e-45, 2.0**-24, -(2.0**-24), 1e-30, -1e-30, 3.0e-8, 65504.0, -65504.0, 65519.0,
         65520.0, 7e4, -7e4, 1e30, float("inf"), float("-inf"), float("nan")]  # fmt: skip


@compiled
@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 64),
    bits=st.integers(2, 8),
    sym=st.booleans(),
    kind=st.sampled_from(["normal", "wide", "edge"]),
    mse_grid=st.sampled_from([100, 40, 7]),
    seed=st.integers(0, 2**31 - 1),
)
def test_candidate_scales_are_the_torch_ones_bit_for_bit(rows, bits, sym, kind, mse_grid, seed):
    """The C++ candidates (kernels/scale_search.candidate_scales) are range_scale_zero's floats, every
    scale and zero (the float16 overflow to inf, NaN where torch has NaN), for ranges of every magnitude."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "edge":
        vals = torch.tensor(_EDGE)
        a = vals[torch.randint(0, len(_EDGE), (rows,), generator=gen)]
        b = vals[torch.randint(0, len(_EDGE), (rows,), generator=gen)]
    else:
        scale = 2.0 ** torch.randint(
            -140 if kind == "wide" else -12, 20 if kind == "wide" else 2, (rows,), generator=gen
        )
        a, b = torch.randn(rows, generator=gen) * scale, torch.randn(rows, generator=gen) * scale
    xmin, xmax = torch.minimum(a, b), torch.maximum(a, b)
    grid = IntGrid(bits, sym)
    ps = torch.tensor([1 - i / mse_grid for i in range(int(0.8 * mse_grid))])
    S, Z = scale_search.candidate_scales(xmin, xmax, ps, grid)
    with _reference_only():
        S_ref, Z_ref = scales.range_scale_zero(xmin[:, None] * ps, xmax[:, None] * ps, grid, check=False)
    for bitwise, got, ref in ((True, S, S_ref), (False, Z, Z_ref)):  # NaN payloads aside (those rows go
        # to the reference search)
        nan = ref.isnan()
        assert torch.equal(got.isnan(), nan)
        got, ref = torch.where(nan, 0.0, got), torch.where(nan, 0.0, ref).contiguous()
        # zeros by value: torch.minimum(-0.0, 0.0) is +0 in its vectorized loop and -0 in its scalar tail
        # (a range whose minimum underflows to -0.0 when shrunk), so the reference's own zero-point sign
        # depends on the element's position there; a zero of either sign gives the same codes
        assert _same(got, ref) if bitwise else torch.equal(got, ref)
