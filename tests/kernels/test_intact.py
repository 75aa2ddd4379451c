"""Integer activation compute in the modules (modules/intact.py): a packed layer with an INT activation
quantizer runs the integer kernel (the pre-hook leaves its input alone) and matches the simulated path
(``$BITMOSAIC_ACT_COMPUTE=sim``) up to float32 rounding, for widths, granularities, act-order and
no-clip layers; every method that makes such layers (GPTQ / RTN / AWQ with ``abits``, SmoothQuant
W8A8 / W4A8, W4A4) picks it, after quantization and after a save and load; FP8 activations and the
other kinds stay simulated, and say why."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bitmosaic
from bitmosaic.algorithms.rtn import rtn_quantize
from bitmosaic.formats.act import ActQuantSpec, fake_quant
from bitmosaic.formats.grid import IntGrid
from bitmosaic.modules import QuantLinear, QuantModule, attach_input_quant
from bitmosaic.modules.intact import ACT_COMPUTE_ENV, IntActKernel, act_path_label
from tests.helpers import env_var, word_tokenizer
from tests.methods.saved_bytes import calib, tiny_llama


def simulated():
    return env_var(ACT_COMPUTE_ENV, "sim")


def _layer(out, inp, bits, gs, sym, spec, seed, act_order=False):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, inp, generator=g)
    res = rtn_quantize(W, IntGrid(bits, sym), gs)
    if act_order:  # groups of scattered columns (GPTQ act-order): a permuted group map
        perm = torch.randperm(inp, generator=g)
        res.g_idx = res.g_idx[perm]
        res.codes = res.codes[:, perm]
    m = QuantLinear.from_result(
        res, bits=bits, group_size=gs, symmetric=sym, bias=torch.randn(out, generator=g)
    )
    scale = None
    if spec.static:
        x0 = torch.randn(64, inp, generator=g) * 2
        scale = x0.abs().amax().reshape(1) / spec.qmax if spec.granularity == "tensor" else None
        if spec.granularity == "group":
            scale = x0.abs().reshape(64, -1, spec.group_size).amax((0, 2)) / spec.qmax
    attach_input_quant(m, spec, inp, scale)
    return m, g


def _close(y_int, y_sim, x_q, w, bias=None):
    """Equal up to float32 rounding: two float32 sums of the same K products (and the bias, which the
    caller subtracts again) in different orders differ by at most 2 γ_{K+2} (Σ|Q(x)| |W| + |b|)
    (γ_n ≈ n u, u = 2⁻²⁴: the recursive-summation bound, Higham, *Accuracy and Stability of Numerical
    Algorithms*, §4.2).  (The flat ``2e-6 Σ|Q(x)| |W| + 1e-6`` this replaces left out the bias and the
    summation length: drawn MosaicQuant cases failed it on main too, with 35 ulps over K = 64 terms, and
    with 1.9e-6 on an output whose only term was a bias of 16.)"""
    bound = x_q.abs().double() @ w.abs().double().T
    if bias is not None:
        bound = bound + bias.detach().abs().double()
    gamma = (w.shape[-1] + 2) * 2.0**-24
    assert torch.all((y_int.double() - y_sim.double()).abs() <= bound * 2 * gamma + 1e-6)


@settings(max_examples=25, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    gs=st.sampled_from([-1, 16, 32, 64]),
    sym=st.booleans(),
    gran=st.sampled_from(["token", "tensor-static", "tensor", "group-static", "group"]),
    agroup=st.sampled_from([16, 32, 64]),
    abits=st.sampled_from([8, 4]),
    act_order=st.booleans(),
    M=st.sampled_from([1, 3, 12]),
    seed=st.integers(0, 2**16),
    clip=st.sampled_from([1.0, 0.9, 0.75]),
)
def test_layer_int_path_matches_simulated(bits, gs, sym, gran, agroup, abits, act_order, M, seed, clip):
    """Activation groups that hold whole weight groups, and groups finer than the weight's (per-row or
    g64 weights with activations per 16/32: the weight groups split, ``act_weight_groups``)."""
    static = gran.endswith("-static")
    gran = gran.split("-")[0]
    if gran == "group" and act_order:
        gran = "tensor"
    spec = ActQuantSpec("int", abits, granularity=gran, group_size=agroup, static=static, clip_ratio=clip)
    m, g = _layer(24, 128, bits, gs, sym, spec, seed, act_order)
    x = torch.randn(2, M, 128, generator=g) * 2
    with torch.inference_mode():
        assert m.runs_int_act(x)
        y = m(x)
        assert isinstance(m._int_act, IntActKernel)
        with simulated():
            assert not m.runs_int_act(x)
            y_sim = m(x)
    w = m.dequantize_reference()
    _close(y - m.bias, y_sim - m.bias, fake_quant(x, spec, m.input_quant.scale), w, m.bias)
    assert y.shape == y_sim.shape == (2, M, 24)


@pytest.mark.parametrize("gs, agroup", [(-1, 64), (32, 16), (-1, 32)])
def test_finer_activation_groups_with_a_partial_last_group(gs, agroup):
    """96 input columns: activation groups of 64 leave a last group of 32 (and per-row weights split into
    them); the integer path still matches the simulated one."""
    spec = ActQuantSpec("int", 8, granularity="group", group_size=agroup)
    m, g = _layer(20, 96, 4, gs, False, spec, 3)
    assert m.int_act_blocker() is None
    x = torch.randn(4, 96, generator=g) * 2
    with torch.inference_mode():
        y = m(x)
        assert isinstance(m._int_act, IntActKernel) and m._int_act.weight.group_size == agroup
        with simulated():
            y_sim = m(x)
    _close(y - m.bias, y_sim - m.bias, fake_quant(x, spec), m.dequantize_reference(), m.bias)


def test_activation_groups_that_neither_hold_nor_split_weight_groups_stay_simulated():
    m, _ = _layer(8, 96, 4, 32, True, ActQuantSpec("int", 8, granularity="group", group_size=48), 0)
    assert m.int_act_blocker() == (
        "activation groups of 48 neither hold whole weight groups of 32 nor split them into groups of a "
        "multiple of 8"
    )
    m, _ = _layer(8, 96, 4, 32, True, ActQuantSpec("int", 8, granularity="group", group_size=4), 0)
    assert m.int_act_blocker().startswith("activation groups of 4 neither")


def test_int_path_reads_unquantized_inputs():
    """The pre-hook leaves x alone on the integer path: quantizing twice would change nothing, so check
    that the module's kernel is what quantized (it receives the raw input)."""
    spec = ActQuantSpec("int", 4)
    m, g = _layer(8, 64, 4, 32, True, spec, 0)
    seen = []
    m.register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))
    x = torch.randn(3, 64, generator=g)
    with torch.inference_mode():
        m(x)
        with simulated():
            m(x)
    assert torch.equal(seen[0], x)  # integer: raw input
    assert torch.equal(seen[1], fake_quant(x, spec))  # simulated: Q(x)


