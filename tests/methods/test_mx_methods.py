"""Microscaling weights (issue 75): RTN with scales searched in their encoding, GPTQ over the element
grid, the ``mx`` module kind, the llm-compressor scheme names, save/load, and one-line refusals."""

from __future__ import annotations

import pytest
import torch

from bitmosaic import quantize_
from bitmosaic.algorithms.mx import MXColumnQuantizer, mx_gptq, mx_rtn, search_block_scales
from bitmosaic.cli import main
from bitmosaic.errors import OptionError
from bitmosaic.formats.accounting import mx_storage_bits
from bitmosaic.formats.mx import (
    MX_FORMATS,
    decode_elements,
    encode_elements,
    get_mx_format,
    mx_dequantize,
    mx_quantize,
    nvfp4_global_scale,
    quantize_elements,
)
from bitmosaic.io import save_quantized
from bitmosaic.io.saved.load import load_quantized
from bitmosaic.modules import MXLinear
from tests.helpers import SPECIALS, VOCAB, save_hf_dir, tiny_llama, words


def _layer(seed=0, out=64, n=256, tokens=1024):
    """Correlated inputs (a shared low-rank part, varied channel scales), a weight with outliers."""
    g = torch.Generator().manual_seed(seed)
    Z = torch.randn(tokens, 8, generator=g)
    X = Z @ torch.randn(8, n, generator=g) + torch.randn(tokens, n, generator=g)
    X = X * torch.exp(torch.randn(n, generator=g) * 0.5)
    W = torch.randn(out, n, generator=g) * 0.02
    W[torch.rand(out, n, generator=g) < 0.01] *= 8
    return W, X, X.T @ X / tokens


def _herr(W, Q, H):
    E = (W - Q).double()
    return float(((E @ H.double()) * E).sum())


@pytest.mark.parametrize("name", list(MX_FORMATS))
def test_mse_search_never_worse_and_stays_in_encoding(name):
    fmt = get_mx_format(name)
    W, _, _ = _layer()
    mm, mse = mx_rtn(W, fmt, method="minmax"), mx_rtn(W, fmt, method="mse")
    e_mm = ((W - mm.dequantize()) ** 2).sum()
    e_mse = ((W - mse.dequantize()) ** 2).sum()
    assert e_mse <= e_mm
    if fmt.elem == "e2m1":
        assert e_mse < e_mm  # the search finds better scales on 4-bit grids
    t = mse.to_tensor()  # raises unless every scale is representable in the stored encoding
    assert torch.equal(mx_dequantize(t), mse.dequantize())


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "mxfp8"])
def test_minmax_rtn_is_the_reference_quantizer(name):
    W, _, _ = _layer()
    for rule in ("floor", "round"):
        a = mx_rtn(W, name, method="minmax", rule=rule).to_tensor()
        b = mx_quantize(W, name, rule=rule)
        assert all(
            torch.equal(x.view(torch.uint8), y.view(torch.uint8))
            for x, y in zip(a.tensors(), b.tensors(), strict=True)
        )


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "fp8-block"])
def test_gptq_on_the_element_grid_beats_rtn(name):
    fmt = get_mx_format(name)
    W, _, H = _layer(out=256 if name == "fp8-block" else 64)
    rtn = mx_rtn(W, fmt, method="mse")
    g = mx_gptq(W, H, fmt, method="mse", perm=torch.argsort(torch.diagonal(H), descending=True))
    # the scales are the RTN search's (static, from the original weights); only the elements moved
    assert torch.equal(g.scales, rtn.scales)
    assert torch.equal(g.to_tensor().scales.view(torch.uint8), rtn.to_tensor().scales.view(torch.uint8))
    # every element is a grid value (encoding raises otherwise) and the Hessian error drops
    assert torch.equal(mx_dequantize(g.to_tensor()), g.dequantize())
    assert _herr(W, g.dequantize(), H) < 0.8 * _herr(W, rtn.dequantize(), H)
    assert g.lattice_scales() is None  # not an integer lattice: no Babai bound


