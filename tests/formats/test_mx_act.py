"""Microscaled activations (issue 75): the NVFP4 / MXFP4 / MXFP8 input quantizers are the weight codec of
formats/mx.py applied to the activation rows, equal compressed-tensors' own activation quantization, and
calibrate NVFP4's tensor scale as llm-compressor does (the maximum over the calibration set)."""

from __future__ import annotations

import pytest
import torch

from bitmosaic.algorithms.observers import ActObserver
from bitmosaic.errors import OptionError
from bitmosaic.formats.act import ActQuantSpec, fake_quant, mx_divisors, parse_scheme
from bitmosaic.formats.mx import mx_dequantize, mx_quantize, nvfp4_global_scale
from bitmosaic.formats.sq_act import act_bits
from bitmosaic.modules.actquant import attach_input_quant


def _x(tokens=(3, 20), n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*tokens, n, generator=g) * torch.exp(torch.randn(n, generator=g))
    x[0, 1, 7] = 60.0  # an outlier channel value
    x[1, 2, 32:64] = 0  # an all-zero block
    return x


@pytest.mark.parametrize("scheme,name", [("NVFP4", "nvfp4"), ("MXFP4", "mxfp4"), ("MXFP8", "mxfp8")])
def test_schemes_give_the_microscaled_quantizer(scheme, name):
    bits, spec = parse_scheme(scheme)
    assert spec == ActQuantSpec.microscaled(name) and spec.mx == name
    assert bits == spec.bits == (8 if name == "mxfp8" else 4)
    assert spec.static == (name == "nvfp4")  # only NVFP4's tensor scale is calibrated
    assert ActQuantSpec.from_dict(spec.to_dict()) == spec
    assert "mx" not in ActQuantSpec("int", 8).to_dict()  # older specs save as before


@pytest.mark.parametrize("name", ["mxfp4", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("rule", ["round", "floor"])
def test_activation_quantizer_is_the_weight_codec_on_the_rows(name, rule):
    x = _x()
    rows = x.reshape(-1, x.shape[-1])
    spec = ActQuantSpec.microscaled(name, static=False, rule=rule)
    want = mx_dequantize(mx_quantize(rows, name, rule=rule)).reshape(x.shape)
    assert torch.equal(fake_quant(x, spec), want)
    if name == "nvfp4":  # static: the calibrated tensor scale replaces the input's own maximum
        gs = nvfp4_global_scale(3 * rows.abs().amax())  # (a power of two would cancel out exactly)
        st = ActQuantSpec.microscaled(name, static=True)
        got = fake_quant(x, st, gs)
        assert not torch.equal(got, want)
        div = mx_divisors(x, st, gs)
        assert div.shape == (*x.shape[:-1], 16)  # E4M3 block scales (to float32 rounding) over gs
        assert torch.allclose((div * gs).to(torch.float8_e4m3fn).float(), div * gs, rtol=1e-6, atol=0)
        with pytest.raises(ValueError, match="no calibrated tensor scale"):
            fake_quant(x, st)


def test_bfloat16_inputs_keep_their_dtype():
    x = _x().to(torch.bfloat16)
    y = fake_quant(x, ActQuantSpec.microscaled("mxfp4"))
    assert y.dtype == torch.bfloat16 and torch.equal(
        y, fake_quant(x.float(), ActQuantSpec.microscaled("mxfp4")).bfloat16()
    )


def test_observer_calibrates_the_nvfp4_tensor_scale_and_module_saves_it():
    spec = ActQuantSpec.microscaled("nvfp4")
    obs = ActObserver(256, spec)
    xs = [_x(seed=s) for s in range(3)]
    for x in xs:
        obs.add(x)
    amax = torch.stack([x.abs().amax() for x in xs]).amax()
    assert torch.equal(obs.static_scale(), nvfp4_global_scale(amax))
    lin = torch.nn.Linear(256, 8)
    q = attach_input_quant(lin, spec, 256, obs.static_scale())
    assert q.scale.shape == (1,) and "input_quant.scale" in lin.state_dict()
    with torch.no_grad():
        assert torch.equal(
            lin(xs[0]), torch.nn.functional.linear(fake_quant(xs[0], spec, q.scale), lin.weight, lin.bias)
        )
    assert spec.label == "nvfp4/static-global" and ActQuantSpec.microscaled("mxfp4").label == "mxfp4/dynamic"


def test_bad_microscaled_specs_refuse_in_one_line():
    for kw, msg in [
        ({"group_size": 16}, "group_size=16"),
        ({"static": True}, "only NVFP4's tensor scale is static"),
        ({"pow2": True}, "pow2=True"),
    ]:
        base = {"fmt": "e2m1", "bits": 4, "granularity": "group", "group_size": 32, "mx": "mxfp4", **kw}
        with pytest.raises(ValueError, match=msg) as e:
            ActQuantSpec(**base)
        assert "\n" not in str(e.value)
    with pytest.raises(OptionError, match="NVFP4A16, NVFP4"):
        parse_scheme("NVFP5")


def test_activation_bits_count_the_block_scales():
    K = 4096
    assert act_bits(K, ActQuantSpec.microscaled("mxfp4")).total == 4 + 8 / 32
    assert act_bits(K, ActQuantSpec.microscaled("mxfp8")).total == 8 + 8 / 32
    assert act_bits(K, ActQuantSpec.microscaled("nvfp4"), tokens=2048).total == pytest.approx(
        4 + 8 / 16 + 32 / K / 2048
    )


# ---- against compressed-tensors' own activation path ---------------------------------------------


@pytest.mark.parametrize("preset,name", [("NVFP4", "nvfp4"), ("MXFP4", "mxfp4"), ("MXFP8", "mxfp8")])
def test_equals_compressed_tensors_activation_quantization(preset, name):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from compressed_tensors.quantization.quant_config import QuantizationStatus
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    args = PRESET_SCHEMES[preset]["input_activations"]
    x = _x()
    module = torch.nn.Linear(256, 8)
    module.quantization_status = QuantizationStatus.CALIBRATION
    spec = ActQuantSpec.microscaled(name)
    gs = None
    if (
        name == "nvfp4"
    ):  # llm-compressor's static_minmax observer over a calibration set, then generate_gparam
        calib = torch.cat([x, 3 * _x(seed=1)]).reshape(-1, 256)
        gs = generate_gparam(calib.min(), calib.max())
        module.input_global_scale = torch.nn.Parameter(gs, requires_grad=False)
        obs = ActObserver(256, spec)
        obs.add(calib)
        assert torch.equal(obs.static_scale(), gs.float())
    theirs = forward_quantize(module, x, "input", args)
    assert torch.equal(fake_quant(x, spec, gs), theirs)
