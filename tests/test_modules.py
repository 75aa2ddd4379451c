"""One base for every quantized module kind: the cache logic exists once, and dtype casts of a
model never touch the stored format."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bitmosaic import quantize_
from bitmosaic.models import quantized_modules
from bitmosaic.modules import MODULE_KINDS, set_weight_cache
from bitmosaic.modules.base import QuantModule

from .test_pipeline import tiny_llama


def test_every_kind_shares_the_base_and_none_overrides_the_cache():
    for kind, cls in MODULE_KINDS.items():
        assert issubclass(cls, QuantModule), kind
        assert "dequantize_weight" not in vars(cls), f"{kind} re-implements the weight cache"


@pytest.mark.parametrize(
    "method,opts",
    [
        ("gptq", {"bits": 3, "group_size": 32}),
        ("ssqr", {"bits": 3, "group_size": 32, "outlier_rate": 0.03}),
        ("hptq", {"target_bits": 3.5}),
        ("dpq", {"group_size": 32}),
        ("fp8", {}),
    ],
)
def test_cache_and_casts_keep_the_stored_format(method, opts):
    calib = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    m = tiny_llama()
    quantize_(m, method, calib, progress=False, **opts)
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
    assert all(mod._wcache is None for mod in q.values() if mod.kind != "huffman")
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


def test_bias_follows_casts_and_forward_matches_linear():
    from bitmosaic.algorithms.rtn import rtn_quantize
    from bitmosaic.formats.grid import IntGrid
    from bitmosaic.modules import QuantLinear

    W = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(8)
    res = rtn_quantize(W, IntGrid(4), 8)
    q = QuantLinear.from_result(res, bits=4, group_size=8, symmetric=False, bias=bias)
    x = torch.randn(3, 16)
    assert torch.equal(q(x), nn.functional.linear(x, res.dequantize(), bias))