def test_fp8_activations_and_other_kinds_stay_simulated():
    m, _ = _layer(8, 64, 4, 32, True, ActQuantSpec("e4m3", 8, granularity="tensor", static=True), 0)
    x = torch.randn(3, 64)
    assert not m.runs_int_act(x) and "e4m3 activations: no CPU instruction" in act_path_label(
        m.int_act_blocker(), m.input_quant.spec
    )
    from bitmosaic.modules import KINDS

    assert sorted(k for k, c in KINDS.items() if c.INT_ACT_KERNELS) == ["mosaic", "packed", "packed+sq-act"]
    assert issubclass(KINDS["dpq"], QuantLinear) and not KINDS["dpq"].INT_ACT_KERNELS


def test_odd_group_size_stays_simulated():
    m, _ = _layer(8, 60, 4, 12, True, ActQuantSpec("int", 8), 0)
    assert m.int_act_blocker() == "group size 12 is not a multiple of 8"
    assert not m.runs_int_act(torch.randn(2, 60))


def _logits(model, tokens):
    with torch.inference_mode():
        return model(tokens).logits


@pytest.mark.parametrize(
    "method,options",
    [
        ("rtn", {"scheme": "W4A8", "group_size": 32}),
        ("gptq", {"scheme": "W3A8", "group_size": 32, "order": "act"}),
        ("awq", {"scheme": "W4A8", "group_size": 32}),
        ("smoothquant", {"scheme": "W8A8", "group_size": None}),
        ("smoothquant", {"scheme": "W4A8", "group_size": 32}),
        ("rtn", {"scheme": "W4A4", "group_size": 32}),
    ],
)
def test_methods_pick_the_int_path_and_match(method, options, tmp_path, capsys):
    from bitmosaic.io import load_quantized, save_quantized

    model = tiny_llama()
    bitmosaic.quantize_(model, method, calib(), progress=False, **options)
    layers = [m for m in model.modules() if isinstance(m, QuantModule) and m._modules.get("input_quant")]
    assert layers
    tokens = calib()[:2]
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda mod, a: inputs.setdefault(mod, a[0].clone())) for m in layers]
    y = _logits(model, tokens)
    for h in hooks:
        h.remove()
    assert all(isinstance(m._int_act, IntActKernel) for m in layers)
    with simulated():
        y_sim = _logits(model, tokens)
    # each layer: equal up to float32 rounding on the same input
    for m, x in inputs.items():
        with torch.inference_mode():
            y_int = m(x)
            with simulated():
                y_ref = m(x)
        _close(y_int, y_ref, fake_quant(x, m.input_quant.spec, m.input_quant.scale), m.dequantize_reference())
    # the model: a rounding difference may move an activation across a rounding boundary downstream
    # (one step of its grid), so the logits agree closely, not to the last bit
    assert (y - y_sim).abs().max() <= 1e-2 * y_sim.abs().max()
    assert (y.argmax(-1) == y_sim.argmax(-1)).float().mean() >= 0.95
    loaded, _ = load_quantized(
        save_quantized(model, tmp_path / "m", {"method": method}), load_tokenizer=False
    )
    y2 = _logits(loaded, tokens)
    assert torch.equal(y2, y)
    assert all(
        isinstance(m._int_act, IntActKernel)
        for m in loaded.modules()
        if isinstance(m, QuantModule) and m._modules.get("input_quant")
    )
    from bitmosaic.cli import main

    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "m"), "--layers"]) == 0
    out = capsys.readouterr().out
    abits = 4 if options["scheme"].endswith("A4") else 8
    rows = [ln for ln in out.splitlines() if ln.startswith("model.layers.")]
    label = act_path_label(None, ActQuantSpec("int", abits))  # int8 (avx512-vnni) here
    assert label.startswith(f"int{abits} (")
    assert rows and all(ln.endswith(label) for ln in rows)
    assert f"activations      int{abits} (" in out


