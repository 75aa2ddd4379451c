"""k-quants solved on their own stored grid (issue 72): GPTQ with the super-block ``d``/``dmin`` and the
integer sub-block scales/mins fixed first, so the export is exact (no refit, no ``--lossy``); and
llama.cpp's per-tensor mix of the presets (``--gguf-type Q4_K_M`` ...).

Read back with ``gguf.quants.dequantize`` (gguf-py's transcription of ggml, not our packer), bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import bitmosaic
from benchmarks.moe.gguf_llamacpp import llama_cpp_logits
from bitmosaic.algorithms import gguf_kquants as kq
from bitmosaic.algorithms.gguf_grid import importance, kquant_gptq
from bitmosaic.io import save_quantized
from bitmosaic.io.export import export_model
from bitmosaic.io.saved.save import quantized_modules
from bitmosaic.methods.gguf_mix import tensor_type, use_more_bits
from bitmosaic.testing import tiny_gguf
from tests.io.test_export_gguf import CALIB, _check_weights
from tests.io.test_gguf_checkpoint import _transformers
from tests.io.test_gguf_iq4 import _hessian


@pytest.mark.parametrize("typ", sorted(kq.K_TYPES))
def test_gptq_on_the_k_grid_is_exact_and_beats_the_fit_alone(typ):
    from gguf import quants

    t = kq.K_TYPES[typ]
    g = torch.Generator().manual_seed(2)
    out, n = 40, 512
    W = torch.randn(out, n, generator=g) * 0.05
    X = torch.randn(4 * n, n // 8, generator=g) @ torch.randn(n // 8, n, generator=g) / 4
    H = _hessian(n, 1) + X.T @ X / X.shape[0]  # correlated inputs, as a layer's
    res = kquant_gptq(W, H, typ)
    data = kq.pack(res.stored(), t)
    got = torch.from_numpy(np.asarray(quants.dequantize(data, t.qtype)).reshape(out, n))
    assert torch.equal(got, res.dequantize())
    fitted = kq.fit_weights(W, t, importance(H))  # the same scales (weighted fit), codes by nearest rounding
    assert torch.equal(fitted.sc, res.stored().sc) and torch.equal(
        fitted.d.view(torch.int16), res.stored().d.view(torch.int16)
    )

    def err(A):
        E = W - A
        return float(torch.einsum("oi,ij,oj->", E, H, E))

    assert err(res.dequantize()) < 0.97 * err(kq.dequantize(fitted, t))
    part = res.select_rows(5, 17)
    assert torch.equal(part.dequantize(), res.dequantize()[5:17])


def test_the_mix_follows_llama_quantize():
    """SmolLM2's shapes (30 layers, 576 -> 1536, 3 query heads per kv head) under each preset: the types
    llama-quantize 0.3.36 wrote for the same model (benchmarks/results/gguf_vs_llamacpp.md, type counts)."""
    names = [f"model.layers.{i}.{p}" for i in range(30) for p in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj")]  # fmt: skip

    def counts(preset):
        c = {}
        for n in names:
            t = tensor_type(preset, n, 1536 if n.endswith("down_proj") else 576, 30, 3)
            c[t] = c.get(t, 0) + 1
        return c

    # llama.cpp's files also hold token_embd (Q8_0), left out here (tests/io/test_gguf_legacy_grid.py
    # compares every preset with the counts of llama.cpp's own files)
    assert counts("Q4_K_M") == {"Q5_0": 166, "Q8_0": 14, "Q4_K": 16, "Q6_K": 14}
    assert counts("Q3_K_M") == {"Q4_0": 120, "Q5_0": 58, "Q5_1": 2, "Q4_K": 29, "Q5_K": 1}
    assert counts("Q2_K") == {"Q4_0": 180, "Q3_K": 30}
    assert counts("Q6_K") == {"Q8_0": 180, "Q6_K": 30}
    assert counts("Q5_K_M") == {"Q5_1": 166, "Q8_0": 14, "Q5_K": 16, "Q6_K": 14}
    assert counts("Q4_0") == {"Q4_0": 207, "Q4_1": 3}
    assert sum(use_more_bits(i, 30) for i in range(30)) == 14


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    root = tmp_path_factory.mktemp("q4km")
    src = tiny_gguf(root / "llama.gguf", "llama", tied=False, layers=2, hidden=256, intermediate=288,
                    vocab="none")  # fmt: skip
    m = _transformers(src)
    bitmosaic.quantize_(m, "gptq", CALIB, progress=False, source_model=str(src), gguf_type="Q4_K_M")
    return save_quantized(m, root / "q")


def test_q4_k_m_run_exports_exactly_in_llama_cpps_mix(q4km, tmp_path):
    mods = quantized_modules(bitmosaic.load(q4km))
    out = tmp_path / "m.gguf"
    res = export_model(q4km, out, "gguf")
    assert not res.changed
    types = _check_weights(q4km, out, "llama")
    want = {n: tensor_type("Q4_K_M", n, m.in_features, 2, 2) for n, m in mods.items()}
    assert types == want
    # v Q6_K (use_more_bits), the others Q4_K; down (288 wide): Q6_K -> Q8_0, Q4_K -> Q5_0 (fallbacks)
    assert set(types.values()) == {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}
    for m in mods.values():
        if hasattr(m, "gguf_data"):
            assert torch.equal(m.dequantize_reference(), m.dequantize_weight())


def test_llama_cpp_runs_the_q4_k_m_file(q4km, tmp_path):
    pytest.importorskip("llama_cpp")
    out = tmp_path / "m.gguf"
    export_model(q4km, out, "gguf")
    ids = [1, 5, 9, 17, 33, 65, 100, 3]
    theirs = llama_cpp_logits(out, ids)  # the MoE check's reader (benchmarks/moe/gguf_llamacpp.py)
    with torch.inference_mode():
        ours = bitmosaic.load(q4km)(torch.tensor([ids])).logits[0]
    assert torch.isfinite(theirs).all()
    assert float((theirs - ours).norm() / ours.norm()) < 0.05
