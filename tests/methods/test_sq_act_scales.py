"""SQ-format activation scales (issue 25): per token, per token and bank, per token and G channels
(G independent of the bank), and calibrated static bank/group scales -- checked against an
independent loop reference (hypothesis), through the module's split matmuls, the method, the
saved-model round trip, ``inspect``, the bits accounting and the option errors; and group-wise
A4 activations with SQ-format weights (W(SQ)A4)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic import quantize_
from bitmosaic.algorithms.sq import dynamic_split, static_act_scales, static_channel_mask, static_split
from bitmosaic.cli import main
from bitmosaic.formats.act import ActQuantSpec, fake_quant
from bitmosaic.formats.sq import parse_sq
from bitmosaic.formats.sq_act import act_scale_bits, act_storage_bits
from bitmosaic.io import load_quantized, save_quantized
from bitmosaic.methods import get_method
from bitmosaic.modules.sq import SQActLinear, SQWeightLinear
from tests.helpers import assert_reload_same_logits
from tests.methods.test_sq_methods import _packed_w4
from tests.methods.test_waq_pipeline import tiny


def _fp16(a: float, qmax: float) -> float:
    return float(torch.tensor(max(a / qmax, 2.0**-24)).clamp(max=65504.0).half().float())


def _reference(x, mask, fmt, width, scales=None):
    """Element by element: the scale of x[t, c] is the largest |x| of the same token, the same part
    (high or low) and the same scale group ``c // width``, over the part's grid maximum (fp16); or
    the calibrated ``scales[part][c // width]``."""
    T, K = x.shape
    out = torch.zeros(T, K)
    for t in range(T):
        for c in range(K):
            hi = bool(mask[t, c])
            qmax = fmt.qmax_high if hi else fmt.qmax_low
            g = c // width
            if scales is None:
                same = [j for j in range(g * width, min(K, (g + 1) * width)) if bool(mask[t, j]) == hi]
                s = _fp16(max(abs(float(x[t, j])) for j in same), qmax)
            else:
                s = float(scales[int(hi)][g])
            q = torch.round(x[t, c].float() / torch.tensor(s)).clamp(-qmax, qmax)  # float32, as the kernel
            out[t, c] = q * s
    return out


@settings(max_examples=25, deadline=None)
@given(
    sq=st.sampled_from(["4-(8/4)-0.5", "8-(8/4)-0.75", "16-(8/3)-0.5", "8-(4/2)-0.5"]),
    nbanks=st.integers(1, 4),
    scale=st.sampled_from(["token", "bank", "group"]),
    group=st.integers(1, 40),
    static=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_splits_match_the_loop_reference(sq, nbanks, scale, group, static, seed):
    fmt = parse_sq(sq)
    K = fmt.bank * nbanks
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, K, generator=gen) * torch.rand(K, generator=gen).mul(4).exp()
    width = {"token": K, "bank": fmt.bank, "group": min(group, K)}[scale]
    if static:
        cmask = static_channel_mask(torch.rand(K, generator=gen), fmt)
        t = static_split(x, cmask, fmt, scale, group)
        mask = cmask.expand(3, K)
    else:
        t = dynamic_split(x, fmt, scale, group)
        mask = t.mask
    assert t.group == width and t.low_scale.shape == (3, -(-K // width))
    assert torch.allclose(t.dequantize(), _reference(x, mask, fmt, width), rtol=1e-6, atol=0)


@settings(max_examples=15, deadline=None)
@given(scale=st.sampled_from(["bank", "group"]), group=st.integers(1, 48), seed=st.integers(0, 2**16))
def test_calibrated_scales_are_the_part_maxima_per_group_and_shared_by_tokens(scale, group, seed):
    fmt = parse_sq("16-(8/4)-0.5")
    K = 48
    gen = torch.Generator().manual_seed(seed)
    calib = torch.randn(20, K, generator=gen) * torch.rand(K, generator=gen).mul(3).exp()
    cmask = static_channel_mask(torch.rand(K, generator=gen), fmt)
    lo, hi = static_act_scales(calib.abs().amax(0), cmask, fmt, scale, group)
    width = fmt.bank if scale == "bank" else min(group, K)
    for g in range(-(-K // width)):
        cols = torch.arange(g * width, min(K, (g + 1) * width))
        for part, s, qmax in ((False, lo, fmt.qmax_low), (True, hi, fmt.qmax_high)):
            sel = cols[cmask[cols] == part]
            want = _fp16(float(calib[:, sel].abs().max()), qmax) if len(sel) else 2.0**-24
            assert float(s[g]) == want
    x = torch.randn(4, K, generator=gen) * 2
    t = static_split(x, cmask, fmt, scale, group, (lo, hi))
    ref = _reference(x, cmask.expand(4, K), fmt, width, (lo, hi))
    assert torch.allclose(t.dequantize(), ref, rtol=1e-6, atol=1e-7)
    # one token's values do not move another token's scales (they are fixed)
    x2 = x.clone()
    x2[0] *= 100
    t2 = static_split(x2, cmask, fmt, scale, group, (lo, hi))
    assert torch.equal(t2.dequantize()[1:], t.dequantize()[1:])


@pytest.mark.parametrize("scale,group", [("bank", None), ("group", 24), ("group", 128)])
@pytest.mark.parametrize("calibrated", [False, True])
def test_static_module_is_the_split_product(scale, group, calibrated):
    """The static module's two dense matmuls on the reordered slices equal the SQ-quantized input
    (original order) times the weight; calibrated scales are saved buffers in the original order."""
    dense = _packed_w4(3)
    fmt = parse_sq("16-(8/4)-0.5")
    x = torch.randn(6, 64) * torch.linspace(0.1, 3, 64)
    W = dense.dequantize_weight()
    cmask = static_channel_mask(torch.rand(64, generator=torch.Generator().manual_seed(4)), fmt)
    scales = static_act_scales(x.abs().amax(0) * 0.8, cmask, fmt, scale, group) if calibrated else None
    m = SQActLinear.from_packed(dense, fmt.notation, "static", scale, cmask, group, scales)
    assert torch.equal(m.channel_mask(), cmask)
    want = static_split(x, cmask, fmt, scale, group, scales).dequantize() @ W.T
    assert torch.allclose(m(x), want, rtol=1e-5, atol=1e-5)
    w = {"bank": 16, "group": min(group or 0, 64)}[scale]
    assert (m.act_low_scale is not None) == calibrated
    if calibrated:
        assert m.act_low_scale.shape == (-(-64 // w),)
        assert m.act_low_scale.dtype == torch.float16
        assert any(t is m.act_low_scale for t in m.storage_tensors())


@pytest.mark.parametrize("scale,group", [("bank", None), ("group", 24)])
def test_dynamic_module_is_the_split_product(scale, group):
    dense = _packed_w4(5)
    fmt = parse_sq("16-(8/4)-0.75")
    x = torch.randn(5, 64) * torch.linspace(0.1, 3, 64)
    m = SQActLinear.from_packed(dense, fmt.notation, "dynamic", scale, act_group=group)
    want = dynamic_split(x, fmt, scale, group).dequantize() @ dense.dequantize_weight().T
    assert torch.allclose(m(x), want, rtol=1e-5, atol=1e-5)


def test_scale_bits_are_counted():
    fmt = parse_sq("16-(8/4)-0.5")
    K, T = 576, 2048
    y = (K // 2 * 4 + K // 2 * 8) / K  # the paper's y: 6 bits
    assert act_storage_bits(fmt, K, "static", T) == pytest.approx(y + 1 / T + 32 / K)
    assert act_storage_bits(fmt, K, "static", T, "bank") == pytest.approx(y + 1 / T + 32 / 16)
    assert act_storage_bits(fmt, K, "static", T, "group", 128) == pytest.approx(y + 1 / T + 32 * 5 / K)
    cal = act_storage_bits(fmt, K, "static", T, "bank", calibrated=True)
    assert cal == pytest.approx(y + 1 / T + 32 * 36 / (K * T))
    assert act_scale_bits(K, 16) == 2.0 and act_scale_bits(K, 128) == pytest.approx(32 * 5 / K)
    # dynamic: the measured Fig. 1 layout (full-shape low + compact high) plus the scales
    for scale, group, width in (("token", None, K), ("bank", None, 16), ("group", 128, 128)):
        got = act_storage_bits(fmt, K, "dynamic", 64, scale, group)
        assert got == pytest.approx(4 + 0.5 * 8 + act_scale_bits(K, width))
    with pytest.raises(ValueError, match="static mask"):
        act_storage_bits(fmt, K, "dynamic", 64, "bank", calibrated=True)


@pytest.fixture
def calib():
    return torch.randint(0, 128, (6, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "opts",
    [
        {"strategy": "static", "act_scale": "bank"},
        {"strategy": "static", "act_scale": "group", "act_scale_group": 24, "act_scale_calib": True},
        {"strategy": "static", "act_scale": "bank", "act_scale_calib": True},
        {"strategy": "dynamic", "act_scale": "group", "act_scale_group": 48},
    ],
)
def test_sq_acts_scales_save_reload_and_inspect(tmp_path, calib, opts, capsys):
    m = tiny()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    quantize_(m, "sq-acts", calib, progress=False, sq="16-(8/4)-0.5", group_size=32, **opts)
    mods = [x for x in m.modules() if isinstance(x, SQActLinear)]
    assert len(mods) == 14
    for x in mods:
        assert (x.act_scale, x.act_group, x.calibrated_scales) == (
            opts["act_scale"],
            opts.get("act_scale_group"),
            opts.get("act_scale_calib", False),
        )
    if opts.get("act_scale_calib"):  # calibrated from the calibration inputs: finite, positive, not the init
        s = torch.cat([x.act_high_scale.float() for x in mods])
        assert bool((s > 0).all()) and not bool((s == 1).all())
    with torch.inference_mode():
        out = m(ids).logits
    path = save_quantized(m, tmp_path / "q", {"method": "sq-acts"})
    m2, _ = load_quantized(path, load_tokenizer=False)
    loaded = [x for x in m2.modules() if isinstance(x, SQActLinear)]
    assert [x.act_scale_label for x in loaded] == [x.act_scale_label for x in mods]
    with torch.inference_mode():
        assert torch.equal(m2(ids).logits, out)
    capsys.readouterr()
    assert main(["inspect", str(path), "--layers"]) == 0
    text = capsys.readouterr().out
    assert "weight-only" not in text
    # the integer path where the parts' runs allow it (tests/kernels/test_sq_int.py), else why not
    label = SQActLinear.act_compute(loaded[0].layer_config())
    assert label == loaded[0].act_compute(loaded[0].layer_config())
    if loaded[0].int_act_blocker() is None:
        assert label.startswith("int8 (")
    else:
        assert label == f"simulated ({loaded[0].int_act_blocker()})"
    assert f"{label}: 14 layers" in text
    assert text.count(label) == 15  # the summary and 14 layer rows
    scale = f"group{opts['act_scale_group']}" if opts["act_scale"] == "group" else "bank"
    calib = " (calibrated)" if opts.get("act_scale_calib") else ""
    assert f"16-(8/4)-0.5 {opts['strategy']}, activation scales per {scale}{calib}: 14 layers" in text


def test_models_saved_without_the_new_keys_still_load():
    dense = _packed_w4(6)
    m = SQActLinear.from_packed(dense, "16-(8/4)-0.5", "dynamic", "bank")
    cfg = m.layer_config()
    assert "act_group" not in cfg and "calibrated_scales" not in cfg  # the pre-issue-25 config
    m2 = SQActLinear.from_layer_config(cfg)
    m2.load_state_dict(m.state_dict())
    x = torch.randn(3, 64)
    assert torch.equal(m2(x), m(x))


@pytest.mark.parametrize(
    "opts,msg",
    [
        ({"act_scale": "group"}, "--act-scale group needs a width: add --act-scale-group G"),
        ({"act_scale_group": 64}, "--act-scale-group applies to --act-scale group"),
        ({"act_scale": "bank", "act_scale_calib": True}, "--act-scale-calib needs a static mask"),
        ({"strategy": "static", "act_scale_calib": True}, "per-bank or per-group"),
        ({"act_scale": "group", "act_scale_group": 0}, "act_scale_group"),
        ({"act_scale": "channel"}, "act_scale"),
    ],
)
def test_bad_scale_options_are_refused(opts, msg):
    with pytest.raises(ValueError, match=msg):
        get_method("sq-acts").make_config(**opts)


def test_cli_bad_scale_option_is_one_error_line(capsys):
    argv = ["quantize", "--model", "nowhere", "--method", "sq-acts", "--act-scale", "group", "--out", "x"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err and "--act-scale-group" in lines[0], err


def test_w_sq_a4_group_wise(tmp_path, calib):
    """W(SQ)A4 with A4 per group of 16 channels: each SQ-format linear quantizes its input per token
    and group (the generic --a-granularity group), simulated, and the saved model reproduces it."""
    m = tiny()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    a4 = ActQuantSpec("int", 4, granularity="group", group_size=16)
    quantize_(m, "sq-weights", calib, progress=False, sq="16-(8/4)-0.75", act=a4)
    lin = next(x for x in m.modules() if isinstance(x, SQWeightLinear))
    assert lin.act_quantizer().spec == a4
    x = torch.randn(3, lin.in_features) * 3
    want = fake_quant(x, a4) @ lin.dequantize_weight().T
    assert torch.allclose(lin(x), want, rtol=1e-5, atol=1e-5)
    per_token = fake_quant(x, ActQuantSpec("int", 4))
    assert not torch.allclose(fake_quant(x, a4), per_token)  # the group option is not per-token in disguise
    assert_reload_same_logits(m, ids, tmp_path / "q", {"method": "sq-weights"})