def test_column_quantizer_rounds_to_nearest_element():
    fmt = get_mx_format("nvfp4")
    W, _, _ = _layer()
    gs = nvfp4_global_scale(W.abs().amax())
    q = MXColumnQuantizer(fmt, "minmax", "floor", gs)
    div, zero = q.fit(W[:, :16])
    s = search_block_scales(W[:, :16], fmt, method="minmax", global_scale=gs)
    assert torch.equal(div, s[:, 0] / gs) and not zero.any()
    code, deq = q.quantize(W[:, 3], div, zero)
    v = decode_elements(code.to(torch.uint8), fmt)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    assert torch.isin(v.abs(), grid).all() and torch.equal(deq, v * div)
    # nearest: no other grid value is closer to w / div
    d = (W[:, 3] / div).clamp(-6, 6)
    best = (d[:, None] - torch.cat([grid, -grid])[None]).abs().min(dim=1).values
    assert torch.allclose((d - v).abs(), best)


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "mxfp8", "fp8-block"])
def test_one_search_for_every_block_is_the_per_block_fit(name):
    """GPTQ's static scales come from one search over the whole matrix (``fit_groups``) and its columns
    are encoded without the grid check: the same divisors as one ``fit`` per block column, and the codes
    the checked encoder gives (FP8 block, 128 x 128 blocks, keeps one fit per block column)."""
    fmt = get_mx_format(name)
    W, _, _ = _layer(out=256 if name == "fp8-block" else 64, n=200)  # a partial last block
    W[:, 40:56] = 0.0  # a dead block
    gs = nvfp4_global_scale(W.abs().amax()) if fmt.global_scale else None
    q = MXColumnQuantizer(fmt, "mse", "floor", gs)
    many = q.fit_groups(W, fmt.block)
    if fmt.block_rows > 1:
        assert many is None
        return
    one = torch.stack([q.fit(W[:, k : k + fmt.block])[0] for k in range(0, W.shape[1], fmt.block)], 1)
    assert torch.equal(many[0], one) and not many[1].any()
    for j in range(0, W.shape[1], 7):
        s = one[:, j // fmt.block].clone()
        code, deq = q.quantize(W[:, j], s, 0)
        v = quantize_elements(W[:, j] / s, fmt)
        assert torch.equal(code, encode_elements(v, fmt).float()) and torch.equal(deq, v * s)


def _calib():
    return torch.randint(len(SPECIALS), VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "scheme,fmt",
    [("NVFP4A16", "nvfp4"), ("MXFP4A16", "mxfp4"), ("MXFP8A16", "mxfp8"), ("FP8_BLOCK", "fp8-block")],
)
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_schemes_quantize_save_load_generate(scheme, fmt, method, tmp_path):
    m = tiny_llama()
    ids = _calib()[:1, :8]
    quantize_(m, method, _calib(), scheme=scheme, progress=False)
    mods = {n: x for n, x in m.named_modules() if isinstance(x, MXLinear)}
    assert len(mods) == 14 and {x.fmt for x in mods.values()} == {fmt}
    lin = mods["model.layers.0.mlp.down_proj"]
    assert lin.bits_per_weight() * lin.in_features * lin.out_features == mx_storage_bits(
        lin.out_features, lin.in_features, fmt
    )
    with torch.no_grad():
        y = m(ids).logits
        # the tiled reference kernel is the exact dequantization times x
        x = torch.randn(3, lin.in_features)
        assert torch.allclose(lin.kernel()(x), x @ lin.dequantize_reference().T, atol=1e-5, rtol=0)
    save_quantized(m, tmp_path, {"method": method, "scheme": scheme})
    m2 = load_quantized(tmp_path, load_tokenizer=False)[0]
    with torch.no_grad():
        assert torch.equal(m2(ids).logits, y)
    l2 = dict(m2.named_modules())["model.layers.0.mlp.down_proj"]
    assert torch.equal(l2.weight_packed, lin.weight_packed) and torch.equal(
        l2.weight_scale.view(torch.uint8), lin.weight_scale.view(torch.uint8)
    )
    assert m2.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 11)


