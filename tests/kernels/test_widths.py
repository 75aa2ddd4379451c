"""Every packing width 2-8 end to end, and the DPQ no-clip weight."""

from __future__ import annotations

import pytest
import torch

from bitmosaic import quantize_
from bitmosaic.io import load_quantized, quantized_modules, save_quantized
from tests.pipeline.test_pipeline import tiny_llama


@pytest.mark.parametrize("bits", [5, 6, 7])
@pytest.mark.parametrize("method", ["gptq", "rtn"])
def test_odd_widths_quantize_save_and_reload(tmp_path, bits, method):
    """`--bits 5|6|7` used to be accepted and then fail in packing after layer 0."""
    calib = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    m = tiny_llama()
    rep = quantize_(m, method, calib, bits=bits, group_size=32, progress=False)
    assert all(q.storage_bits == bits for q in quantized_modules(m).values())
    assert rep.bits_per_weight >= bits
    out = save_quantized(m, tmp_path / f"w{bits}", {"method": method, "bits": bits})
    m2, _ = load_quantized(out, load_tokenizer=False)
    for name, q in quantized_modules(m2).items():  # the fast kernel serves every width bitwise
        assert q.storage_bits == bits and torch.equal(q.dequantize_weight(), q.dequantize_reference()), name
    x = calib[:2]
    with torch.no_grad():
        assert torch.equal(m(x).logits, m2(x).logits)


def test_dpq_no_clip_module_applies_fp8_once():
    """With no-clip codes outside 0..15 the packed module used to apply the FP8 rounding and the
    FP8 weight scale twice (a subclass's reference reached from the base's fast path)."""
    from bitmosaic.algorithms.dpq import dpq_quantize
    from bitmosaic.algorithms.hessian import HessianAccumulator
    from bitmosaic.modules.qmodules import FP8ComputeQuantLinear
    from tests.conftest import correlated_inputs

    X = correlated_inputs(512, 64, seed=3, dtype=torch.float32)
    acc = HessianAccumulator(64)
    acc.add(X)
    W = torch.randn(32, 64, generator=torch.Generator().manual_seed(4)) * 0.05
    W[:, :3] *= 8
    res = dpq_quantize(W, acc.H, group_size=32, clip=False)
    assert int(res.codes.min()) < 0 or int(res.codes.max()) > 15  # really outside the grid
    m = FP8ComputeQuantLinear.from_result(res, bits=4, group_size=32, symmetric=False)
    assert m.code_offset != 0
    assert torch.equal(m.dequantize_weight(), res.dequantize(torch.float32))
    assert torch.equal(m.dequantize_reference(), res.dequantize(torch.float32))
