"""llama.cpp runs our MXFP4 GGUF (issue 75 item 4): a tiny model quantized with ``--scheme MXFP4A16``,
exported to GGUF (every linear a ggml ``MXFP4`` tensor, type 39), loaded by llama.cpp through
llama-cpp-python (skipped where the binding is not installed) and compared with bitmosaic's own logits.

llama.cpp's CPU backend multiplies an MXFP4 weight with the activations quantized to Q8_0 (8-bit, one
scale per 32: ``vec_dot_type`` of MXFP4 in ggml-cpu), so its logits are not ours bit for bit.  The
tolerances are measured (llama-cpp-python 0.3.36, relative Frobenius norm over 8 positions): the same saved
model exported as F32 runs in llama.cpp 0.005-0.006 from ours (llama.cpp's float path), the MXFP4 file
0.013-0.019 from ours (0.014-0.020 from the F32 file: the Q8_0 activations), while MXFP4 itself moves our
logits 0.29-0.40 from the float model -- 20x further, so a wrong block, scale or nibble order would show.

Architectures: llama, qwen2 and phi3 (its fused ``attn_qkv`` and ``ffn_up`` as MXFP4 too) run; every
quantized linear of the file is an MXFP4 tensor run by ggml's ``mul_mat`` (the token embeddings, the
output head and the norms keep the source file's types: Q8_0, Q5_0, F32 here).  Not covered, for reasons
that are not MXFP4's: tiny qwen3 files do not load in llama.cpp at
any type (``tiny_gguf`` writes no ``attention.key_length``, so llama.cpp expects 64-wide q heads of 16 and
finds transformers' default head_dim of 128), and gemma3 is refused by our GGUF export (its q/k norms do
not read back bit for bit).
"""

from __future__ import annotations

import pytest
import torch

import bitmosaic
from bitmosaic.io import save_quantized
from bitmosaic.io.export import export_model
from bitmosaic.testing import tiny_gguf
from tests.io.test_export_gguf import CALIB, _check_weights
from tests.io.test_gguf_checkpoint import _transformers

IDS = [1, 5, 9, 17, 33, 65, 100, 3]
ARCHS = ["llama", "qwen2", "phi3"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_runs_our_mxfp4_file(tmp_path, arch):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llama.cpp binding) is not installed")
    from benchmarks.moe.gguf_llamacpp import llama_cpp_logits

    src = tmp_path / f"{arch}.gguf"
    tiny_gguf(src, arch, tied=False, vocab="none")
    m = _transformers(src)
    with torch.inference_mode():
        flo = m(torch.tensor([IDS])).logits[0]
    bitmosaic.quantize_(m, "rtn", CALIB, progress=False, source_model=str(src), scheme="MXFP4A16")
    folder = save_quantized(m, tmp_path / "q")
    out, f32 = tmp_path / "mx.gguf", tmp_path / "f32.gguf"
    res = export_model(folder, out, "gguf")
    assert not res.changed
    assert set(_check_weights(folder, out, arch).values()) == {"MXFP4"}  # every linear an MXFP4 tensor
    export_model(folder, f32, "gguf", gguf_type="F32")
    with torch.inference_mode():
        ours = bitmosaic.load(folder)(torch.tensor([IDS])).logits[0]
    theirs, exact = llama_cpp_logits(out, IDS), llama_cpp_logits(f32, IDS)
    assert torch.isfinite(theirs).all()
    assert _rel(exact, ours) < 0.02  # the same weights as F32: llama.cpp's float path
    assert _rel(theirs, ours) < 0.05 and _rel(theirs, exact) < 0.05  # MXFP4 x Q8_0 activations
    assert _rel(theirs, ours) < 0.15 * _rel(ours, flo)  # far closer to ours than MXFP4 is to the float model
