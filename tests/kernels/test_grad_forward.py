"""A quantized model called outside ``torch.no_grad()`` (a plain ``model(ids)`` in a notebook, or a
loss for fine-tuning the float parts) runs and lets gradients through to the inputs: the CPU kernels
write into preallocated outputs, which autograd refuses, so such a forward takes the differentiable
dequantize-and-matmul path.  Before the fix every packed kind raised "mm(): functions with out=...
arguments don't support automatic differentiation"."""

import pytest
import torch

from bitmosaic import quantize_
from tests.helpers import tiny_llama

CASES = {
    "gptq": {"group_size": 32},
    "dpq": {"group_size": 32},
    "rtn-w4a8": {"group_size": 32, "scheme": "W4A8"},
    "ssqr": {"group_size": 32, "bits": 3},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_with_autograd_runs_and_matches_inference(case):
    m = tiny_llama()
    quantize_(m, case.split("-")[0], torch.randint(4, 100, (4, 32)), progress=False, **CASES[case])
    ids = torch.randint(4, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = m(ids).logits
    got = m(ids).logits  # records a graph: the embeddings' weight requires grad
    assert got.requires_grad
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    got.float().pow(2).mean().backward()
    grad = m.model.embed_tokens.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
