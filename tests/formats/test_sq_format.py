"""SQ-format (formats/sq.py): parser and validation, masks, the Fig. 1 storage with the reserved
v_mask code, exact pack/unpack round trips (hypothesis), 2:4 sparsity, bits and names."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.formats.packing import unpack_codes
from bitmosaic.formats.sq import (
    BANKS,
    INT_PAIRS,
    SPARSITIES,
    SQFormat,
    act_name,
    bank_topk_mask,
    check_mask,
    measured_bits,
    pack_sq,
    parse_sq,
    sq_quantize,
    unpack_sq,
    weight_name,
)

VALID = [(b, s) for b in BANKS for s in SPARSITIES if (1 - s) * b == int((1 - s) * b) and (1 - s) * b >= 1]
PAIRS = [(h, lo, False) for h, lo in INT_PAIRS] + [(8, 4, True), (8, 0, False), (8, 0, True)]


def test_parser_and_notation():
    f = parse_sq("16-(8/4)-0.5")
    assert (f.bank, f.h_high, f.h_low, f.sparsity, f.fp) == (16, 8, 4, 0.5, False)
    assert f.notation == "16-(8/4)-0.5" and f.n_high == 8
    g = parse_sq(" 64-(fp8/fp4)-0.875 ")
    assert g.fp and g.notation == "64-(fp8/fp4)-0.875" and g.n_high == 8
    assert parse_sq(g.notation) == g


@pytest.mark.parametrize(
    "text,msg",
    [
        ("16-8/4-0.5", "not of the form"),
        ("12-(8/4)-0.5", "bank size"),
        ("16-(8/4)-0.6", "sparsity"),
        ("4-(8/4)-0.875", "not a positive integer"),
        ("16-(8/5)-0.5", "not supported"),
        ("16-(fp8/4)-0.5", "mixes FP and INT"),
    ],
)
def test_bad_settings_give_clear_errors(text, msg):
    with pytest.raises(ValueError, match=msg):
        parse_sq(text)


def test_reduction_width_validation_and_partial_last_bank():
    f = parse_sq("16-(8/4)-0.75")
    with pytest.raises(ValueError, match="not a multiple of the SQ bank size 16"):
        f.banks(40)
    p = parse_sq("16-(8/4)-0.75", partial_last_bank=True)
    assert p.banks(40) == [(0, 16, 4), (16, 16, 4), (32, 8, 2)]
    X = torch.randn(3, 40)
    m = bank_topk_mask(X.abs(), p)
    check_mask(m, p)
    t = sq_quantize(X, m, p)
    u = unpack_sq(pack_sq(t), p, 3, 40)
    assert torch.equal(u.dequantize(), t.dequantize())


@pytest.mark.parametrize("b,s", VALID)
def test_every_bank_holds_exactly_the_high_count(b, s):
    f = SQFormat(b, 8, 4, s)
    imp = torch.randn(7, 4 * 128, generator=torch.Generator().manual_seed(b))
    imp[:, ::5] = 0.0  # ties
    m = bank_topk_mask(imp, f)
    counts = m.reshape(7, -1, b).sum(-1)
    assert bool((counts == f.n_high).all())
    # the chosen ones are the largest of their bank
    x = imp.reshape(7, -1, b)
    mm = m.reshape(7, -1, b)
    assert bool(
        (x.masked_fill(~mm, float("inf")).amin(-1) >= x.masked_fill(mm, -float("inf")).amax(-1)).all()
    )


def test_check_mask_rejects_a_wrong_count():
    f = parse_sq("8-(8/4)-0.75")
    m = bank_topk_mask(torch.randn(2, 16), f)
    m[0, 0] = ~m[0, 0]
    with pytest.raises(ValueError, match="needs exactly 2"):
        check_mask(m, f)


def test_two_four_sparsity_is_b4_s05_hlow0():
    f = parse_sq("4-(8/0)-0.5")
    W = torch.randn(6, 32)
    m = bank_topk_mask(W.abs(), f)
    t = sq_quantize(W, m, f)
    Wq = t.dequantize()
    # exactly 2 of every 4 consecutive weights survive, the 2 largest in magnitude
    nz = (Wq != 0).reshape(6, 8, 4)
    assert bool((nz.sum(-1) == 2).all())
    assert torch.equal(nz.reshape(6, 32), m)
    buf = pack_sq(t)
    assert "low" not in buf and "pos" in buf  # NVIDIA-like 2-bit positions, no low tensor
    assert torch.equal(unpack_sq(buf, f, 6, 32).dequantize(), Wq)
    # 8-bit values at half density + 2-bit positions per kept value + 2 fp16 scales per bank
    assert measured_bits(buf, 6 * 32) == pytest.approx(0.5 * 8 + 0.5 * 2 + 32 / 4)
    assert f.paper_weight_bits == 4.0


@pytest.mark.parametrize("h,lo,fp", [p for p in PAIRS if p[1]])
def test_v_mask_never_collides_with_a_real_low_code(h, lo, fp):
    f = SQFormat(16, h, lo, 0.75, fp)
    X = torch.randn(8, 64) * torch.logspace(-3, 1, 64)  # tiny values round to (signed) zero
    X[0] = -1e-6  # all negative and tiny: -0 must not appear as a low code
    m = bank_topk_mask(X.abs(), f)
    t = sq_quantize(X, m, f)
    buf = pack_sq(t)
    codes = unpack_codes(buf["low"], lo, 64)
    assert torch.equal(codes == f.v_mask, m)  # v_mask exactly at the high places
    if not fp:
        q = t.low[~m]
        assert q.abs().max() <= 2 ** (lo - 1) - 1  # low levels are +-(2^(h-1)-1)
        assert f.v_mask == 0  # stored offset code of -2^(h-1)
    else:
        assert f.v_mask == 0b1000  # -0


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    st.sampled_from(VALID),
    st.sampled_from(PAIRS),
    st.integers(1, 5),
    st.integers(1, 2),
    st.integers(0, 2**16),
    st.sampled_from(["bank", "row"]),
)
def test_pack_unpack_round_trip_exact(bs, pair, rows, nbanks, seed, group):
    b, s = bs
    h, lo, fp = pair
    f = SQFormat(b, h, lo, s, fp)
    K = b * nbanks
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(rows, K, generator=g) * torch.exp(torch.randn(K, generator=g) * 2)
    m = bank_topk_mask(torch.rand(rows, K, generator=g), f)  # any valid mask, not only by magnitude
    t = sq_quantize(X, m, f, group=b if group == "bank" else K)
    buf = pack_sq(t)
    u = unpack_sq(buf, f, rows, K, group=t.group)
    for k in ("mask", "low", "high", "low_scale", "high_scale"):
        assert torch.equal(getattr(u, k), getattr(t, k)), k
    assert torch.equal(u.dequantize(), t.dequantize())
    # high values are compact: exactly high_count codes per row
    assert buf["high"].shape[1] == -(-f.high_count(K) // 8) * h


def test_parts_are_quantized_separately_with_their_own_scales():
    f = parse_sq("16-(8/4)-0.5")
    X = torch.randn(4, 32) * 0.01
    X[:, 3] = 50.0  # an outlier: it goes high and does not inflate the low scale
    m = bank_topk_mask(X.abs(), f)
    t = sq_quantize(X, m, f)
    assert bool(m[:, 3].all())
    assert float(t.low_scale.max()) < 0.01
    lo, hi = t.parts()
    assert torch.equal(lo[m], torch.zeros(int(m.sum()))) and torch.equal(hi[~m], torch.zeros(int((~m).sum())))
    # per-bank-column symmetric INT: error at most half a step of the part's scale
    err = (t.dequantize() - X).abs()
    step = torch.where(m, t.high_scale.repeat_interleave(16, 1), t.low_scale.repeat_interleave(16, 1))
    assert bool((err <= step / 2 + 1e-7).all())


def test_bits_and_names():
    for sq, x, y, wname, aname in [
        ("32-(8/4)-0.75", 6.0, 5.0, "W(SQ6)A4", "W4A(SQ5)"),
        ("64-(8/4)-0.875", 5.0, 4.5, "W(SQ5)A4", "W4A(SQ4.5)"),
        ("64-(8/4)-0.9375", 4.5, 4.25, "W(SQ4.5)A4", "W4A(SQ4.25)"),
        ("16-(8/4)-0.5", 8.0, 6.0, "W(SQ8)A4", "W4A(SQ6)"),
    ]:
        f = parse_sq(sq)
        assert f.paper_weight_bits == x and f.paper_act_bits() == y
        assert weight_name(f, 4) == wname and act_name(4, f) == aname
    f = parse_sq("16-(8/4)-0.75")
    assert f.paper_act_bits(static=True, tokens=100) == pytest.approx(5.0 + 1 / 100)
    X = torch.randn(10, 64)
    buf = pack_sq(sq_quantize(X, bank_topk_mask(X.abs(), f), f))
    # measured: full-shape 4-bit low + compact 8-bit high + two fp16 scales per bank column
    assert measured_bits(buf, 640) == pytest.approx(4 + 0.25 * 8 + 32 / 16)
