"""``torch.compile(model, fullgraph=True, dynamic=False)`` traces a quantized model whole (the kernels are
``torch.library`` operators, kernels/ops.py) and gives the eager logits: W4 on ``LowBitWeight``, W2 on
the bit-plane LUT, W4 with run-time INT8 and INT16 activations on the integer kernel, MXFP4/NVFP4 on the
FP4 LUT."""

from __future__ import annotations

import pytest
import torch

from bitmosaic.kernels import fp4lut, intmm, lut
from bitmosaic.kernels.lut import BitPlaneWeight
from bitmosaic.kernels.qmatmul import LowBitWeight
from bitmosaic.modules.base import QuantModule, prepare_kernels
from tests.io.test_compiled_decode import prompt, quantized_tiny


@pytest.mark.parametrize(
    "bits, runtime_act, kernel",
    [(4, None, LowBitWeight), (2, None, BitPlaneWeight), (4, "int8", None), (4, "int16", None)],
    ids=["w4-lowbit", "w2-lut", "w4-int8act", "w4-int16act"],
)
def test_compiled_forward_equals_eager(bits, runtime_act, kernel):
    if kernel is BitPlaneWeight and lut.extension() is None:
        pytest.skip("no C++ compiler: W2 runs LowBitWeight, not the LUT")
    if runtime_act and intmm.extension() is None:
        pytest.skip("no C++ compiler for the integer kernel")
    torch._dynamo.reset()
    # g64: LowBitWeight runs groups of whole 64-code spans (smaller ones go to the LUT, kernels/select.py)
    m = quantized_tiny(bits, runtime_act, group_size=64)
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
    if runtime_act != "int16":
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    # 16-bit steps are fine enough that inductor's reassociated float ops (norms, residuals) move some
    # inputs across a rounding boundary: each such flip moves an output by one step s = amax / 32639, so
    # the compiled logits differ from eager about as much as int16 differs from the float path -- and
    # hundreds of times less than int8 does (measured: 3e-4, 5e-4 and 0.16 at a logit scale of 5)
    scale = float(ref.abs().max())
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-4 * scale)
    from bitmosaic.modules.intact import set_runtime_activations

    with torch.no_grad():
        set_runtime_activations(m, "none")
        wo = m(ids).logits
        set_runtime_activations(m, "int8")
        i8 = m(ids).logits
    assert (ref - wo).abs().max() < 2e-4 * scale < (i8 - wo).abs().max() / 20


@pytest.mark.parametrize("scheme", ["MXFP4A16", "NVFP4A16"])
def test_compiled_forward_of_fp4_modules(scheme):
    """The ``mx`` kind's FP4 LUT GEMV is the operator ``bitmosaic::fp4_gemv`` (kernels/fp4lut.py): dynamo
    records it without a graph break (``fullgraph=True`` on the whole tiny Llama; ``explain`` counts none),
    one node per MXFP4/NVFP4 linear, and inductor's compiled forward gives the eager logits -- at decode
    (1 token: the GEMV, as the extension's ``bitmosaic::fp4_gemv_ext``) and at prefill (40 tokens: the
    tiles inside ``bitmosaic::fp4_gemv``)."""
    if fp4lut.extension() is None:
        pytest.skip("no C++ compiler: FP4 layers run the reference tiles, not the LUT operator")
    from bitmosaic import quantize_
    from bitmosaic.testing import SPECIALS, VOCAB, tiny_llama

    torch._dynamo.reset()
    m = tiny_llama()
    calib = torch.randint(len(SPECIALS), VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    quantize_(m, "rtn", calib, scheme=scheme, progress=False)
    prepare_kernels(m)
    mods = [x for x in m.modules() if isinstance(x, QuantModule)]
    assert mods and all(isinstance(x._kernel.weight, fp4lut.FP4LutWeight) for x in mods)
    nodes: list[str] = []

    def backend(gm, example_inputs):  # records the graph's calls, runs it as traced
        nodes.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    with torch.no_grad():
        for length in (1, 40):
            ids = prompt(length)
            ref = m(ids).logits
            assert torch._dynamo.explain(m)(ids).graph_break_count == 0
            nodes.clear()
            torch._dynamo.reset()
            torch.compile(m, backend=backend, fullgraph=True, dynamic=False)(ids)
            op = "bitmosaic.fp4_gemv_ext.default" if length == 1 else "bitmosaic.fp4_gemv.default"
            assert nodes.count(op) == len(mods), nodes  # decode: the extension's operator, C++ directly
            out = torch.compile(m, fullgraph=True, dynamic=False)(ids).logits  # inductor
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
