"""Microscaling formats (issue 75): known values of the OCP MX v1.0 spec, exact round trips, exact
bits, and bit-for-bit agreement with compressed-tensors' own NVFP4/MXFP4/MXFP8 codecs."""

from __future__ import annotations

import math

import pytest
import torch

from bitmosaic.formats.accounting import mx_storage_bits, storage_bits
from bitmosaic.formats.mx import (
    E2M1_VALUES,
    MX_FORMATS,
    MXTensor,
    block_amax,
    block_scales,
    decode_elements,
    e8m0_decode,
    e8m0_encode,
    e8m0_exponent,
    encode_elements,
    get_mx_format,
    mx_dequantize,
    mx_matmul,
    mx_quantize,
    nvfp4_global_scale,
    pack_fp4,
    unpack_fp4,
)


def _w(out=48, n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, n, generator=g) * 0.02
    W[3, 5] = 0.4  # an outlier: blocks with very different ranges
    W[7, 32:64] = 0  # an all-zero block
    return W


def test_e2m1_codes_enumerate_the_spec_table():
    # OCP MX v1.0 Table 5 (FP4 E2M1): S EE M, bias 1, subnormal 0.5, max 6
    for code in range(16):
        s, e, m = code >> 3, (code >> 1) & 3, code & 1
        v = (m * 0.5) if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
        want = -v if s else v
        got = float(decode_elements(torch.tensor([code], dtype=torch.uint8), get_mx_format("mxfp4"))[0])
        assert got == want and math.copysign(1, got) == math.copysign(1, want)
    vals = decode_elements(torch.arange(16, dtype=torch.uint8), get_mx_format("nvfp4"))
    assert torch.equal(encode_elements(vals, get_mx_format("nvfp4")), torch.arange(16, dtype=torch.uint8))


def test_e8m0_known_values():
    # OCP MX v1.0 §5.4.1: E8M0 is an unsigned exponent, bias 127, 0xFF is NaN, no zero
    codes = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    v = e8m0_decode(codes)
    assert v[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert math.isnan(v[6])
    assert torch.equal(
        e8m0_encode(torch.tensor([-127, -1, 0, 1, 127, 300])),
        torch.tensor([0, 126, 127, 128, 254, 254], dtype=torch.uint8),
    )


def test_shared_exponent_rules():
    fp4, fp8, e5 = (get_mx_format(n) for n in ("mxfp4", "mxfp8", "mxfp8-e5m2"))
    assert (fp4.emax_elem, fp8.emax_elem, e5.emax_elem) == (2, 8, 15)  # OCP MX v1.0 Table 1
    a = torch.tensor([6.0, 7.9, 5.9, 1.0, 0.0, 448.0, 449.0])
    # floor(log2(amax)) - emax_elem
    assert e8m0_exponent(a, fp4, "floor").tolist() == [0, 0, 0, -2, -127, 6, 6]
    # compressed-tensors: amax first rounded to 1 mantissa bit (7.9 -> 8, 5.9 -> 6, 448 = 1.75·2^8 -> 2^9)
    assert e8m0_exponent(a, fp4, "round").tolist() == [0, 1, 0, -2, -127, 7, 7]
    assert e8m0_exponent(a, fp8, "floor").tolist() == [-6, -6, -6, -8, -127, 0, 0]
    # the floor rule saturates: a block of max 7.9 keeps X = 1 and 7.9 becomes 6
    t = mx_quantize(torch.tensor([[7.9] + [0.0] * 31]), "mxfp4", rule="floor")
    assert float(mx_dequantize(t)[0, 0]) == 6.0
    t = mx_quantize(torch.tensor([[7.9] + [0.0] * 31]), "mxfp4", rule="round")
    assert float(mx_dequantize(t)[0, 0]) == 8.0


@pytest.mark.parametrize("name", list(MX_FORMATS))
@pytest.mark.parametrize("rule", ["floor", "round"])
def test_round_trip_is_exact_and_bits_are_counted(name, rule):
    fmt = get_mx_format(name)
    W = _w()
    t = mx_quantize(W, fmt, rule=rule)
    D = mx_dequantize(t)
    # re-quantizing the dequantized weights with the stored scales reproduces the same bytes
    t2 = MXTensor.from_values(t.values(), t.scale_values(), fmt, t.global_scale)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(t.tensors(), t2.tensors(), strict=True)
    )
    assert torch.equal(mx_dequantize(t2), D)
    # every element is within half a step of its block's grid (or saturated at the grid's max)
    assert torch.isfinite(D).all()
    assert float((D - W).abs().max()) <= float(W.abs().max()) * (0.25 if fmt.elem == "e2m1" else 0.07)
    # bits: the formula from the definition equals the real buffers
    assert storage_bits(t.tensors()) == mx_storage_bits(*W.shape, fmt)
    # the reference matmul is x @ dequant^T
    x = torch.randn(5, W.shape[1])
    assert torch.allclose(mx_matmul(x, t), x @ D.T, rtol=0, atol=1e-6)


