"""Issue 73 item 4: one accounting of activation bits (``formats.sq_act.act_bits``), scales and masks
counted, checked against what the layouts actually hold: the bytes of a packed dynamic SQ split
(``pack_sq``), the scale tensors the INT activation quantizer makes (``act_scales``), and the static
split's two dense parts."""

import pytest
import torch

from bitmosaic.formats.act import ActQuantSpec, act_scales
from bitmosaic.formats.sq import bank_topk_mask, measured_bits, pack_sq, parse_sq, sq_quantize
from bitmosaic.formats.sq_act import SQActLayout, act_bits, act_scale_group, act_storage_bits

K, T = 576, 64  # SmolLM2-135M's hidden width


@pytest.mark.parametrize("sq", ["16-(8/4)-0.5", "32-(8/3)-0.75", "64-(fp8/fp4)-0.875", "4-(8/0)-0.5"])
@pytest.mark.parametrize("scale,group", [("token", None), ("bank", None), ("group", 128)])
def test_dynamic_bits_are_the_packed_layouts(sq, scale, group):
    fmt = parse_sq(sq)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(0))
    g = act_scale_group(fmt, K, scale, group)
    packed = pack_sq(sq_quantize(x, bank_topk_mask(x.abs(), fmt), fmt, group=g))
    got = act_bits(K, SQActLayout(fmt, "dynamic", scale, group), T)
    assert got.total == pytest.approx(measured_bits(packed, T * K), rel=1e-12)
    assert got.values == pytest.approx(fmt.paper_act_bits())  # the paper's y
    assert got.scales == pytest.approx(2 * 16 * packed["low_scale"].shape[-1] / K)


def test_static_bits_are_two_dense_parts_their_scales_and_a_channel_mask():
    fmt = parse_sq("16-(8/4)-0.5")
    for scale, group, per_token in (("token", None, 2), ("bank", None, 2 * K // 16), ("group", 128, 10)):
        b = act_bits(K, SQActLayout(fmt, "static", scale, group), 2048)
        assert (b.values, b.mask) == (6.0, 1 / 2048)  # K/2 INT4 + K/2 INT8 values; 1 bit/channel/linear
        assert b.scales == pytest.approx(16 * per_token / K)
        assert b.total == act_storage_bits(fmt, K, "static", 2048, scale, group)
    cal = act_bits(K, SQActLayout(fmt, "static", "bank", None, True), 2048)
    assert cal.scales == pytest.approx(16 * 2 * K // 16 / (K * 2048))  # once per linear
    assert cal.with_scales == pytest.approx(6 + cal.scales) and cal.total > cal.with_scales
    with pytest.raises(ValueError, match="static mask"):
        act_bits(K, SQActLayout(fmt, "dynamic", "bank", None, True))


@pytest.mark.parametrize(
    "spec",
    [
        ActQuantSpec("int", 8),
        ActQuantSpec("int", 4, granularity="group", group_size=128),
        ActQuantSpec("int", 6, granularity="group", group_size=64),
        ActQuantSpec("e4m3", 8, granularity="group", group_size=32, pow2=True),
    ],
)
def test_int_bits_count_the_quantizers_own_scales(spec):
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(1))
    s = act_scales(x, spec)  # what the dynamic quantizer computes: one scale per token and group
    b = act_bits(K, spec, T)
    assert b.values == spec.bits and b.mask == 0
    assert b.scales == pytest.approx((8 if spec.pow2 else 16) * s.numel() / (T * K))


def test_w4a8_and_unquantized():
    assert act_bits(K, ActQuantSpec("int", 8)).total == pytest.approx(8 + 16 / K)  # W4A8's 8.03
    static = ActQuantSpec("int", 8, granularity="tensor", static=True)
    assert act_bits(K, static, 2048).scales == 16 / (K * 2048)  # one scale per linear
    assert act_bits(K, None).total == 16.0
