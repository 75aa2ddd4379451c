"""Q4_1 / Q5_1 solved on their own stored grid (issue 72): llama.cpp's fallback of Q5_K for widths that are
not a multiple of 256 (Q5_K_M / Q3_K_M on SmolLM2's 576-wide layers) and the Q4_0 preset's Q4_1
``ffn_down`` guard, so bitmosaic's files have llama.cpp's per-tensor types and size.

Read back with ``gguf.quants.dequantize`` (gguf-py's transcription of ggml, not our packer), bit for bit;
the per-tensor types compared with those llama-quantize wrote for SmolLM2 (read from its files with
gguf-py by ``benchmarks/gguf/llamacpp_peers.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import bitmosaic
from bitmosaic.algorithms import gguf_legacy as gl
from bitmosaic.algorithms.gguf_grid import SYM_NMAX, legacy_gptq, legacy_sym_gptq
from bitmosaic.algorithms.gptq import gptq_quantize
from bitmosaic.formats.grid import IntGrid
from bitmosaic.io import save_quantized
from bitmosaic.io.export import export_model
from bitmosaic.io.export import gguf_blocks as gb
from bitmosaic.methods.gguf_mix import PRESETS, tensor_type
from bitmosaic.testing import tiny_gguf
from tests.io.test_export_gguf import CALIB, _check_weights
from tests.io.test_gguf_checkpoint import _transformers
from tests.io.test_gguf_iq4 import _hessian

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results" / "gguf_vs_llamacpp.json"


@pytest.mark.parametrize("typ", sorted(gl.L_TYPES))
def test_gptq_on_the_grid_is_exact_and_beats_llama_cpps_rounding(typ):
    from gguf import quants

    t = gl.L_TYPES[typ]
    g = torch.Generator().manual_seed(3)
    out, n = 32, 256
    W = torch.randn(out, n, generator=g) * 0.05
    X = torch.randn(4 * n, n // 8, generator=g) @ torch.randn(n // 8, n, generator=g) / 4
    H = _hessian(n, 2) + X.T @ X / X.shape[0]  # correlated inputs, as a layer's
    res = legacy_gptq(W, H, typ)
    data = gl.pack(*res.stored(), t)
    qtype = quants.GGMLQuantizationType[typ]
    assert data.shape == (out, n // 32 * quants.GGML_QUANT_SIZES[qtype][1])
    got = torch.from_numpy(np.asarray(quants.dequantize(data, qtype)).reshape(out, n))
    assert torch.equal(got, res.dequantize())

    def err(A):
        E = W - A
        return float(torch.einsum("oi,ij,oj->", E, H, E))

    d, m = res.aux["d"], res.aux["m"]
    rep = lambda x: x.float().repeat_interleave(32, dim=1)  # noqa: E731
    nearest = gl.dequantize(((W - rep(m)) / rep(d)).round().clamp(0, t.qmax).long(), d, m)
    theirs = quants.dequantize(quants.quantize(W.numpy(), qtype), qtype)
    assert err(res.dequantize()) < 0.97 * err(nearest)
    assert err(res.dequantize()) < 0.8 * err(torch.from_numpy(np.asarray(theirs)).reshape(out, n))
    assert torch.equal(res.select_rows(3, 9).dequantize(), res.dequantize()[3:9])


def _layer(seed: int = 3, out: int = 32, n: int = 256):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, n, generator=g) * 0.05
    W[:, ::37] *= 4  # a few heavy inputs, so that the largest magnitude of a block decides its scale
    X = torch.randn(4 * n, n // 8, generator=g) @ torch.randn(n // 8, n, generator=g) / 4
    X[:, 5::11] *= 3  # inputs of unequal importance, as a layer's
    return W, _hessian(n, 2) + X.T @ X / X.shape[0]


@pytest.mark.parametrize("typ", sorted(SYM_NMAX))
def test_q4_0_q5_0_gptq_is_exact_and_beats_the_generic_mse_scales(typ):
    """Q4_0 / Q5_0: llama.cpp's weighted ``make_qx_quants`` scales, then GPTQ; read back by gguf-py."""
    from gguf import quants

    W, H = _layer()
    out, n = W.shape
    res = legacy_sym_gptq(W, H, typ)
    t = gb.BLOCK_TYPES[typ]
    f = gb.fit((res.codes - res.zeros.repeat_interleave(32, 1)).long(), res.scales.half(), t)
    assert f.wide == 0 and f.inexact_m == 0
    assert bool((res.scales < 0).any()) and bool((res.scales > 0).any())  # llama.cpp's signed d, both signs
    got = quants.dequantize(gb.pack(f, t), t.qtype)
    assert torch.equal(torch.from_numpy(np.asarray(got)).reshape(out, n), res.dequantize())

    def err(A):
        E = W - A
        return float(torch.einsum("oi,ij,oj->", E, H, E))

    bits = SYM_NMAX[typ].bit_length()
    generic = gptq_quantize(W, H, IntGrid(bits, True), 32, scale_method="mse", static_groups=True)
    assert err(res.dequantize()) < 0.95 * err(generic.dequantize())  # the path it replaces
    theirs = quants.dequantize(quants.quantize(W.numpy(), t.qtype), t.qtype)  # llama.cpp without imatrix
    assert err(res.dequantize()) < 0.8 * err(torch.from_numpy(np.asarray(theirs)).reshape(out, n))


