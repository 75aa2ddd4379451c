"""MosaicQuant with INT activations runs in integers (kernels/mosaic.py, MosaicIntActWeight): the dense
base and every residual block multiply the same int8 activations in int32, and the output equals the
simulated path (fake-quantized input times the dequantized dense + residual weight) up to float32
rounding -- for block shapes with edge blocks, thin blocks, the channel residual, per-token / per-tensor
/ per-group activation scales (groups that hold blocks and groups that split them), INT8 and INT4,
decode and prefill rows; a quantized and reloaded model picks it and ``inspect`` says so."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bitmosaic
from bitmosaic.algorithms.mosaic import mosaic_decompose
from bitmosaic.formats.act import ActQuantSpec, fake_quant
from bitmosaic.kernels.mosaic import MosaicIntActWeight
from bitmosaic.modules import QuantModule, attach_input_quant
from bitmosaic.modules.intact import IntActKernel, act_path_label
from bitmosaic.modules.mosaic import MosaicQuantLinear
from tests.helpers import env_var
from tests.kernels.test_intact import _close, simulated


def _mosaic(out, inp, block, budget, spec, seed, selection="delta-hessian"):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, inp, generator=g)
    X = torch.randn(256, inp, generator=g)
    X[:, torch.randperm(inp, generator=g)[:4]] *= 8.0
    amax = X.abs().amax(0) if selection == "channel-act" else None
    res = mosaic_decompose(W, X.T @ X, budget=budget, block=block, selection=selection, act_amax=amax)
    m = MosaicQuantLinear.from_result(res, bias=torch.randn(out, generator=g))
    scale = None
    if spec.static:
        x0 = X[:64] * 2
        if spec.granularity == "tensor":
            scale = x0.abs().amax().reshape(1) / spec.qmax
        else:
            G = -(-inp // spec.group_size)
            a = torch.nn.functional.pad(x0.abs(), (0, G * spec.group_size - inp))
            scale = a.reshape(64, G, -1).amax((0, 2)) / spec.qmax
    attach_input_quant(m, spec, inp, scale)
    return m, g


def _check(m, x):
    with torch.inference_mode():
        assert m.int_act_blocker() is None and m.runs_int_act(x)
        y = m(x)
        assert isinstance(m._int_act, IntActKernel) and isinstance(m._int_act.weight, MosaicIntActWeight)
        with simulated():
            assert not m.runs_int_act(x)
            y_sim = m(x)
    assert m.res_index.numel() and m._int_act.weight.parts  # the residual did run
    q = m.input_quant
    _close(y - m.bias, y_sim - m.bias, fake_quant(x, q.spec, q.scale), m.dequantize_reference(), m.bias)
    return y


@settings(max_examples=20, deadline=None)
@given(
    shape=st.sampled_from([(48, 128), (70, 200), (96, 64)]),
    block=st.sampled_from([(16, 32), (32, 64), (8, 128), (1, 64), (16, 16)]),
    gran=st.sampled_from(["token", "tensor-static", "tensor", "group", "group-static"]),
    agroup=st.sampled_from([16, 32, 64, 128]),
    abits=st.sampled_from([8, 4]),
    M=st.sampled_from([1, 5, 40]),
    seed=st.integers(0, 2**16),
)
def test_mosaic_int_path_matches_simulated(shape, block, gran, agroup, abits, M, seed):
    static = gran.endswith("-static")
    gran = gran.split("-")[0]
    bk = block[1]
    if gran == "group" and agroup % bk and bk % agroup:
        agroup = bk  # neither holds nor splits the blocks: stays simulated (tested below)
    spec = ActQuantSpec("int", abits, granularity=gran, group_size=agroup, static=static)
    m, g = _mosaic(*shape, block, 0.15, spec, seed)
    _check(m, torch.randn(M, shape[1], generator=g) * 2)


@pytest.mark.parametrize("gran", ["token", "tensor"])
def test_channel_residual_runs_in_integers(gran):
    spec = ActQuantSpec("int", 8, granularity=gran)
    m, g = _mosaic(70, 200, (16, 32), 0.15, spec, 1, selection="channel-act")
    assert m.res_columns is not None
    _check(m, torch.randn(2, 9, 200, generator=g) * 2)


def test_what_stays_simulated_says_why():
    spec = ActQuantSpec("int", 8, granularity="group", group_size=48)
    m, _ = _mosaic(48, 192, (16, 64), 0.15, spec, 0)
    assert (
        m.int_act_blocker() == "activation groups of 48 neither hold nor split residual blocks of 64 columns"
    )
    spec = ActQuantSpec("int", 8, granularity="group", group_size=32)
    m, _ = _mosaic(70, 200, (16, 32), 0.15, spec, 1, selection="channel-act")
    assert m.int_act_blocker() == "per-group activation scales on a residual of gathered columns"
    fp8 = ActQuantSpec("e4m3", 8, granularity="tensor", static=True)
    assert MosaicQuantLinear._residual_blocker(fp8, 64, False) is None  # the base says why (FP8)
    assert MosaicQuantLinear._residual_blocker(spec, 12, False).startswith("residual blocks of 12 columns")


def test_quantized_model_picks_it_after_save_and_load(tmp_path, capsys):
    from bitmosaic.cli import main
    from bitmosaic.io import load_quantized, save_quantized
    from tests.methods.saved_bytes import calib, tiny_llama

    model = tiny_llama()
    bitmosaic.quantize_(
        model, "mosaic", calib(), progress=False, scheme="W4A4", budget_frac=0.2, block="16x32"
    )
    layers = [m for m in model.modules() if isinstance(m, MosaicQuantLinear)]
    tokens = calib()[:2]
    with torch.inference_mode():
        y = model(tokens).logits
        with simulated():
            y_sim = model(tokens).logits
    assert layers and all(isinstance(m._int_act.weight, MosaicIntActWeight) for m in layers)
    assert (y.argmax(-1) == y_sim.argmax(-1)).float().mean() >= 0.9
    path = save_quantized(model, tmp_path / "m", {"method": "mosaic"})
    loaded, _ = load_quantized(path, load_tokenizer=False)
    with torch.inference_mode():
        assert torch.equal(loaded(tokens).logits, y)
    capsys.readouterr()
    assert main(["inspect", str(path), "--layers"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("model.layers.")]
    assert rows and all(ln.endswith(act_path_label(None, ActQuantSpec("int", 4))) for ln in rows)
    with env_var("BITMOSAIC_ACT_COMPUTE", "sim"):
        assert [
            m for m in loaded.modules() if isinstance(m, QuantModule) and m.runs_int_act(tokens.float())
        ] == []


def test_compiles_whole_and_equals_eager():
    """``torch.compile(fullgraph=True)`` traces the integer MosaicQuant layer (``int8_quantize`` and
    ``int_matmul_parts`` are operators with fake implementations) and gives the eager output."""
    from bitmosaic.kernels import intmm

    if intmm.extension() is None:
        pytest.skip("no C++ compiler for the integer kernel")
    torch._dynamo.reset()
    m, g = _mosaic(48, 128, (16, 32), 0.2, ActQuantSpec("int", 4, granularity="group", group_size=64), 2)
    x = torch.randn(5, 128, generator=g)
    with torch.no_grad():
        ref = m(x)
        assert isinstance(m._int_act.weight, MosaicIntActWeight)
        out = torch.compile(m, fullgraph=True, dynamic=False)(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