def test_inspect_says_dpq_fp8_compute_is_simulated(tmp_path, capsys):
    from bitmosaic.cli import main
    from bitmosaic.io import save_quantized

    model = tiny_llama()
    bitmosaic.quantize_(model, "dpq", calib(), progress=False, bits=4, group_size=32)
    save_quantized(model, tmp_path / "d", {"method": "dpq"})
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "d"), "--layers"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("model.layers.")]
    assert rows and all(ln.endswith("simulated (e4m3 activations: no CPU instruction)") for ln in rows), out


def test_gradients_and_the_env_switch_take_the_simulated_path():
    m, g = _layer(8, 64, 4, 32, True, ActQuantSpec("int", 8), 0)
    x = torch.randn(3, 64, generator=g, requires_grad=True)
    assert not m.runs_int_act(x)  # the integer kernel has no gradient: the (float) simulated path
    assert m.runs_int_act(x.detach())
    with torch.no_grad():
        assert m.runs_int_act(x)
    os.environ[ACT_COMPUTE_ENV] = "nonsense"
    try:
        with pytest.raises(ValueError, match=r"\$BITMOSAIC_ACT_COMPUTE='nonsense' is not one of auto, sim"):
            m.runs_int_act(x.detach())
    finally:
        os.environ.pop(ACT_COMPUTE_ENV)