def test_nvfp4_stacked_linears_share_the_global_scale():
    """GPTQ stacks the linears of one Hessian (q/k/v, gate/up), so they share one NVFP4 tensor scale."""
    m = tiny_llama()
    quantize_(m, "gptq", _calib(), scheme="NVFP4A16", progress=False)
    a = m.model.layers[0].self_attn
    gs = [x.weight_global_scale for x in (a.q_proj, a.k_proj, a.v_proj)]
    assert torch.equal(gs[0], gs[1]) and torch.equal(gs[0], gs[2])  # vLLM's fused qkv needs one


@pytest.mark.parametrize("method", ["awq", "babai", "hptq"])
def test_methods_without_the_grid_refuse_in_one_line(method):
    with pytest.raises(OptionError, match=f"method '{method}' cannot use the nvfp4 grid") as e:
        quantize_(tiny_llama(), method, _calib(), scheme="NVFP4A16", progress=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("scheme,fmt", [("NVFP4", "nvfp4"), ("MXFP4", "mxfp4"), ("MXFP8", "mxfp8")])
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_full_schemes_quantize_weights_and_activations(scheme, fmt, method, tmp_path):
    """W4A4 / W8A8 of one format: the weights in the ``mx`` kind, every input through the microscaled
    quantizer (NVFP4's tensor scale calibrated from the layer's calibration inputs), saved and loaded."""
    from bitmosaic.formats.act import ActQuantSpec, fake_quant

    m = tiny_llama()
    seen = {}
    hook = m.model.layers[1].mlp.down_proj.register_forward_pre_hook(
        lambda mod, a: seen.setdefault("x", []).append(a[0].detach().clone())
    )
    quantize_(m, method, _calib(), scheme=scheme, progress=False)
    hook.remove()
    mods = {n: x for n, x in m.named_modules() if isinstance(x, MXLinear)}
    assert len(mods) == 14
    for x in mods.values():
        assert x.fmt == fmt and x.input_quant.spec == ActQuantSpec.microscaled(fmt)
    down = m.model.layers[1].mlp.down_proj
    if fmt == "nvfp4":  # the maximum over the calibration inputs the layer saw (quantized upstream)
        amax = torch.cat([x.reshape(-1, x.shape[-1]) for x in seen["x"]]).abs().amax()
        assert torch.equal(down.input_quant.scale, nvfp4_global_scale(amax))
    else:
        assert down.input_quant.scale is None  # E8M0 block scales: all dynamic
    x = torch.randn(3, down.in_features)
    with torch.no_grad():
        want = fake_quant(x, down.input_quant.spec, down.input_quant.scale) @ down.dequantize_reference().T
        assert torch.allclose(down(x), want, atol=1e-5, rtol=1e-5)
    ids = _calib()[:1, :8]
    with torch.no_grad():
        out = m(ids).logits
    save_quantized(m, tmp_path / "q")
    back = load_quantized(tmp_path / "q", load_tokenizer=False)[0]
    assert back.model.layers[1].mlp.down_proj.input_quant.spec == down.input_quant.spec
    with torch.no_grad():
        assert torch.equal(back(ids).logits, out)


def test_cli_scheme(tmp_path, capsys):
    (tmp_path / "t.txt").write_text(words(400))
    src = save_hf_dir(tmp_path / "f")
    base = [
        "quantize",
        "--model",
        str(src),
        "--calib",
        str(tmp_path / "t.txt"),
        "--nsamples",
        "2",
        "--seqlen",
        "16",
        "--no-progress",
        "--device",
        "cpu",
    ]
    assert main([*base, "--method", "gptq", "--scheme", "MXFP4A16", "--out", str(tmp_path / "q")]) == 0
    m = load_quantized(tmp_path / "q", load_tokenizer=False)[0]
    assert m.model.layers[1].mlp.up_proj.fmt == "mxfp4"
    capsys.readouterr()
    assert main([*base, "--method", "awq", "--scheme", "NVFP4A16", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "cannot use the nvfp4 grid" in err and "Traceback" not in err
