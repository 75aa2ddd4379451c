"""The integer-activation matmul (kernels/intmm.py): the layout holds the codes exactly; the activations
are quantized to the simulated path's integers (formats/act.py fake_quant); the output equals the float64
product of those integers with the weight's, up to float32 rounding -- for widths 1-8, group sizes with
partial groups, per-token / per-tensor / per-group scales, INT8 and INT4 activations, decode and prefill
rows, on every instruction set this CPU runs and on the ``torch._int_mm`` route."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.formats.act import INT16_SPLIT_QMAX, ActQuantSpec, act_scales, fake_quant
from bitmosaic.kernels import intmm, isa
from bitmosaic.kernels.intmm import IntActWeight
from tests.helpers import env_var


def _isa(name):
    return env_var(isa.ISA_ENV, name)


def _routes() -> list[str]:
    """``int_mm`` always; ``kernel:<isa>`` for every ISA this CPU runs the compiled kernel on."""
    ext = intmm.extension()
    return ["int_mm"] + ([f"kernel:{i}" for i in isa.available_isas(ext)] if ext is not None else [])


def _weight(N, K, gs, bits, seed, asym=True):
    g = torch.Generator().manual_seed(seed)
    gsz = K if gs < 0 or gs >= K else gs
    G = -(-K // gsz)
    codes = torch.randint(0, 1 << bits, (N, K), generator=g, dtype=torch.int32)
    s = torch.rand(N, G, generator=g) * 0.1 + 1e-3
    if asym:
        z = torch.randint(0, 1 << bits, (N, G), generator=g).float() + 0.25 * (seed % 2)  # fractional too
    else:
        z = float(1 << (bits - 1))
    return codes, s, z, gsz, G, g


def _spec(gran, abits, static, agroup):
    return ActQuantSpec("int", abits, granularity=gran, group_size=agroup, static=static)


def _scale_table(x2, spec, scale):
    s = act_scales(x2, spec, scale)
    if spec.granularity == "tensor" or spec.static:
        return s.reshape(1, -1)
    return s.reshape(x2.shape[0], -1)


def _run(w, x2, spec, scale, route):
    sa = _scale_table(x2, spec, scale)
    group = spec.group_size if spec.granularity == "group" else w.K
    if route == "int_mm":
        return w.matmul(x2, sa, group, spec.qmax, route="int_mm")
    with _isa(route.split(":")[1]):
        return w.matmul(x2, sa, group, spec.qmax)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.integers(1, 8),
    N=st.integers(1, 40),
    K=st.integers(1, 150),
    gs=st.sampled_from([-1, 8, 16, 24, 64]),
    seed=st.integers(0, 2**16),
)
def test_layout_holds_the_codes(bits, N, K, gs, seed):
    codes, s, z, gsz, G, _ = _weight(N, K, gs, bits, seed)
    if G > 1 and gsz % 8:
        return
    w = IntActWeight.from_codes(codes, bits, s, z, gs)
    assert torch.equal(w.codes(), codes)
    assert torch.equal(w.scales(), s) and torch.equal(w.zeros(), z)


@pytest.mark.parametrize("route", _routes())
@settings(max_examples=30, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 8, 1, 5, 6, 7]),
    M=st.sampled_from([1, 2, 3, 5, 8, 9, 17]),
    N=st.integers(1, 40),
    K=st.integers(1, 200),
    gs=st.sampled_from([-1, 8, 32, 64]),
    gran=st.sampled_from(["token", "tensor", "group", "tensor-static", "group-static"]),
    abits=st.sampled_from([8, 4, 16]),
    asym=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_int_path_equals_the_integer_product(route, bits, M, N, K, gs, gran, abits, asym, seed):
    codes, s, z, gsz, G, g = _weight(N, K, gs, bits, seed, asym)
    if G > 1 and gsz % 8:
        return
    static = gran.endswith("-static")
    gran = gran.split("-")[0]
    agroup = gsz * 2 if G > 1 else K  # activation groups hold whole weight groups
    if gran == "group" and G == 1:
        gran = "token" if not static else "tensor"
    spec = _spec(gran, abits, static, agroup)
    x = torch.randn(M, K, generator=g) * torch.rand(K, generator=g) * 3
    scale = None
    if static:  # a calibrated scale a bit below the max: some values clamp, -qmax - 1 is reached
        scale = act_scales(x, ActQuantSpec("int", abits, granularity=gran, group_size=agroup)) * 0.8
        scale = scale.amax(0).reshape(-1) if gran == "group" else scale.reshape(1)
    w = IntActWeight.from_codes(codes, bits, s, z, gs)
    y = _run(w, x, spec, scale, route)
    # the integers: the kernel's quantized activations are fake_quant's
    sa = _scale_table(x, spec, scale)
    q, qsum, sq = w.quantize(x, sa, spec.group_size if gran == "group" else K, spec.qmax)
    xq = fake_quant(x, spec, scale).double()
    s_full = sa.repeat_interleave(spec.group_size if gran == "group" else K, dim=1)[:, :K].double()
    if abits == 16:  # two int8 rows per token: q = 256 h + l, scales 256 s and s
        assert q.shape[0] == 2 * M and torch.equal(sq, torch.cat([sa.expand(M, -1) * 256, sa.expand(M, -1)]))
        q = 256 * q[:M].long() + q[M:].long()
    assert torch.equal(q[:, :K].double(), torch.round(xq / s_full))
    assert torch.all(q[:, K:] == 0)
    # the output: the float64 product of those integers with (c - z) s, within float32 rounding
    zz = z if torch.is_tensor(z) else torch.full((N, G), z)
    gi = torch.arange(K) // gsz
    wd = (codes.double() - zz.double()[:, gi]) * s.double()[:, gi]
    ref = xq @ wd.T
    # float32 rounding: the epilogue's few roundings per group plus one per added group
    bound = xq.abs() @ ((codes.double() + zz.double()[:, gi].abs()) * s.double()[:, gi]).T
    err = bound * (G + 8) * 2.0**-24 + 1e-30
    assert torch.all((y.double() - ref).abs() <= err), (y.double() - ref).abs().max()
    assert y.dtype == torch.float32 and y.shape == (M, N)


def test_static_scale_reaches_the_negative_end():
    """q = -qmax - 1 (static scale, clamped) is held exactly: 8-bit codes on every route, 8- and 16-bit
    activations."""
    w = IntActWeight.from_codes(torch.full((3, 16), 255, dtype=torch.int32), 8, torch.ones(3, 1), 0.0, -1)
    x = torch.full((2, 16), -1000.0)
    for route in _routes():
        y = _run(w, x, _spec("tensor", 8, True, 16), torch.ones(1), route)
        assert torch.equal(y, torch.full((2, 3), -128.0 * 255 * 16)), route
        y = _run(w, x * 100, _spec("tensor", 16, True, 16), torch.ones(1), route)  # h = -127, l = -128
        assert torch.equal(y, torch.full((2, 3), -(INT16_SPLIT_QMAX + 1) * 255 * 16)), route


def test_refuses_bad_layouts():
    c = torch.zeros(4, 40, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of 8"):
        IntActWeight.from_codes(c, 4, torch.ones(4, 4), 0.0, 12)
    with pytest.raises(ValueError, match="outside 2 bits"):
        IntActWeight.from_codes(c + 4, 2, torch.ones(4, 1), 0.0, -1)
    w = IntActWeight.from_codes(c, 4, torch.ones(4, 5), 0.0, 8)
    with pytest.raises(ValueError, match="whole weight groups"):
        w.matmul(torch.zeros(2, 40), torch.ones(2, 3), 12, 127.0)


@pytest.mark.parametrize("route", _routes())
def test_kernel_per_token_scales_are_act_scales(route):
    """Without scales the kernel computes the per-token ones itself: bitwise act_scales' (the
    simulated path's), so the integers and the outputs are those of the given scales."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (20, 72), generator=g)
    w = IntActWeight.from_codes(codes, 4, torch.rand(20, 3) + 0.1, 8.0, 32)
    x = torch.randn(9, 72, generator=g) * torch.rand(9, 1, generator=g) * 10
    x[4] = 0.0  # an all-zero token: the 1e-12 floor
    for abits in (8, 4):
        spec = ActQuantSpec("int", abits)
        given = act_scales(x, spec)
        with _isa(route.split(":")[-1] if route != "int_mm" else "auto"):
            q1, s1, own = w.quantize(x, None, 72, spec.qmax)
            q2, s2, _ = w.quantize(x, given, 72, spec.qmax)
            assert torch.equal(own, given) and torch.equal(q1, q2) and torch.equal(s1, s2)
            r = "int_mm" if route == "int_mm" else "kernel"
            y1, y2 = (w.matmul(x, s, 72, spec.qmax, route=r) for s in (None, given))
            assert torch.equal(y1, y2)