def _weight_only(bits=4, gs=32, act_order=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    res = rtn_quantize(torch.randn(24, 128, generator=g), IntGrid(bits, False), gs)
    if act_order:
        perm = torch.randperm(128, generator=g)
        res.g_idx, res.codes = res.g_idx[perm], res.codes[:, perm]
    return QuantLinear.from_result(res, bits=bits, group_size=gs, symmetric=False), g


@pytest.mark.parametrize(
    "bits, act_order, mode",
    [(4, False, "int8"), (2, False, "int8"), (4, True, "int8"), (8, False, "int8"), (4, False, "q8_0"),
     (4, True, "q8_0"), (3, False, "q8_0"), (4, False, "int16"), (4, True, "int16"), (8, False, "int16")],
)  # fmt: skip
def test_runtime_int8_activations_on_a_weight_only_layer(bits, act_order, mode):
    """``--runtime-act int8|q8_0``: a weight-only layer computes Q8(x) Wᵀ in integers, with per-token INT8
    scales or one per block of 32 (over the kernel's column order: an act-order layer's blocks are of
    its permuted columns), equal to fake-quantizing its input and multiplying by the float weight (up to
    float32 rounding), and nothing of it is saved; ``none`` takes it away (bit-identical to before)."""
    from bitmosaic.modules.intact import RUNTIME_ACT_SPECS, set_runtime_activations

    m, g = _weight_only(bits, act_order=act_order)
    model = torch.nn.Sequential(m)
    x = torch.randn(3, 5, 128, generator=g) * 3
    x[..., 7] *= 40  # one large channel: per-token and per-block scales differ
    keys = set(model.state_dict())
    with torch.inference_mode():
        y_wo = m(x)
        assert set_runtime_activations(model, mode) == 1
        assert set(model.state_dict()) == keys and m._modules.get("input_quant") is None
        y = m(x)
        assert isinstance(m._int_act, IntActKernel)
        spec = RUNTIME_ACT_SPECS[mode]
        qx = fake_quant(x, spec, None)
        perm = m._int_act.perm
        assert (perm is not None) == act_order
        if perm is not None and spec.granularity == "group":  # blocks over the stored column order
            qx = torch.empty_like(x)
            qx[..., perm] = fake_quant(x[..., perm], spec, None)
        _close(y, qx @ m.dequantize_reference().T, qx, m.dequantize_reference())
        assert not torch.equal(y, y_wo)  # it does quantize the input
        with simulated():  # nothing to gain from simulating it: the layer stays weight-only
            assert torch.equal(m(x), y_wo)
        assert set_runtime_activations(model, "none") == 0
        assert torch.equal(m(x), y_wo)


@pytest.mark.parametrize("mode", ["int16", "int8"])
def test_the_integer_kernel_holds_the_weight_alone(mode):
    """A layer whose forwards run the integer kernel keeps one resident copy of its weight: the integer
    kernel holds the saved buffers (its rebuilds equal them bit for bit: the state dict is unchanged) and
    the float kernel is dropped; a forward off the integer path (simulated) builds the float kernel again
    from it, bit for bit the weight-only outputs; taking the run-time quantizer away leaves the buffers
    held by the float kernel or puts them back, never loses them."""
    from bitmosaic.modules.base import prepare_kernels, resident_bytes
    from bitmosaic.modules.intact import set_runtime_activations

    m, g = _weight_only(4, act_order=True)  # act order: g_idx is rebuilt from the permutation too
    model = torch.nn.Sequential(m)
    names = {"qweight", "scales", "zeros", "g_idx"}
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 128, generator=g)
    with torch.inference_mode():
        prepare_kernels(model)
        y_wo, wo_bytes, k_bytes = m(x), resident_bytes(model), m._kernel.nbytes()
        assert names <= m._released
        set_runtime_activations(model, mode)
        prepare_kernels(model)  # the integer kernel instead of the float one
        assert m._int_act and not m._kernel and names <= m._released
        assert resident_bytes(model) == wo_bytes - k_bytes + m._int_act.nbytes()  # one copy, not two
        y = m(x)
        assert not torch.equal(y, y_wo)
        state = model.state_dict()
        assert set(state) == set(saved) and all(torch.equal(state[k], saved[k]) for k in saved)
        with simulated():  # weight-only again: the float kernel rebuilt from the integer one
            assert torch.equal(m(x), y_wo) and m._kernel
        assert torch.equal(m(x), y)
        set_runtime_activations(model, "none")  # the float kernel holds them now
        assert torch.equal(m(x), y_wo) and names <= m._released
        set_runtime_activations(model, mode)
        prepare_kernels(model)
        assert m._int_act and not m._kernel
        set_runtime_activations(model, "none")  # held by the integer kernel alone: put back first
        assert not m._released and all(torch.equal(m._buffers[k], saved[f"0.{k}"]) for k in names)
        assert torch.equal(m(x), y_wo)


