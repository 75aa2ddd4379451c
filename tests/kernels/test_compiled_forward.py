"""``torch.compile(model, fullgraph=True, dynamic=False)`` traces a quantized model whole (the kernels are
``torch.library`` operators, kernels/ops.py) and gives the eager logits: W4 on ``LowBitWeight``, W2 on
the bit-plane LUT, W4 with run-time INT8 activations on the integer kernel."""

from __future__ import annotations

import pytest
import torch

from bitmosaic.kernels import intmm, lut
from bitmosaic.kernels.lut import BitPlaneWeight
from bitmosaic.kernels.qmatmul import LowBitWeight
from bitmosaic.modules.base import QuantModule, prepare_kernels
from tests.io.test_compiled_decode import prompt, quantized_tiny


@pytest.mark.parametrize(
    "bits, runtime_act, kernel",
    [(4, None, LowBitWeight), (2, None, BitPlaneWeight), (4, "int8", None)],
    ids=["w4-lowbit", "w2-lut", "w4-int8act"],
)
def test_compiled_forward_equals_eager(bits, runtime_act, kernel):
    if kernel is BitPlaneWeight and lut.extension() is None:
        pytest.skip("no C++ compiler: W2 runs LowBitWeight, not the LUT")
    if runtime_act and intmm.extension() is None:
        pytest.skip("no C++ compiler for the integer kernel")
    torch._dynamo.reset()
    m = quantized_tiny(bits, runtime_act)
    prepare_kernels(m)
    ids = prompt(12)
    with torch.no_grad():
        ref = m(ids).logits
        mods = [x for x in m.modules() if isinstance(x, QuantModule)]
        if kernel is not None:
            assert all(isinstance(x._kernel.weight, kernel) for x in mods)
        else:  # every layer runs the integer kernel (built by the eager forward)
            assert all(x._int_act for x in mods)
        compiled = torch.compile(m, fullgraph=True, dynamic=False)
        out = compiled(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