@pytest.mark.parametrize("K", [1, 7, 8, 31, 64, 65, 130, 576, 1536])
@pytest.mark.parametrize("gs", [-1, 8, 64, 128])
def test_quantize_is_the_same_on_every_isa(K, gs):
    """The SIMD absmax (dynamic per-token scales) and group sums (vpdpbusd of ones; AVX2's maddubs) give
    the portable kernel's ``(q, qsum, scales)`` bit for bit, tails and groups past ``K`` included; the
    group sums are ``q``'s own and a NaN-free zero row gets the 1e-12 floor."""
    ext = intmm.extension()
    if ext is None:
        pytest.skip("the compiled intmm extension is not built here (the torch route has no ISAs)")
    g = torch.Generator().manual_seed(K * 7 + gs)
    N = 24
    G = 1 if gs < 0 or gs >= K else -(-K // gs)
    gsz = K if G == 1 else gs
    w = IntActWeight.from_codes(torch.randint(0, 16, (N, K), generator=g), 4, torch.rand(N, G) + 0.1, 8.0, gs)
    x = torch.randn(37, K, generator=g) * torch.rand(37, K, generator=g) * 10
    x[5] = 0.0
    x[6, -1] = -1e4  # the maximum in the tail
    out = {}
    for name in isa.available_isas(ext):
        with _isa(name):
            for agroup in (K, 8):
                for qmax in (127.0, INT16_SPLIT_QMAX):  # 16 bits: the two int8 halves' rows
                    out[name, agroup, qmax] = w.quantize(x, None, agroup, qmax)
    for (name, agroup, qmax), (q, qsum, sa) in out.items():
        q0, qsum0, sa0 = out["portable", agroup, qmax]
        assert torch.equal(q, q0) and torch.equal(qsum, qsum0) and torch.equal(sa, sa0), (name, agroup, qmax)
        rows = q.shape[0]
        ref = torch.nn.functional.pad(q[:, :K].int(), (0, G * gsz - K)).reshape(rows, G, gsz).sum(-1)
        assert torch.equal(qsum, ref.int()), (name, agroup, qmax)
    q, _, _ = out["portable", K, INT16_SPLIT_QMAX]
    q16 = 256 * q[:37, :K].long() + q[37:, :K].long()
    s16 = act_scales(x, ActQuantSpec("int", 16)).reshape(-1, 1)
    assert torch.equal(q16, torch.round(x / s16).long()) and int(q16.abs().max()) == INT16_SPLIT_QMAX
    out = {k[:2]: v for k, v in out.items() if k[2] == 127.0}
    assert torch.equal(out["portable", K][2][5], torch.full((1,), 1e-12))
    assert torch.equal(out["portable", K][2].reshape(-1), act_scales(x, ActQuantSpec("int", 8)).reshape(-1))


@pytest.mark.parametrize("seed", range(4))
def test_quantize_at_half_integers_is_the_divisions(seed):
    """The AVX-512 quantizer multiplies by 1/s and divides only near a half-integer (csrc/intmm.cpp): on
    values a few ulps either side of (k + 1/2) s, and exactly on them, every ISA gives the integers of
    the float32 division x / s rounded half to even -- the simulated path's (per token and per group;
    static scales too, tiny and huge ones included)."""
    ext = intmm.extension()
    if ext is None:
        pytest.skip("the compiled intmm extension is not built here (the torch route has no ISAs)")
    g = torch.Generator().manual_seed(seed)
    M, K = 24, 200
    amax = torch.rand(M, 1, generator=g) * 10 + 0.01
    s = (amax / 127.0).float()  # the per-token scale the kernel computes (max(amax / qmax, 1e-12))
    k = torch.randint(-127, 127, (M, K), generator=g).float()
    x = ((k + 0.5) * s).float()
    steps = torch.randint(-4, 5, (M, K), generator=g)
    for _ in range(4):  # walk each value up to 4 ulps away from its half-integer
        up, down = steps > 0, steps < 0
        x = torch.where(up, torch.nextafter(x, torch.full_like(x, float("inf"))), x)
        x = torch.where(down, torch.nextafter(x, torch.full_like(x, float("-inf"))), x)
        steps = steps - up.long() + down.long()
    x[:, 0] = amax[:, 0]  # the row maximum sets the scale
    w = IntActWeight.from_codes(torch.randint(0, 16, (8, K), generator=g), 4, torch.rand(8, 1) + 0.1, 8.0, -1)
    for name in isa.available_isas(ext):
        with _isa(name):
            q, _, sa = w.quantize(x, None, K, 127.0)
            assert torch.equal(sa, s), name
            ref = torch.round(x / sa).clamp(-128, 127)
            assert torch.equal(q[:, :K].float(), ref), (name, int((q[:, :K].float() != ref).sum()))
            for static in (s[:1], torch.tensor([[1e-20]]), torch.tensor([[3e30]]), torch.tensor([[7.0]])):
                q2, _, _ = w.quantize(x, static, K, 127.0)
                ref2 = torch.round(x / static).clamp(-128, 127)
                assert torch.equal(q2[:, :K].float(), ref2), (name, float(static))


@pytest.mark.parametrize("route", _routes())
@pytest.mark.parametrize("agroup", [8, 24, 32])
def test_kernel_per_group_scales_are_act_scales(route, agroup):
    """Dynamic per-group scales (llama.cpp's Q8_0 blocks, W4A4 per group) computed by the kernel itself:
    bitwise act_scales', a partial last group included (72 columns), so the same integers and outputs."""
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (20, 72), generator=g)
    w = IntActWeight.from_codes(codes, 4, torch.rand(20, 9) + 0.1, 8.0, 8)
    x = torch.randn(7, 72, generator=g) * torch.rand(7, 72, generator=g) * 10
    x[2] = 0.0
    spec = ActQuantSpec("int", 8, granularity="group", group_size=agroup)
    given = act_scales(x, spec)
    assert given.shape == (7, -(-72 // agroup))
    with _isa(route.split(":")[-1] if route != "int_mm" else "auto"):
        q1, s1, own = w.quantize(x, None, agroup, spec.qmax)
        q2, s2, _ = w.quantize(x, given, agroup, spec.qmax)
        assert torch.equal(own, given) and torch.equal(q1, q2) and torch.equal(s1, s2)
        r = "int_mm" if route == "int_mm" else "kernel"
        y1, y2 = (w.matmul(x, s, agroup, spec.qmax, route=r) for s in (None, given))
        assert torch.equal(y1, y2)


@pytest.mark.parametrize("route", _routes())
@settings(max_examples=30, deadline=None)
@given(
    bits=st.sampled_from([4, 8, 2, 3, 5]),
    M=st.sampled_from([1, 2, 5, 8, 9, 17]),
    N=st.integers(1, 40),
    K=st.integers(1, 200),
    gs_run=st.sampled_from([(-1, 8), (-1, 24), (16, 8), (32, 8), (32, 16), (64, 16), (64, 64)]),
    per_token=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_runs_mode_equals_the_integer_product(route, bits, M, N, K, gs_run, per_token, seed):
    """Runs mode (activation scales that change every ``run`` columns inside a weight group, the
    SQ-format's parts): the output equals the float64 product of the integers with ``(c - z) s_w`` and
    each run's own scale, up to float32 rounding -- partial last groups and runs, one group or many."""
    gs, run = gs_run
    codes, s, z, gsz, G, g = _weight(N, K, gs, bits, seed)
    if G > 1 and gsz % 8:
        return
    w = IntActWeight.from_codes(codes, bits, s, z, gs)
    sub = w.runs_per_group(run)
    q = torch.randint(-128, 128, (M, w.KP), generator=g, dtype=torch.int8)
    q[:, K:] = 0
    sa = torch.rand(M if per_token else 1, G * sub, generator=g) * 0.05 + 1e-3
    r = "int_mm" if route == "int_mm" else "kernel"
    with _isa(route.split(":")[-1] if route != "int_mm" else "auto"):
        y = w.product_runs(q, w.run_sums(q, sa, run), sa, run, route=r)
    gw = w.KP if G == 1 else gsz
    col = torch.arange(K)
    s_col = sa.double()[:, (col // gw) * sub + (col % gw) // run]  # each column's activation scale
    zz = z if torch.is_tensor(z) else torch.full((N, G), z)
    gi = col // gsz
    wd = (codes.double() - zz.double()[:, gi]) * s.double()[:, gi]
    xq = q[:, :K].double() * s_col
    ref = xq @ wd.T
    bound = xq.abs() @ ((codes.double() + zz.double()[:, gi].abs()) * s.double()[:, gi]).T
    err = bound * (G * sub + 8) * 2.0**-24 + 1e-30
    assert torch.all((y.double() - ref).abs() <= err), (y.double() - ref).abs().max()
    assert y.shape == (M, N)
    with pytest.raises(ValueError, match="multiple of 8"):
        w.runs_per_group(12)


@pytest.mark.skipif(not intmm.amx(), reason="this CPU (or OS) does not run AMX-INT8 tiles")
@pytest.mark.parametrize(
    ("M", "N", "K", "gs", "bits", "gran"),
    [
        (16, 32, 64, 64, 4, "token"),  # one tile
        (37, 40, 576, 128, 4, "token"),  # rows past the last full 16, a partial row block, a 64-column group
        (512, 48, 576, 128, 4, "group"),  # SmolLM2's K, activation groups of two weight groups
        (100, 33, 1536, 64, 8, "tensor"),  # bytes layout, 8-bit codes (u8 x s8 products up to 255 x 128)
        (33, 17, 1536, -1, 4, "token"),  # one group per row
        (64, 48, 192, 64, 5, "tensor-static"),  # 5-bit bytes layout, a calibrated scale
        (20, 16, 576, 32, 4, "token"),  # groups of 32: not AMX (the VNNI body on both sides)
    ],
)
def test_amx_prefill_equals_the_vnni_body_bit_for_bit(M, N, K, gs, bits, gran):
    """The AMX body's int32 tiles are exact and its epilogue is the VNNI body's operation for operation,
    so the outputs are equal bit for bit -- and both are the integer product (the test above)."""
    codes, s, z, gsz, G, g = _weight(N, K, gs, bits, seed=M + N + K)
    static = gran.endswith("-static")
    gran = gran.split("-")[0]
    spec = _spec(gran, 8, static, 2 * gsz if G > 1 else K)
    x = torch.randn(M, K, generator=g) * torch.rand(K, generator=g) * 3
    scale = None
    if static:
        scale = act_scales(x, ActQuantSpec("int", 8, granularity=gran)).reshape(1) * 0.8
    w = IntActWeight.from_codes(codes, bits, s, z, gs)
    ext = intmm.extension()
    n0 = ext.amx_call_count()
    with env_var(intmm.AMX_ENV, "1"):
        y_amx = _run(w, x, spec, scale, "kernel:avx512")
    n1 = ext.amx_call_count()
    with env_var(intmm.AMX_ENV, "0"):
        y_vnni = _run(w, x, spec, scale, "kernel:avx512")
    assert ext.amx_call_count() == n1  # opted out: the VNNI body
    assert n1 - n0 == (0 if gs == 32 else 1)  # groups of whole 64-column steps run on AMX, 32 does not
    assert torch.equal(y_amx, y_vnni)
    # and the reference a float64 product: not all equal by accident (e.g. both zero)
    assert y_amx.abs().amax() > 0