def test_runtime_activations_keep_a_layers_own_quantizer_and_refuse_bad_values(monkeypatch):
    from bitmosaic.errors import OptionError
    from bitmosaic.modules.intact import RUNTIME_ACT_ENV, set_runtime_activations

    own, _ = _layer(8, 64, 4, 32, True, ActQuantSpec("int", 4), 0)  # W4A4: keeps its INT4 quantizer
    wo, _ = _weight_only()
    model = torch.nn.Sequential(own, wo)
    assert set_runtime_activations(model, "int8") == 1
    assert own.act_quantizer().spec.bits == 4 and wo.act_quantizer().spec.bits == 8
    monkeypatch.setenv(RUNTIME_ACT_ENV, "int4")
    match = r"\$BITMOSAIC_RUNTIME_ACT='int4' is not one of none, int8, q8_0, int16"
    with pytest.raises(OptionError, match=match):
        set_runtime_activations(model)


def _text(tmp_path):
    f = tmp_path / "text.txt"
    f.write_text("the cat sat on the mat and the dog ran in the park " * 20)
    return f


def test_runtime_activations_from_the_environment_on_load_and_in_eval(tmp_path, monkeypatch, capsys):
    """``$BITMOSAIC_RUNTIME_ACT=int8`` applies on every load path (``finish_load``); ``eval --runtime-act``
    says how many layers run it, refuses a float model in one line, and the saved folder never changes."""
    from bitmosaic.cli import main
    from bitmosaic.io import load_quantized, save_quantized
    from bitmosaic.modules.intact import RUNTIME_ACT_ENV

    model = tiny_llama()
    bitmosaic.quantize_(model, "rtn", calib(), progress=False, bits=4, group_size=32)
    path = save_quantized(model, tmp_path / "m", {"method": "rtn"}, tokenizer=word_tokenizer())
    before = sorted((f.name, f.read_bytes()) for f in path.iterdir())
    tokens = calib()[:2]
    y_wo = _logits(load_quantized(path, load_tokenizer=False)[0], tokens)
    monkeypatch.setenv(RUNTIME_ACT_ENV, "int8")
    loaded = load_quantized(path, load_tokenizer=False)[0]
    layers = [m for m in loaded.modules() if isinstance(m, QuantModule)]
    assert layers and all(m.act_quantizer() is not None for m in layers)
    y = _logits(loaded, tokens)
    assert all(isinstance(m._int_act, IntActKernel) for m in layers)
    assert not torch.equal(y, y_wo) and (y.argmax(-1) == y_wo.argmax(-1)).float().mean() >= 0.9
    monkeypatch.delenv(RUNTIME_ACT_ENV)
    assert sorted((f.name, f.read_bytes()) for f in path.iterdir()) == before
    capsys.readouterr()
    assert main(["eval", "smollm2-135m", "--runtime-act", "int8", "--max-windows", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --runtime-act int8 applies to the layers of a saved")
    args = ["--runtime-act", "int8", "--ppl", str(_text(tmp_path)), "--seqlen", "16"]
    assert main(["eval", str(path), *args]) == 0
    assert "runtime activations int8: 14 weight-only layers" in capsys.readouterr().out
