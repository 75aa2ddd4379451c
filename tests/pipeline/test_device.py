"""Devices and dtypes, from the flags to the pipeline: ``resolve_device`` / ``resolve_dtype``,
``load_model(dtype=...)`` and ``perplexity(device=...)`` (CUDA availability monkeypatched, no GPU
needed), and the calibration pipeline's offloading, error cleanup and non-finite inputs.

Every pipeline device test runs on the CPU and, where CUDA is available (the lent GPU), on CUDA as
well: the model stays in host memory and each decoder layer visits the device in turn.
"""

from __future__ import annotations

import json

import pytest
import torch

from bitmosaic import quantize_
from bitmosaic.devices import resolve_device
from bitmosaic.errors import BitmosaicError, CorruptModelError, DeviceError, NonFiniteError
from bitmosaic.io import load_model, load_quantized, quantized_modules, save_quantized
from bitmosaic.io.sources.loading import checkpoint_dtype, resolve_dtype, resolve_model_spec
from tests.helpers import quantized_dir, save_hf_dir
from tests.helpers import tiny_llama as tiny_hf_llama
from tests.pipeline.test_pipeline import tiny_llama


def _cuda(monkeypatch, available: bool, count: int = 1):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count if available else 0)


def test_resolve_device_auto(monkeypatch):
    _cuda(monkeypatch, False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(None) == torch.device("cpu")
    _cuda(monkeypatch, True)
    assert resolve_device("auto") == torch.device("cuda")


def test_resolve_device_explicit(monkeypatch):
    _cuda(monkeypatch, True, count=2)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(DeviceError, match="cuda:2.*2 CUDA device"):
        resolve_device("cuda:2")


def test_resolve_device_cuda_unavailable_is_clear(monkeypatch):
    _cuda(monkeypatch, False)
    with pytest.raises(DeviceError) as ei:
        resolve_device("cuda")
    msg = str(ei.value)
    assert "CUDA is not available" in msg and "--device cpu" in msg and "\n" not in msg
    assert isinstance(ei.value, BitmosaicError)


def test_resolve_device_bad_name():
    with pytest.raises(DeviceError, match="auto, cpu, cuda"):
        resolve_device("tpu")


def test_resolve_dtype_names():
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) is torch.float32
    assert resolve_dtype("bfloat16", cpu) is torch.bfloat16
    assert resolve_dtype("float16", cpu) is torch.float16
    assert resolve_dtype(torch.float16, cpu) is torch.float16
    with pytest.raises(DeviceError, match="float32, bfloat16, float16"):
        resolve_dtype("int8", cpu)


def test_resolve_dtype_auto(tmp_path):
    m = tiny_hf_llama().to(torch.bfloat16)
    src = save_hf_dir(tmp_path / "bf16", model=m)
    assert checkpoint_dtype(str(src)) is torch.bfloat16
    # auto: float32 on CPU runs; the checkpoint's dtype on CUDA runs
    assert resolve_dtype("auto", torch.device("cpu"), str(src)) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda"), str(src)) is torch.bfloat16
    assert resolve_dtype(None, torch.device("cuda"), None) is torch.float32  # unknown -> float32
    f32 = save_hf_dir(tmp_path / "f32")
    assert resolve_dtype("auto", torch.device("cuda"), str(f32)) is torch.float32


def test_load_model_dtype(tmp_path):
    src = save_hf_dir(tmp_path / "m")
    model, _ = load_model(str(src), dtype="bfloat16")
    assert model.model.embed_tokens.weight.dtype is torch.bfloat16
    model, _ = load_model(str(src), dtype=torch.float16)
    assert model.model.layers[0].mlp.up_proj.weight.dtype is torch.float16