def test_qx_scale_is_no_worse_than_llama_cpps_unweighted_q4_0_per_block():
    """With equal weights, :func:`qx`'s first candidate is ggml's ``quantize_row_q4_0_ref`` codes with their
    least-squares scale, so no block may have a larger error than gguf-py's Q4_0 (fp32 scales: the fp16
    rounding of ``d`` is the export's, not the search's)."""
    from gguf import quants

    W, _ = _layer(seed=5)
    x = W.reshape(-1, 32).double()
    s = gl.qx(x, torch.ones_like(x), 8)
    ours = ((x / s[:, None]).round().clamp(-8, 7) * s[:, None] - x).pow(2).sum(-1)
    q40 = quants.GGMLQuantizationType.Q4_0
    ref = np.asarray(quants.dequantize(quants.quantize(W.numpy(), q40), q40))
    ref = torch.from_numpy(ref).reshape(-1, 32)
    theirs = (ref.double() - x).pow(2).sum(-1)
    assert bool((ours <= theirs * (1 + 1e-3) + 1e-12).all())
    assert float(ours.sum()) < 0.97 * float(theirs.sum())  # the other 18 candidates do find better scales


def test_the_weighted_block_search_beats_min_max():
    """:func:`qkx3` (llama.cpp's make_qkx3_quants) lowers the weighted error of plain min/max rounding."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 32, generator=g, dtype=torch.float64)
    wt = torch.rand(500, 32, generator=g, dtype=torch.float64) ** 4
    s, m, q = gl.qkx3(x, wt, 15)
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    a = (x.amax(-1, keepdim=True) - lo) / 15
    plain = (((x - lo) / a).round().clamp(0, 15) * a + lo - x) ** 2
    ours = (s[:, None] * q + m[:, None] - x) ** 2
    assert bool((m <= 0).all()) and int(q.min()) >= 0 and int(q.max()) <= 15
    assert float((wt * ours).sum()) < 0.9 * float((wt * plain).sum())
    assert bool(((wt * ours).sum(-1) <= (wt * plain).sum(-1) * (1 + 1e-12)).all())


def test_the_mix_has_llama_quantizes_types_for_smollm2():
    """SmolLM2's shapes (30 layers, 576 -> 1536, 3 query heads per kv head) under each preset: the per-tensor
    type counts of the files llama-quantize (with an imatrix) wrote for SmolLM2, as the benchmark read them
    with gguf-py (less token_embd, Q8_0 in every file; bitmosaic writes it from the source)."""
    files = json.loads(RESULTS.read_text())["ppl"]
    names = [f"model.layers.{i}.{p}" for i in range(30) for p in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj")]  # fmt: skip
    checked = []
    for preset in PRESETS:
        theirs = files.get(f"llama {preset} imatrix")
        if theirs is None:
            continue
        want = dict(theirs["types"])
        want["Q8_0"] -= 1
        want = {k: v for k, v in want.items() if v}
        ours: dict[str, int] = {}
        for n in names:
            t = tensor_type(preset, n, 1536 if n.endswith("down_proj") else 576, 30, 3)
            ours[t] = ours.get(t, 0) + 1
        assert ours == want, preset
        checked.append(preset)
    assert {"Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0", "IQ4_XS", "IQ4_NL"} <= set(checked)


@pytest.fixture(scope="module")
def q5km(tmp_path_factory):
    root = tmp_path_factory.mktemp("q5km")
    src = tiny_gguf(root / "llama.gguf", "llama", tied=False, layers=2, hidden=256, intermediate=288,
                    vocab="none")  # fmt: skip
    m = _transformers(src)
    bitmosaic.quantize_(m, "gptq", CALIB, progress=False, source_model=str(src), gguf_type="Q5_K_M")
    return save_quantized(m, root / "q")


def test_q5_k_m_run_exports_exactly_with_llama_cpps_q5_1_fallback(q5km, tmp_path):
    out = tmp_path / "m.gguf"
    res = export_model(q5km, out, "gguf")
    assert not res.changed
    types = _check_weights(q5km, out, "llama")
    # down (288 wide): Q5_K -> Q5_1, Q6_K -> Q8_0 (llama.cpp's fallbacks); the rest Q5_K / Q6_K
    assert types["model.layers.1.mlp.down_proj"] in ("Q5_1", "Q8_0")
    assert "Q5_1" in set(types.values()) and set(types.values()) <= {"Q5_K", "Q6_K", "Q5_1", "Q8_0"}
