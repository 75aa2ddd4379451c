"""Activation quantizers: FP grids against an independent enumeration, INT/FP fake quantization,
schemes, observers, and the input quantizer on modules (incl. save/load)."""

import itertools
import math

import pytest
import torch

from bitmosaic.algorithms.observers import ActObserver
from bitmosaic.formats.act import (
    ActQuantSpec,
    act_amax,
    act_scales,
    fake_quant,
    parse_scheme,
    scale_from_amax,
)
from bitmosaic.formats.fp import FP_FORMATS, fp_round
from bitmosaic.modules.actquant import attach_input_quant


def enumerate_grid(exp_bits, man_bits, bias, reserve_top_exponent, nan_all_ones=False, max_abs=None):
    """All finite non-negative values of a sign/exponent/mantissa format, decoded bit by bit."""
    vals = set()
    for e, m in itertools.product(range(2**exp_bits), range(2**man_bits)):
        if reserve_top_exponent and e == 2**exp_bits - 1:
            continue  # IEEE: inf / NaN
        if nan_all_ones and e == 2**exp_bits - 1 and m == 2**man_bits - 1:
            continue  # OCP E4M3: only S.1111.111 is NaN
        if e == 0:
            v = (m / 2**man_bits) * 2.0 ** (1 - bias)
        else:
            v = (1 + m / 2**man_bits) * 2.0 ** (e - bias)
        if max_abs is None or v <= max_abs:
            vals.add(v)
    pos = sorted(vals)
    return torch.tensor(sorted({-v for v in pos} | set(pos)), dtype=torch.float64)


GRIDS = {
    "e4m3": enumerate_grid(4, 3, 7, reserve_top_exponent=False, nan_all_ones=True),
    "e4m3-240": enumerate_grid(4, 3, 7, reserve_top_exponent=True),
    "e5m2": enumerate_grid(5, 2, 15, reserve_top_exponent=True),
    "e2m1": enumerate_grid(2, 1, 1, reserve_top_exponent=False),
}


def test_enumerations_have_the_known_extremes():
    assert GRIDS["e4m3"].max() == 448 and GRIDS["e4m3-240"].max() == 240
    assert GRIDS["e5m2"].max() == 57344 and GRIDS["e2m1"].max() == 6
    assert sorted(GRIDS["e2m1"][GRIDS["e2m1"] >= 0].tolist()) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert GRIDS["e4m3"][GRIDS["e4m3"] > 0].min() == 2.0**-9
    assert len(GRIDS["e4m3"]) == 253  # 256 patterns - 2 NaN - one duplicate zero


@pytest.mark.parametrize("fmt", list(FP_FORMATS))
def test_fp_round_is_nearest_grid_value(fmt):
    grid = GRIDS[fmt]
    assert FP_FORMATS[fmt].max_value == float(grid.max())
    # every grid value is a fixed point
    assert torch.equal(fp_round(grid, fmt), grid)
    # random values (log-uniform magnitudes across the whole range, plus out-of-range) round to a nearest one
    g = torch.Generator().manual_seed(0)
    mags = torch.exp2(
        torch.empty(20000, dtype=torch.float64).uniform_(-14, math.log2(grid.max()) + 1, generator=g)
    )
    x = mags * torch.where(torch.rand(20000, generator=g) < 0.5, -1.0, 1.0).double()
    r = fp_round(x, fmt)
    assert torch.isin(r, grid).all()
    xc = x.clamp(grid.min(), grid.max())
    best = (grid[None, :] - xc[:, None]).abs().min(dim=1).values
    assert torch.equal((r - xc).abs(), best)


@pytest.mark.parametrize("fmt", list(FP_FORMATS))
def test_fp_round_ties_to_even_mantissa(fmt):
    grid = GRIDS[fmt]
    pos = grid[grid >= 0]
    mids = (pos[1:] + pos[:-1]) / 2
    r = fp_round(mids, fmt)
    lo, hi = pos[:-1], pos[1:]
    assert ((r == lo) | (r == hi)).all()
    f = FP_FORMATS[fmt]
    # the chosen neighbour has an even last mantissa bit: its index among non-negative values is even
    idx = torch.searchsorted(pos, r)
    assert (idx % 2 == 0).all(), f.name