def test_load_quantized_dtype_casts_only_unquantized(tmp_path):
    out = quantized_dir(tmp_path / "q")
    model, _ = load_model(str(out), dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype is torch.bfloat16
    q = model.model.layers[0].self_attn.q_proj
    assert q.scales.dtype is torch.float16  # stored format kept
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        logits = model(ids).logits
    assert logits.dtype is torch.bfloat16 and torch.isfinite(logits).all()
    ref, _ = load_quantized(out, load_tokenizer=False)
    assert ref.model.embed_tokens.weight.dtype is torch.float32


def test_model_spec_with_broken_config(tmp_path):
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text("{nope")
    with pytest.raises(CorruptModelError, match="config.json"):
        resolve_model_spec(str(d))
    (d / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(CorruptModelError, match="config.json"):
        resolve_model_spec(str(d))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def calib():
    return torch.randint(0, 128, (6, 32), generator=torch.Generator().manual_seed(0))


def _codes(model):
    return {n: m.codes() for n, m in quantized_modules(model).items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opts", [{"order": "act", "static_groups": True}, {"order": "min-pivot"}])
def test_model_stays_on_host_and_matches_cpu(calib, device, opts):
    ref = tiny_llama()
    quantize_(ref, "gptq", calib, bits=4, group_size=32, progress=False, **opts)
    m = tiny_llama()
    rep = quantize_(m, "gptq", calib, bits=4, group_size=32, progress=False, device=device, **opts)
    assert rep.device == str(torch.device(device))
    assert {p.device.type for p in m.parameters()} == {"cpu"}
    assert {b.device.type for b in m.buffers()} == {"cpu"}
    a, b = _codes(ref), _codes(m)
    agree = sum(int((a[n] == b[n]).sum()) for n in a) / sum(a[n].numel() for n in a)
    assert agree == 1.0 if device == "cpu" else agree > 0.99  # GPU float32 rounding may differ


def test_offloaded_inputs_give_identical_results(calib):
    m1, m2 = tiny_llama(), tiny_llama()
    r1 = quantize_(m1, "gptq", calib, bits=3, group_size=32, progress=False, offload_inputs=False)
    r2 = quantize_(m2, "gptq", calib, bits=3, group_size=32, progress=False, offload_inputs=True)
    assert r2.calibration["offload_inputs"] is True and r1.calibration["offload_inputs"] is False
    a, b = _codes(m1), _codes(m2)
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("method", ["gptq", "rtn", "dpq", "smoothquant"])
def test_bfloat16_model_quantizes_saves_and_reloads(calib, method, tmp_path):
    m = tiny_llama().to(torch.bfloat16)
    opts = {"scheme": "W8A8", "group_size": None} if method == "smoothquant" else {"group_size": 32}
    quantize_(m, method, calib, progress=False, **opts)
    assert {p.dtype for n, p in m.named_parameters() if "norm" in n} == {torch.bfloat16}
    x = calib[:2]
    with torch.no_grad():
        y = m(x).logits.float()
    assert torch.isfinite(y).all()
    save_quantized(m, tmp_path / "q", {"method": method})
    m2, _ = load_quantized(tmp_path / "q", load_tokenizer=False)
    # the rotary table is not saved; `.to(bfloat16)` above rounded the in-memory one
    m2.model.rotary_emb.inv_freq = m.model.rotary_emb.inv_freq.clone()
    with torch.no_grad():
        y2 = m2(x).logits.float()
    assert torch.equal(y, y2)


def test_stacked_shared_hessian_rows_equal_separate_calls(calib):
    """q/k/v (and gate/up) share one Hessian and are quantized as one stacked matrix; the codes
    are those of separate per-linear GPTQ calls on the same Hessian."""
    from bitmosaic.algorithms import gptq_quantize, make_order
    from bitmosaic.formats.grid import IntGrid
    from bitmosaic.pipeline.calibration import LayerInputs, capture_layer_inputs
    from bitmosaic.pipeline.statistics import group_statistics

    m = tiny_llama(layers=1)
    layer = m.model.layers[0]
    group = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    inputs, kw = capture_layer_inputs(m, m.model.layers, calib, 4)
    accs, owner, _ = group_statistics(
        layer, group, LayerInputs(inputs, torch.device("cpu"), False), kw["default"]
    )
    assert len(accs) == 1 and set(owner.values()) == {"self_attn.q_proj"}
    H = accs["self_attn.q_proj"].H
    W = {n: layer.get_submodule(n).weight.detach().float().clone() for n in group}
    rep = quantize_(
        m,
        "gptq",
        calib,
        bits=4,
        group_size=32,
        progress=False,
        order="act",
        static_groups=True,
        scale_method="mse",
    )
    assert rep.layers[0]["stacked_with"] == ["self_attn.k_proj", "self_attn.v_proj"]
    q = quantized_modules(m)
    for n in group:
        ref = gptq_quantize(
            W[n], H, IntGrid(4), 32, perm=make_order(H, "act"), static_groups=True, scale_method="mse"
        )
        assert torch.equal(q[f"model.layers.0.{n}"].codes(), ref.codes), n


def test_output_cache_patches_removed_when_quantization_raises(calib):
    from bitmosaic.methods import get_method

    m = tiny_llama()
    spec = get_method("gptq")
    calls = {"n": 0}
    orig = spec.quantize

    def failing(W, stats, cfg, state=None, name=None):
        calls["n"] += 1
        if calls["n"] == 3:  # after q/k/v and o_proj were quantized and their outputs cached
            raise RuntimeError("solver failed")
        return orig(W, stats, cfg, state, name)

    spec.quantize = failing  # the registered instance: patched on the instance, restored below
    try:
        with pytest.raises(RuntimeError, match="solver failed"):
            quantize_(m, "gptq", calib, bits=4, group_size=32, progress=False, cache_outputs=True)
    finally:
        del spec.quantize
    assert not any("forward" in vars(mod) for mod in m.modules())


def test_nan_weight_and_activation_give_clear_errors(calib):
    m = tiny_llama()
    with torch.no_grad():
        m.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    with pytest.raises(NonFiniteError, match=r"model\.layers\.1\.mlp\.up_proj"):
        quantize_(m, "gptq", calib, bits=4, group_size=32, progress=False)
    m = tiny_llama()
    with torch.no_grad():
        m.model.layers[0].post_attention_layernorm.weight[0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"model\.layers\.0"):
        quantize_(m, "gptq", calib, bits=4, group_size=32, progress=False)


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None, tiny_llama()) == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_learned_rotation_runs_on_the_device_and_leaves_the_model_on_host(calib, device):
    """``--rotate spinquant`` learns on the run's device (the whole float model moved there and back):
    the model ends on the host, unchanged as a float function, and the first step's loss is the
    CPU's (the GPU's float32 rounding aside)."""
    from bitmosaic.formats.act import ActQuantSpec
    from bitmosaic.models.arch import get_arch
    from bitmosaic.pipeline.rotate import rotate_model

    act = ActQuantSpec("int", 4)
    infos, outs = {}, {}
    for where in dict.fromkeys(["cpu", device]):
        m = tiny_llama()
        with torch.no_grad():
            ref = m(calib[:2]).logits
        infos[where] = rotate_model(m, get_arch(m), "spinquant:steps=2,lr=1.5,batch=3", calib=calib, act=act,
                                    device=torch.device(where))  # fmt: skip
        assert {p.device.type for p in m.parameters()} == {"cpu"}
        with torch.no_grad():
            outs[where] = m(calib[:2]).logits
        assert (outs[where] - ref).abs().max() <= 1e-4 * ref.abs().max()
    first = {k: v["learned"]["loss_first"] for k, v in infos.items()}
    assert first[device] == pytest.approx(first["cpu"], rel=1e-4)
    assert infos[device]["learned"]["batch"] == 3
