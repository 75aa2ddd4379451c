"""Resident weights ~ packed size: once a quantized module's kernel weight is built, the
saved buffers it rebuilds exactly are released, and everything that reads them (state_dict, saving,
dequantize_reference, bits_per_weight, device moves, the weight cache) gets them back bit for bit."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from bitmosaic import quantize_
from bitmosaic.io import load_quantized, quantized_modules, save_quantized
from bitmosaic.modules import set_weight_cache
from bitmosaic.modules.base import QuantModule, prepare_kernels, resident_bytes
from bitmosaic.modules.intact import ACT_COMPUTE_ENV
from tests.kernels.test_kernel_modules import KERNEL_RUNS, _close, _quantized

KIND_RUNS = [KERNEL_RUNS[i] for i in (0, 1, 2, 5, 6, 7, 8)]  # packed (+act, sym, offset), csr, huffman, dpq
KIND_RUNS += [
    ("mosaic", {"scheme": "W4A8", "block": "32x32", "budget": 0.25}),  # dense base + residual blocks
]


def _snapshot(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _assert_same_state(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def _has_meta(mod: QuantModule) -> bool:
    return any(b is not None and b.device.type == "meta" for b in mod._buffers.values())


@pytest.mark.parametrize("method,opts", KIND_RUNS)
def test_released_buffers_rebuild_exactly(method, opts, monkeypatch):
    # mosaic W4A8 runs integer activations by default (kernels/mosaic.py), which never builds the
    # weight kernel whose resident buffers this test checks: run it on the simulated (weight kernel) path
    monkeypatch.setenv(ACT_COMPUTE_ENV, "sim")
    m, calib = _quantized(method, opts)
    qmods = quantized_modules(m)
    before = _snapshot(m)
    refs = {n: mod.dequantize_reference(torch.float32) for n, mod in qmods.items()}
    bpw = {n: mod.bits_per_weight() for n, mod in qmods.items()}
    with torch.no_grad():
        m(calib[:2])
    for name, mod in qmods.items():
        assert mod._kernel, name
        big = max(mod.storage_tensors(), key=lambda t: t.numel())  # rebuilt, read through the attribute
        assert mod._released, f"{name} ({mod.kind}) released nothing"
        assert _has_meta(mod) and big.device.type == "cpu"
        assert torch.equal(mod.dequantize_reference(torch.float32), refs[name]), name
        assert mod.bits_per_weight() == bpw[name], name
    _assert_same_state(before, _snapshot(m))
    with torch.no_grad():  # forward equal to the reference dequantization, buffers still released
        for mod in qmods.values():
            x = torch.randn(3, mod.in_features)
            w = mod.dequantize_reference(torch.float32)
            xq = mod.input_quant(x) if hasattr(mod, "input_quant") else x
            _close(mod(x), F.linear(xq.double(), w.double()), xq, w)
            assert mod._released


def test_device_move_and_weight_cache_put_buffers_back():
    m, calib = _quantized(*KERNEL_RUNS[1])  # act-order: g_idx released too
    before = _snapshot(m)
    with torch.no_grad():
        y0 = m(calib[:2]).logits
    mods = list(quantized_modules(m).values())
    assert all(mod._released and _has_meta(mod) for mod in mods)
    m.to("cpu")  # a device move restores every buffer and drops the kernel
    assert all(not mod._released and not _has_meta(mod) and mod._kernel is None for mod in mods)
    _assert_same_state(before, _snapshot(m))
    set_weight_cache(m, True)
    with torch.no_grad():
        y1 = m(calib[:2]).logits  # float weights from the buffers
    set_weight_cache(m, False)
    with torch.no_grad():
        y2 = m(calib[:2]).logits  # the kernel again, built and released once more
    assert all(mod._released for mod in mods)
    torch.testing.assert_close(y1, y0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y2, y0, rtol=0, atol=0)
    m.to(torch.bfloat16)  # a dtype cast keeps the stored formats
    stored = [
        f"{n}.{b}" for n, mod in quantized_modules(m).items() for b in ("qweight", "scales", "zeros", "g_idx")
    ]
    after = _snapshot(m)
    _assert_same_state({k: before[k] for k in stored}, {k: after[k] for k in stored})


def test_assigning_a_released_buffer_restores_the_others():
    m, calib = _quantized(*KERNEL_RUNS[0])
    mod = next(iter(quantized_modules(m).values()))
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    mod.kernel()
    assert "qweight" in mod._released
    mod.scales = before["scales"].clone()
    assert not mod._released and mod._kernel is None
    _assert_same_state(before, {k: v.clone() for k, v in mod.state_dict().items()})


def _digest(folder) -> dict[str, str]:
    files = sorted(p for p in folder.iterdir() if p.is_file())
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.mark.parametrize("method,opts", [KERNEL_RUNS[1], KERNEL_RUNS[6], KERNEL_RUNS[7], KERNEL_RUNS[8]])
def test_save_after_forward_reproduces_the_files(tmp_path, method, opts):
    m, calib = _quantized(method, opts)
    save_quantized(m, tmp_path / "a", {"method": method})
    m2, _ = load_quantized(tmp_path / "a", load_tokenizer=False)
    save_quantized(m2, tmp_path / "b", {"method": method})  # before any kernel
    with torch.no_grad():
        m2(calib[:2])
    assert all(mod._released for mod in quantized_modules(m2).values())
    save_quantized(m2, tmp_path / "c", {"method": method})  # buffers rebuilt from the kernels
    assert _digest(tmp_path / "b") == _digest(tmp_path / "c")
    weights = "model.safetensors"
    assert (tmp_path / "a" / weights).read_bytes() == (tmp_path / "c" / weights).read_bytes()


def _wide_llama() -> LlamaForCausalLM:
    """Big enough linears (256..512 wide) for 128-column groups; a small vocabulary."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


def _stored_bytes(folder) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("bits,order", [(4, "natural"), (3, "act")])
def test_loaded_model_resident_bytes_near_packed_size(tmp_path, bits, order):
    m = _wide_llama()
    calib = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    quantize_(m, "gptq", calib, bits=bits, group_size=128, order=order, progress=False)
    save_quantized(m, tmp_path / "q", {"method": "gptq"})
    m2, _ = load_quantized(tmp_path / "q", load_tokenizer=False)
    stored = _stored_bytes(tmp_path / "q")
    held_before = resident_bytes(m2)
    prepare_kernels(m2)
    with torch.no_grad():
        m2(calib[:1])
    held = resident_bytes(m2)
    assert held <= 1.10 * stored, (held, stored)
    assert held_before <= 1.0 * stored + 4096  # before the kernels: just the saved tensors
    assert held < 0.6 * (held_before + sum(mod._kernel.nbytes() for mod in quantized_modules(m2).values()))