def test_fp_round_saturates_instead_of_nan():
    x = torch.tensor([1e6, -1e6, float("inf")])
    assert fp_round(x, "e4m3").tolist() == [448, -448, 448]
    assert fp_round(x, "e4m3-240").tolist() == [240, -240, 240]
    assert fp_round(x, "e2m1").tolist() == [6, -6, 6]


def test_int_token_fake_quant_is_on_grid_and_keeps_the_max():
    x = torch.randn(16, 40, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 10, 40)
    spec = ActQuantSpec("int", 8)
    y = fake_quant(x, spec)
    s = x.abs().amax(dim=1, keepdim=True) / 127
    q = y / s
    assert torch.allclose(q, q.round(), atol=1e-4) and q.abs().max() <= 127 + 1e-4
    assert torch.allclose(y.abs().amax(dim=1), x.abs().amax(dim=1))
    assert ((y - x).abs() <= s / 2 + 1e-6).all()
    y4 = fake_quant(x, ActQuantSpec("int", 4))
    assert ((y4 - x).abs() <= x.abs().amax(dim=1, keepdim=True) / 7 / 2 + 1e-6).all()
    assert (y4 - x).abs().mean() > (y - x).abs().mean() * 8


def test_group_and_static_granularities():
    x = torch.randn(8, 20, generator=torch.Generator().manual_seed(1))
    x[:, 3] *= 50  # an outlier channel in group 0 only
    spec = ActQuantSpec("int", 4, granularity="group", group_size=8)
    assert act_amax(x, spec).shape == (8, 3)  # partial last group
    yg = fake_quant(x, spec)
    yt = fake_quant(x, ActQuantSpec("int", 4))
    assert (yg - x)[:, 8:].abs().sum() < 0.5 * (yt - x)[:, 8:].abs().sum()
    st = ActQuantSpec("int", 8, granularity="tensor", static=True)
    scale = torch.tensor([0.01])
    y = fake_quant(x, st, scale)
    assert y.abs().max() <= 128 * 0.01 + 1e-6  # clamped to [-128, 127] codes
    with pytest.raises(ValueError, match="no calibrated scale"):
        fake_quant(x, st)