def test_bits_per_weight():
    assert mx_storage_bits(4096, 4096, "mxfp4") / 4096**2 == 4.25
    assert mx_storage_bits(4096, 4096, "nvfp4") / 4096**2 == 4.5 + 32 / 4096**2
    assert mx_storage_bits(4096, 4096, "mxfp8") / 4096**2 == 8.25
    assert mx_storage_bits(4096, 4096, "fp8-block") / 4096**2 == 8 + 32 / 128**2


def test_pack_nibble_order_and_errors():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    p = pack_fp4(codes)
    assert p.tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack_fp4(p), codes)
    with pytest.raises(ValueError, match="even number"):
        pack_fp4(torch.zeros(1, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="E2M1 grid"):
        encode_elements(torch.tensor([0.7]), get_mx_format("mxfp4"))
    with pytest.raises(ValueError, match="powers of two"):
        MXTensor.from_values(torch.zeros(1, 32), torch.tensor([[0.75]]), "mxfp4")


def test_fp8_block_is_two_dimensional():
    fmt = get_mx_format("fp8-block")
    W = _w(out=200, n=300)
    assert block_amax(W, fmt).shape == (2, 3)
    t = mx_quantize(W, fmt)
    assert t.scales.dtype == torch.float32 and t.scales.shape == (2, 3)
    assert torch.equal(t.scales, block_amax(W, fmt) / 448)


def test_nvfp4_scales_are_e4m3_over_global():
    W = _w()
    gs = nvfp4_global_scale(W.abs().amax())
    assert float(gs) == pytest.approx(448 * 6 / float(W.abs().amax()), rel=1e-7)
    s = block_scales(block_amax(W, get_mx_format("nvfp4")), get_mx_format("nvfp4"), global_scale=gs)
    assert torch.equal(s.to(torch.float8_e4m3fn).float(), s) and float(s.max()) <= 448


# ---- against compressed-tensors' codecs ---------------------------------------------------------

ct = pytest.importorskip("compressed_tensors")


def _ct(preset: str, W: torch.Tensor):
    """compressed-tensors' own observer-free path: min/max per group -> ``calculate_qparams`` (and
    ``generate_gparam`` for NVFP4) -> the preset's compressor."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[preset])
    g = scheme.weights.group_size
    Wg = W.reshape(W.shape[0], -1, g)
    gs = generate_gparam(W.min(), W.max()) if preset.startswith("NVFP4") else None
    scale, _ = calculate_qparams(Wg.amin(-1), Wg.amax(-1), scheme.weights, global_scale=gs)
    sd = {"weight": W, "weight_scale": scale}
    if gs is not None:
        sd["weight_global_scale"] = gs
    fmt_name = {
        "NVFP4A16": "nvfp4-pack-quantized",
        "MXFP4A16": "mxfp4-pack-quantized",
        "MXFP8A16": "mxfp8-quantized",
    }
    comp = BaseCompressor.get_value_from_registry(fmt_name[preset])
    return comp, scheme, comp.compress(sd, scheme)


@pytest.mark.parametrize("preset,name", [("NVFP4A16", "nvfp4"), ("MXFP4A16", "mxfp4"), ("MXFP8A16", "mxfp8")])
def test_bit_for_bit_with_compressed_tensors(preset, name):
    W = _w()
    comp, scheme, out = _ct(preset, W)
    t = mx_quantize(W, name, rule="round")
    key = "weight_packed" if "weight_packed" in out else "weight"
    assert torch.equal(out[key].view(torch.uint8), t.elements)
    assert torch.equal(out["weight_scale"].view(torch.uint8), t.scales.view(torch.uint8))
    if t.global_scale is not None:
        assert torch.equal(out["weight_global_scale"].float(), t.global_scale)
    # and their decompressor reads our bytes back to our values (in their bfloat16)
    sd = {
        key: t.elements if key == "weight_packed" else t.elements.view(torch.float8_e4m3fn),
        "weight_scale": t.scales,
    }
    if t.global_scale is not None:
        sd["weight_global_scale"] = t.global_scale
    back = comp.decompress(sd, scheme)["weight"].float()
    assert torch.equal(back, mx_dequantize(t, torch.bfloat16).float()) or torch.allclose(
        back, mx_dequantize(t), rtol=2**-8, atol=0
    )


def test_fp4_values_match_compressed_tensors_table():
    from compressed_tensors.compressors.nvfp4.helpers import kE2M1ToFloat, unpack_fp4_from_uint8

    assert torch.equal(kE2M1ToFloat, E2M1_VALUES)
    b = torch.arange(256, dtype=torch.uint8).reshape(2, 128)
    theirs = unpack_fp4_from_uint8(b, 2, 256, dtype=torch.float32)
    ours = decode_elements(unpack_fp4(b), get_mx_format("mxfp4"))
    assert torch.equal(theirs, ours)
