"""Every packed module kind runs its forward through the low-bit kernel (never a float weight) and
equals ``F.linear`` on its reference dequantization; act-order groups are made contiguous once."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from bitmosaic import quantize_
from bitmosaic.io import load_quantized, quantized_modules, save_quantized
from bitmosaic.modules.base import QuantModule, prepare_kernels
from tests.pipeline.test_pipeline import tiny_llama

KERNEL_RUNS = [
    ("gptq", {"bits": 4, "group_size": 32}),
    ("gptq", {"bits": 3, "group_size": 24, "order": "act", "static_groups": False}),  # g_idx, partial groups
    ("gptq", {"bits": 2, "group_size": -1, "symmetric": True}),
    ("gptq", {"bits": 8, "group_size": 32, "symmetric": True, "order": "act", "static_groups": True}),
    ("rtn", {"bits": 5, "group_size": 16}),
    ("babai", {"bits": 3, "group_size": 32, "clip": False}),  # code_offset, wider storage
    ("ssqr", {"bits": 3, "group_size": 32, "outlier_rate": 0.03}),
    ("hptq", {"target_bits": 3.5}),
    ("dpq", {"group_size": 32}),
]


def _quantized(method, opts):
    calib = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    m = tiny_llama()
    quantize_(m, method, calib, progress=False, **opts)
    return m, calib


def _close(y, ref, x, w):
    """Within float32 accumulation rounding, relative to sum |w||x| (loose: the kernel folds the
    zero-point, whose rounding scales with |c s| + |z s| rather than |w|)."""
    scale = (x.abs().float() @ w.abs().T).clamp_min(1e-6)
    assert float(((y.float() - ref.float()).abs() / scale).max()) < 1e-4


@pytest.mark.parametrize("method,opts", KERNEL_RUNS)
def test_kernel_forward_equals_reference(method, opts):
    m, _ = _quantized(method, opts)
    q = quantized_modules(m)
    assert q
    g = torch.Generator().manual_seed(1)
    for name, mod in q.items():
        assert mod.kernel() is not None, f"{name} ({mod.kind}) has no kernel"
        w = mod.dequantize_reference(torch.float32)
        aq = getattr(mod, "input_quant", None)  # W4A8 kinds fake-quantize their input first
        for shape in ((1, mod.in_features), (2, 5, mod.in_features), (33, mod.in_features)):
            x = torch.randn(*shape, generator=g)
            with torch.no_grad():
                y = mod(x)
                xq = aq(x) if aq is not None else x
                ref = F.linear(xq.double(), w.double(), None if mod.bias is None else mod.bias.double())
            _close(y, ref, xq, w)
        xb = torch.randn(3, mod.in_features, generator=g).bfloat16()
        with torch.no_grad():
            yb = mod(xb)
        assert yb.dtype == torch.bfloat16
        xbq = aq(xb).float() if aq is not None else xb.float()
        torch.testing.assert_close(yb.float(), F.linear(xbq, w), rtol=2e-2, atol=2e-2)
        assert mod._wcache is None


def _float_weights(mod: QuantModule) -> list[str]:
    """Float tensors of at least ``out * in / 2`` elements reachable from the module's attributes."""
    big = mod.in_features * mod.out_features // 2
    seen = []

    def walk(obj, path, depth=0):
        if depth > 4:
            return
        if torch.is_tensor(obj):
            stored = obj.values().numel() if obj.layout != torch.strided else obj.numel()
            if obj.is_floating_point() and stored >= big:
                seen.append(path)
            return
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}[{k!r}]", depth + 1)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]", depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module) or obj is mod:
            for k, v in vars(obj).items():
                walk(v, f"{path}.{k}", depth + 1)

    walk(mod, "module")
    return seen


@pytest.mark.parametrize("method,opts", [KERNEL_RUNS[0], KERNEL_RUNS[1], KERNEL_RUNS[6], KERNEL_RUNS[7]])
def test_loaded_model_holds_no_float_weight(tmp_path, method, opts):
    m, calib = _quantized(method, opts)
    save_quantized(m, tmp_path / "q", {"method": method})
    m2, _ = load_quantized(tmp_path / "q", load_tokenizer=False)
    prepare_kernels(m2)
    with torch.no_grad():
        m2(calib[:1])
        m2(calib[:2])
    for name, mod in quantized_modules(m2).items():
        assert mod.kernel() is not None
        assert _float_weights(mod) == [], name
        assert mod.kernel().nbytes() < 2 * mod.in_features * mod.out_features, name  # < a 16-bit copy


def test_act_order_is_a_load_time_permutation():
    m, _ = _quantized("gptq", {"bits": 4, "group_size": 16, "order": "act", "static_groups": False})
    mods = [mod for mod in quantized_modules(m).values() if mod.g_idx is not None]
    assert mods
    for mod in mods:
        k = mod.kernel()
        assert k.perm is not None
        assert torch.equal(mod.g_idx.long()[k.perm], torch.arange(mod.in_features) // mod.group_size)


def test_low_bit_kinds_decode_on_the_lut(monkeypatch):
    """By default the packed kinds at 1-3 storage bits run on the bit-plane LUT kernel (act-order
    gather inside its call, codes rebuilt exactly), wider ones in groups of 64 on LowBitWeight
    (kernels/select.py);
    $BITMOSAIC_KERNEL forces one where the kind lists it, and both kernels give the same outputs within
    float rounding."""
    from bitmosaic.kernels import lut
    from bitmosaic.kernels.lut import BitPlaneWeight
    from bitmosaic.kernels.qmatmul import LowBitWeight
    from bitmosaic.kernels.select import KERNEL_ENV

    if lut.extension() is None:
        pytest.skip("no C++ compiler: the LUT kernel is not used without its compiled path")
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    m3, _ = _quantized("gptq", {"bits": 3, "group_size": 24, "order": "act", "static_groups": False})
    m4, _ = _quantized("gptq", {"bits": 4, "group_size": 64})  # g32 would go to the LUT (select.py)
    mods3, mods4 = list(quantized_modules(m3).values()), list(quantized_modules(m4).values())
    assert all(isinstance(mod.kernel().weight, BitPlaneWeight) for mod in mods3)
    assert all(isinstance(mod.kernel().weight, LowBitWeight) for mod in mods4)
    g = torch.Generator().manual_seed(3)
    xs = {id(mod): torch.randn(3, mod.in_features, generator=g) for mod in mods3}
    with torch.no_grad():
        lut_out = {id(mod): mod(xs[id(mod)][:1]) for mod in mods3}
    monkeypatch.setenv(KERNEL_ENV, "lowbit")
    for mod in mods3:
        assert "qweight" in mod._released  # the bit-plane kernel rebuilt the packed codes exactly
        mod._restore_saved()  # buffers back from the LUT kernel, which is dropped
        assert isinstance(mod.kernel().weight, LowBitWeight)
        w = mod.dequantize_reference(torch.float32)
        with torch.no_grad():
            _close(lut_out[id(mod)], mod(xs[id(mod)][:1]).double(), xs[id(mod)][:1], w)
    monkeypatch.setenv(KERNEL_ENV, "lut")
    mods4[0]._restore_saved()
    assert isinstance(mods4[0].kernel().weight, BitPlaneWeight)
    monkeypatch.setenv(KERNEL_ENV, "fastest")
    mods4[0]._restore_saved()
    with pytest.raises(ValueError, match="BITMOSAIC_KERNEL='fastest' is not one of auto"):
        mods4[0].kernel()