def test_clip_ratio_saturates_the_largest_values():
    """QuaRot's activation clip: scale = ratio x amax / qmax, so values beyond ratio x amax saturate."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    full, clip = ActQuantSpec("int", 4), ActQuantSpec("int", 4, clip_ratio=0.8)
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.allclose(act_scales(x, clip), 0.8 * act_scales(x, full))
    y, top = fake_quant(x, clip), (0.8 * amax).expand_as(x)
    hi = x >= top
    assert hi.any() and torch.allclose(y[hi], top[hi])  # beyond the clip: saturated at code qmax = 7
    assert (y <= top + 1e-6).all()
    assert clip.label == "int4/token/dynamic/clip0.8" and full.label == "int4/token/dynamic"
    assert ActQuantSpec.from_dict({k: v for k, v in clip.to_dict().items() if k != "clip_ratio"}) == full
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="clip ratio must be in"):
            ActQuantSpec("int", 4, clip_ratio=bad)


def test_pow2_scales_round_up():
    amax = torch.tensor([0.3, 1.0, 500.0])
    spec = ActQuantSpec("e4m3", 8, granularity="tensor", pow2=True)
    s = scale_from_amax(amax, spec)
    assert torch.equal(s, torch.exp2(torch.round(torch.log2(s))))
    assert (s >= amax / 448).all() and (s < 2 * amax / 448).all()


def test_fp8_static_error_is_within_half_an_e4m3_step():
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(2)) * 3
    spec = ActQuantSpec("e4m3", 8, granularity="tensor", static=True)
    obs = ActObserver(96, spec)
    obs.add(x)
    s = obs.static_scale()
    y = fake_quant(x, spec, s)
    a = (x / s).abs()
    err = (y - x).abs() / s
    normal = a >= 2.0**-6
    assert (err[normal] <= a[normal] * 2.0**-4 * (1 + 1e-6)).all()  # half ulp, 3 mantissa bits
    assert (err[~normal] <= 2.0**-10 + 1e-9).all()  # half the subnormal step 2^-9


def test_fp8_products_are_exact_in_float32():
    """FP8xFP8 with float32 accumulation == what the float32 matmul of dequantized values does."""
    g = torch.Generator().manual_seed(3)
    a = fp_round(torch.randn(5000, generator=g) * 30, "e4m3")
    b = fp_round(torch.randn(5000, generator=g) * 30, "e4m3")
    assert torch.equal((a * b).double(), a.double() * b.double())


@pytest.mark.parametrize(
    "scheme,wbits,fmt,bits,static",
    [
        ("W4A16", 4, None, None, None),
        ("W8A8", 8, "int", 8, False),
        ("w4a4", 4, "int", 4, False),
        ("W4A8-FP8", 4, "e4m3", 8, True),
        ("W4A8-E5M2", 4, "e5m2", 8, True),
        ("W4A4-FP4", 4, "e2m1", 4, True),
    ],
)
def test_parse_scheme(scheme, wbits, fmt, bits, static):
    wb, spec = parse_scheme(scheme)
    assert wb == wbits
    if fmt is None:
        assert spec is None
    else:
        assert (spec.fmt, spec.bits, spec.static) == (fmt, bits, static)


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        ({"fmt": "e4m3", "bits": 4}, "8-bit format"),
        ({"fmt": "int8"}, "unknown activation format"),
        ({"granularity": "token", "static": True}, "dynamic by nature"),
        ({"granularity": "row"}, "granularity"),
        ({"bits": 1}, "2..8"),
    ],
)
def test_bad_specs_are_clear_errors(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        ActQuantSpec(**kwargs)
    with pytest.raises(ValueError, match="form W"):
        parse_scheme("INT8")


def test_observer_statistics():
    x = torch.tensor([[1.0, -2.0, 0.0], [-3.0, 1.0, 4.0]])
    obs = ActObserver(3, ActQuantSpec("int", 8, granularity="group", group_size=2, static=True))
    obs.add(x[:1])
    obs.add(x[1:])
    assert obs.channel_absmax.tolist() == [3, 2, 4]
    assert obs.channel_absmean.tolist() == [2, 1.5, 2]
    assert obs.channel_mean.tolist() == [-1, -0.5, 2]
    assert obs.static_amax().tolist() == [3, 4]
    pct = ActObserver(
        3, ActQuantSpec("int", 8, granularity="tensor", static=True, calib="percentile", percentile=50)
    )
    pct.add(x)
    assert pct.static_amax().tolist() == [1.0]  # median of |x| = {0,1,1,2,3,4} (nearest rank 3)


def test_input_quant_on_a_linear_changes_its_input_only():
    lin = torch.nn.Linear(16, 4)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(4))
    ref = lin(fake_quant(x, ActQuantSpec("int", 4)))
    attach_input_quant(lin, ActQuantSpec("int", 4), 16)
    assert torch.equal(lin(x), ref)
    assert "input_quant.scale" not in lin.state_dict()  # dynamic: nothing to save
    lin2 = torch.nn.Linear(16, 4)
    attach_input_quant(
        lin2, ActQuantSpec("e4m3", 8, granularity="tensor", static=True), 16, torch.tensor([0.5])
    )
    assert lin2.state_dict()["input_quant.scale"].tolist() == [0.5]
    with pytest.raises(RuntimeError, match="already"):
        attach_input_quant(lin2, ActQuantSpec("int", 8), 16)


@pytest.mark.parametrize(
    "scheme", ["W4A16", "W8A8", "W4A4", "W4A8-FP8", "W4A8-FP8-240", "W4A8-E5M2", "W4A4-FP4"]
)
def test_scheme_names_round_trip(scheme):
    from bitmosaic.methods import WeightQuantConfig

    bits, act = parse_scheme(scheme)
    assert WeightQuantConfig(bits=bits, act=act).scheme == scheme


def test_float64_inputs_round_once():
    """Just above a midpoint: a float32 detour would make it an exact tie and round to even (1.0)."""
    x = torch.tensor([1.0625 + 2.0**-30, -(1.0625 + 2.0**-30)], dtype=torch.float64)
    assert fp_round(x, "e4m3").tolist() == [1.125, -1.125]
    assert fp_round(x.float(), "e4m3").tolist() == [1.0, -1.0]  # float32 input: it *is* a tie
