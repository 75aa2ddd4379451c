"""One base for every quantized module kind: the cache logic exists once, is keyed by dtype, covers
every kind, and dtype casts of a model never touch the stored format; no-clip codes are stored at
the smallest width 2-8 that holds them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bitmosaic import quantize_
from bitmosaic.algorithms.types import QuantResult
from bitmosaic.formats.grid import fp16_exact
from bitmosaic.formats.layout import default_g_idx, num_groups
from bitmosaic.io import quantized_modules
from bitmosaic.modules import MODULE_KINDS, QuantLinear, UnpackableCodesError, set_weight_cache
from bitmosaic.modules.base import QuantModule
from tests.pipeline.test_pipeline import tiny_llama

KIND_RUNS = [
    ("gptq", {"bits": 3, "group_size": 32}),
    ("ssqr", {"bits": 3, "group_size": 32, "outlier_rate": 0.03}),
    ("hptq", {"target_bits": 3.5}),
    ("dpq", {"group_size": 32}),
    ("fp8", {}),
]


def _quantized_tiny(method, opts):
    calib = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    m = tiny_llama()
    quantize_(m, method, calib, progress=False, **opts)
    return m, calib


def _result(codes: torch.Tensor, group_size: int, seed: int = 0) -> QuantResult:
    """An asymmetric result around ``codes`` with fp16-exact scales and zero-points."""
    out, n = codes.shape
    g = torch.Generator().manual_seed(seed)
    G = num_groups(n, group_size)
    scales = fp16_exact(torch.rand(out, G, generator=g) * 0.02 + 1e-3)
    zeros = torch.randint(0, 8, (out, G), generator=g).float()
    return QuantResult(codes.to(torch.int32), scales, zeros, default_g_idx(n, group_size))


def test_every_kind_shares_the_base_and_none_overrides_the_cache():
    for kind, cls in MODULE_KINDS.items():
        assert issubclass(cls, QuantModule), kind
        for shared in ("dequantize_weight", "set_weight_cache", "forward", "bits_per_weight", "_apply"):
            assert shared not in vars(cls), f"{kind} re-implements {shared}"


@pytest.mark.parametrize("method,opts", KIND_RUNS)
def test_cache_and_casts_keep_the_stored_format(method, opts):
    m, calib = _quantized_tiny(method, opts)
    q = quantized_modules(m)
    ref = {n: mod.dequantize_reference() for n, mod in q.items()}
    stored = {
        n: {k: (b.dtype, b.clone()) for k, b in mod.named_buffers(recurse=False)} for n, mod in q.items()
    }
    set_weight_cache(m, True)
    for n, mod in q.items():
        assert torch.equal(mod.dequantize_weight(), ref[n]), n
        assert mod._wcache is not None  # every kind honours the cache
    set_weight_cache(m, False)
    assert all(not mod.cache_weight and mod._wcache is None for mod in q.values())  # every kind
    m.to(torch.bfloat16)
    m.half()
    for n, mod in q.items():
        for k, b in mod.named_buffers(recurse=False):
            dtype, value = stored[n][k]
            assert b.dtype == dtype and torch.equal(b, value), (n, k)
        assert torch.equal(mod.dequantize_weight(), ref[n]), n
        if mod.bias is not None:
            assert mod.bias.dtype == torch.float16  # the bias is an ordinary float parameter
    m.float()
    x = calib[:1]
    with torch.no_grad():
        assert torch.isfinite(m(x).logits).all()


@pytest.mark.parametrize("method,opts", KIND_RUNS)
def test_cached_weight_is_keyed_by_dtype(method, opts):
    """A weight cached in one dtype must not be served (upcast) for another."""
    m, _ = _quantized_tiny(method, opts)
    set_weight_cache(m, True)
    for n, mod in quantized_modules(m).items():
        mod._wcache = None
        w16 = mod.dequantize_weight(torch.float16)
        assert torch.equal(w16, mod.dequantize_reference(torch.float16)), n
        assert torch.equal(mod.dequantize_weight(torch.float32), mod.dequantize_reference(torch.float32)), n
        assert torch.equal(mod.dequantize_weight(torch.float16), w16), n


def test_loading_a_state_dict_drops_the_cached_weight():
    g = torch.Generator().manual_seed(2)
    a = QuantLinear.from_result(
        _result(torch.randint(0, 16, (8, 24), generator=g), 8, 0), bits=4, group_size=8, symmetric=False
    )
    b = QuantLinear.from_result(
        _result(torch.randint(0, 16, (8, 24), generator=g), 8, 1), bits=4, group_size=8, symmetric=False
    )
    a.cache_weight = True
    a.dequantize_weight()
    a.load_state_dict(b.state_dict())
    assert torch.equal(a.dequantize_weight(), b.dequantize_reference())


def test_bias_follows_casts_and_forward_matches_linear():
    from bitmosaic.algorithms.rtn import rtn_quantize
    from bitmosaic.formats.grid import IntGrid

    W = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(8)
    res = rtn_quantize(W, IntGrid(4), 8)
    q = QuantLinear.from_result(res, bits=4, group_size=8, symmetric=False, bias=bias)
    x = torch.randn(3, 16)
    # the low-bit kernel sums in its own order: equal within float32 rounding
    torch.testing.assert_close(q(x), nn.functional.linear(x, res.dequantize(), bias), rtol=1e-5, atol=1e-5)


# (lowest code, number of distinct codes): straddling zero, above the grid, all negative
def _span(where: str, need: int) -> tuple[int, int]:
    n = 1 << need
    return {"straddle": (-(n // 2), n), "above": (0, n), "negative": (-1000, n)}[where]


@pytest.mark.parametrize("where", ["straddle", "above", "negative"])
@pytest.mark.parametrize("need", range(2, 9))
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_no_clip_codes_stored_at_the_smallest_width_that_holds_them(bits, need, where):
    lo, n = _span(where, need)
    g = torch.Generator().manual_seed(need * 10 + bits)
    codes = torch.randint(lo, lo + n, (6, 21), generator=g)  # 21: not a multiple of 8
    codes[0, 0], codes[-1, -1] = lo, lo + n - 1  # both ends of the span
    res = _result(codes, 8, seed=need)
    q = QuantLinear.from_result(res, bits=bits, group_size=8, symmetric=False)
    inside = lo >= 0 and lo + n - 1 < (1 << bits)
    assert q.storage_bits == (bits if inside else max(need, bits))
    assert q.code_offset == min(lo, 0)
    assert torch.equal(q.codes(), codes.to(torch.int32))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        ref = res.dequantize(dtype)
        assert torch.equal(q.dequantize_reference(dtype), ref)
        assert torch.equal(q.dequantize_weight(dtype), ref)


def test_no_clip_codes_wider_than_8_bits_are_rejected():
    codes = torch.tensor([[-200, 0, 100, 3]])  # 301 distinct values need 9 bits
    with pytest.raises(UnpackableCodesError, match=r"\[-200, 100\], which need 9 bits"):
        QuantLinear.from_result(_result(codes, 4), bits=4, group_size=4, symmetric=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method,opts", KIND_RUNS)
def test_every_kind_runs_on_the_buffers_device(method, opts):
    m, calib = _quantized_tiny(method, opts)
    q = quantized_modules(m)
    ref = {n: mod.dequantize_weight() for n, mod in q.items()}
    m.to("cuda")
    for n, mod in q.items():
        w = mod.dequantize_weight()
        assert w.device.type == "cuda" and torch.equal(w.cpu(), ref[n]), n
    with torch.no_grad():
        assert torch.isfinite(m(calib[:1].to("cuda")).logits).all()
