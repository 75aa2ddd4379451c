"""IQ3_S / IQ2_S / IQ2_XS / IQ3_XXS / IQ2_XXS (issue 72): llama.cpp's lattice codebooks, a vector GPTQ on
them, exported exactly.

The bytes are read back with ``gguf.quants.dequantize`` (gguf-py's transcription of ggml's formulas, not
our packer) and must equal our float model of them bit for bit; the solve must beat nearest-point
rounding with the same scales; the tiny model's file runs in llama.cpp (where installed).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bitmosaic
from benchmarks.moe.gguf_llamacpp import llama_cpp_logits
from bitmosaic.algorithms.gguf_grid import importance
from bitmosaic.algorithms.gguf_lattice import lattice_gptq, lattice_rtn, lattice_scales
from bitmosaic.formats import gguf_lattice as gl
from bitmosaic.io import save_quantized
from bitmosaic.io.export import export_model
from bitmosaic.io.saved.save import quantized_modules
from bitmosaic.methods.gguf_mix import PRESETS, tensor_type
from bitmosaic.testing import tiny_gguf
from tests.io.test_export_gguf import CALIB, _check_weights
from tests.io.test_gguf_checkpoint import _transformers


def _hessian(n: int, seed: int = 0) -> torch.Tensor:
    """A real-like Hessian: correlated inputs (a random mixing of fewer factors) of uneven scale."""
    g = torch.Generator().manual_seed(seed)
    Z = torch.randn(4 * n, n // 4, generator=g)
    X = Z @ torch.randn(n // 4, n, generator=g) + 0.3 * torch.randn(4 * n, n, generator=g)
    X = X * torch.linspace(0.2, 3, n)
    return X.T @ X / X.shape[0]


def _random_codes(t: gl.LatticeType, out: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    idx = torch.from_numpy(rng.integers(0, t.points, (out, n // t.dim)).astype(np.int16))
    neg = rng.integers(0, 2, (out, n // t.run, t.run)).astype(np.uint8)
    if t.parity:  # IQ2_XS / IQ2_XXS / IQ3_XXS store 7 signs of 8; the 8th is their parity
        neg[..., -1] = neg[..., :-1].sum(-1) % 2
    d = torch.from_numpy(
        (rng.standard_normal((out, n // gl.QK)) * 10.0 ** rng.integers(-4, 1)).astype(np.float16)
    )
    s = torch.from_numpy(rng.integers(0, 16, (out, n // t.sub)).astype(np.uint8))
    return idx, torch.from_numpy(neg.reshape(out, n)), d, s


@settings(max_examples=25, deadline=None)
@given(typ=st.sampled_from(sorted(gl.LATTICE_TYPES)), out=st.integers(1, 4), nb=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))  # fmt: skip
def test_packed_blocks_read_back_with_gguf_quants(typ, out, nb, seed):
    from gguf import quants

    t = gl.LATTICE_TYPES[typ]
    n = nb * gl.QK
    stored = _random_codes(t, out, n, seed)
    data = gl.pack(*stored, t)
    assert data.shape == (out, nb * t.bytes_per_block)
    got = np.asarray(quants.dequantize(data, t.qtype), dtype=np.float32).reshape(out, n)
    ours = gl.dequantize(*stored, t).numpy()
    assert np.array_equal(got.view(np.uint32), ours.view(np.uint32))
    back = gl.unpack(data, t, n)
    assert all(torch.equal(a.view(torch.int16) if a.dtype == torch.float16 else a.long(),
                           b.view(torch.int16) if b.dtype == torch.float16 else b.long())
               for a, b in zip(back, stored, strict=True))  # fmt: skip


def test_bits_per_weight_and_parity_refusal():
    import gguf

    for typ, bits in (("IQ2_XS", 2.3125), ("IQ3_S", 3.4375), ("IQ2_XXS", 2.0625), ("IQ3_XXS", 3.0625),
                      ("IQ2_S", 2.5625)):  # fmt: skip
        t = gl.LATTICE_TYPES[typ]
        block, size = gguf.GGML_QUANT_SIZES[t.qtype]
        assert (block, size) == (gl.QK, t.bytes_per_block) and t.bits == bits
    for typ in ("IQ2_XS", "IQ2_XXS", "IQ3_XXS"):
        t = gl.LATTICE_TYPES[typ]
        idx, neg, d, s = _random_codes(t, 1, 256, 0)
        neg[0, 0] ^= 1
        with pytest.raises(ValueError, match="parity"):
            gl.pack(idx, neg, d, s, t)


@pytest.mark.parametrize("typ", sorted(gl.LATTICE_TYPES))
def test_vector_gptq_is_exact_and_beats_nearest_point_rounding(typ):
    """The solver's weights are the stored blocks' (bit for bit) and its Hessian-weighted error is below
    nearest-point rounding on the codebook with the same stored scales."""
    from gguf import quants

    t = gl.LATTICE_TYPES[typ]
    g = torch.Generator().manual_seed(1)
    out, n = 48, 512
    W = torch.randn(out, n, generator=g) * 0.05
    H = _hessian(n)
    res = lattice_gptq(W, H, typ)
    data = gl.pack(*res.stored(), t)
    got = torch.from_numpy(np.asarray(quants.dequantize(data, t.qtype)).reshape(out, n))
    assert torch.equal(got, res.dequantize())
    assert torch.equal(res.scales[:, res.g_idx] * res.codes.float(), res.dequantize())
    d, s = lattice_scales(W, importance(H), t)
    assert torch.equal(res.aux["d"].view(torch.int16), d.view(torch.int16)) and torch.equal(res.aux["s"], s)
    rtn = lattice_rtn(W, typ, d, s, importance(H)).dequantize()

    def err(A):
        E = W - A
        return float(torch.einsum("oi,ij,oj->", E, H, E))

    assert err(res.dequantize()) < 0.9 * err(rtn)
    assert abs(float(res.step_errors.sum()) - err(res.dequantize())) < 0.05 * err(res.dequantize())
    bound = {"IQ2_XS": 0.45, "IQ2_XXS": 0.5, "IQ3_XXS": 0.3}.get(typ, 0.25)
    assert float((rtn - W).norm() / W.norm()) < bound


def test_llama_cpp_mix_of_the_lattice_presets():
    """llama_tensor_get_type for IQ3_S / IQ2_XS on SmolLM2's shapes (30 layers, 576 wide, n_gqa 3)."""
    assert tensor_type("IQ3_S", "model.layers.4.self_attn.q_proj", 576, 30, 3) == "IQ4_NL"
    assert tensor_type("IQ3_S", "model.layers.4.mlp.down_proj", 1536, 30, 3) == "IQ3_S"
    assert tensor_type("IQ3_S", "model.layers.4.self_attn.v_proj", 1024, 30, 4) == "Q4_K"
    assert tensor_type("IQ2_XS", "model.layers.2.mlp.down_proj", 1536, 30, 3) == "Q2_K"
    assert tensor_type("IQ2_XS", "model.layers.3.mlp.down_proj", 1536, 30, 3) == "IQ2_XS"
    assert tensor_type("IQ2_XS", "model.layers.3.self_attn.v_proj", 576, 30, 3) == "Q4_0"
    assert tensor_type("IQ2_XS", "model.layers.3.mlp.up_proj", 576, 30, 3) == "IQ4_NL"


def test_llama_cpp_mix_of_the_xxs_presets():
    """llama_tensor_get_type for IQ3_XXS / IQ2_XXS with an imatrix (dense): IQ3_XXS's attn_output is IQ3_S,
    its attn_q / attn_k the IQ2_S type (IQ4_NL where the width falls back);
    IQ2_XXS as IQ2_XS (attn_v and the first eighth of ffn_down Q2_K)."""
    assert tensor_type("IQ3_XXS", "model.layers.4.mlp.down_proj", 1536, 30, 3) == "IQ3_XXS"
    assert tensor_type("IQ3_XXS", "model.layers.0.mlp.down_proj", 1536, 30, 3) == "IQ3_XXS"
    assert tensor_type("IQ3_XXS", "model.layers.4.mlp.up_proj", 1024, 30, 3) == "IQ3_XXS"
    assert tensor_type("IQ3_XXS", "model.layers.4.self_attn.o_proj", 1024, 30, 3) == "IQ3_S"
    assert tensor_type("IQ3_XXS", "model.layers.4.self_attn.v_proj", 1024, 30, 3) == "IQ3_XXS"
    assert tensor_type("IQ3_XXS", "model.layers.4.self_attn.v_proj", 1024, 30, 4) == "Q4_K"
    assert tensor_type("IQ3_XXS", "model.layers.4.self_attn.q_proj", 576, 30, 3) == "IQ4_NL"
    assert tensor_type("IQ3_XXS", "model.layers.4.self_attn.k_proj", 1024, 30, 3) == "IQ2_S"
    assert tensor_type("IQ3_XXS", "model.layers.4.self_attn.q_proj", 1024, 30, 3) == "IQ2_S"
    assert tensor_type("IQ2_XXS", "model.layers.2.mlp.down_proj", 1536, 30, 3) == "Q2_K"
    assert tensor_type("IQ2_XXS", "model.layers.3.mlp.down_proj", 1536, 30, 3) == "IQ2_XXS"
    assert tensor_type("IQ2_XXS", "model.layers.3.self_attn.o_proj", 1024, 30, 3) == "IQ2_XXS"
    assert tensor_type("IQ2_XXS", "model.layers.3.self_attn.v_proj", 576, 30, 3) == "Q4_0"
    assert tensor_type("IQ2_XXS", "model.layers.3.self_attn.v_proj", 1024, 30, 8) == "Q4_K"
    # the 2-D types of the files llama-quantize --imatrix wrote for SmolLM2 (30 layers, 576 -> 1536, n_gqa 3;
    # runs of llama.cpp built from llama-cpp-python 0.3.36's source, read with gguf-py), less token_embd
    llama_cpp = {"IQ3_XXS": {"IQ3_XXS": 30, "IQ4_NL": 180},
                 "IQ2_XXS": {"IQ2_XXS": 27, "IQ4_NL": 150, "Q2_K": 3, "Q4_0": 30}}  # fmt: skip
    for preset, want in llama_cpp.items():
        assert _smollm2_type_counts(preset) == want, preset


def test_llama_cpp_mix_of_the_iq2_s_and_iq2_m_presets():
    """llama_tensor_get_type for IQ2_S (default type IQ2_XS) and IQ2_M (default type IQ2_S) with an imatrix
    (dense): attn_v Q4_K at n_gqa >= 4 else IQ3_S, attn_output and the first eighth of ffn_down IQ3_S."""
    for preset, typ in (("IQ2_S", "IQ2_XS"), ("IQ2_M", "IQ2_S")):
        assert tensor_type(preset, "model.layers.4.self_attn.q_proj", 1024, 30, 3) == typ
        assert tensor_type(preset, "model.layers.4.mlp.up_proj", 1024, 30, 3) == typ
        assert tensor_type(preset, "model.layers.4.mlp.down_proj", 1536, 30, 3) == typ
        assert tensor_type(preset, "model.layers.2.mlp.down_proj", 1536, 30, 3) == "IQ3_S"
        assert tensor_type(preset, "model.layers.4.self_attn.o_proj", 1024, 30, 3) == "IQ3_S"
        assert tensor_type(preset, "model.layers.4.self_attn.v_proj", 1024, 30, 3) == "IQ3_S"
        assert tensor_type(preset, "model.layers.4.self_attn.v_proj", 1024, 30, 4) == "Q4_K"
        assert tensor_type(preset, "model.layers.4.self_attn.v_proj", 576, 30, 4) == "Q5_0"
        assert tensor_type(preset, "model.layers.4.self_attn.q_proj", 576, 30, 3) == "IQ4_NL"
    # the 2-D types of the files llama-quantize --imatrix wrote for SmolLM2 (as the test above), less
    # token_embd
    llama_cpp = {"IQ2_S": {"IQ2_XS": 27, "IQ3_S": 3, "IQ4_NL": 180},
                 "IQ2_M": {"IQ2_S": 27, "IQ3_S": 3, "IQ4_NL": 180}}  # fmt: skip
    for preset, want in llama_cpp.items():
        assert _smollm2_type_counts(preset) == want, preset


@pytest.fixture(scope="module", params=["IQ3_S", "IQ2_XS", "IQ3_XXS", "IQ2_XXS", "IQ2_M", "IQ2_S"])
def lattice_model(request, tmp_path_factory):
    """A tiny Llama, every input 256 or 512 wide, quantized with ``--gguf-type`` IQ3_S / IQ2_XS / IQ3_XXS
    (attn_q / attn_k the IQ2_S type, attn_output IQ3_S) / IQ2_XXS / IQ2_M (the IQ2_S type, attn_output
    IQ3_S) / IQ2_S (IQ2_XS, attn_output IQ3_S) and saved."""
    root = tmp_path_factory.mktemp(request.param)
    src = tiny_gguf(root / "llama.gguf", "llama", tied=False, layers=1, hidden=256, intermediate=512,
                    vocab="none")  # fmt: skip
    m = _transformers(src)
    bitmosaic.quantize_(m, "gptq", CALIB, progress=False, source_model=str(src), gguf_type=request.param)
    return save_quantized(m, root / "q"), request.param


def test_lattice_run_saves_loads_and_exports_exactly(lattice_model, tmp_path):
    folder, preset = lattice_model
    typ = PRESETS[preset]  # the preset's default tensor type (IQ2_M: IQ2_S; IQ2_S: IQ2_XS)
    mods = quantized_modules(bitmosaic.load(folder))
    types = {n: m.gguf_type for n, m in mods.items()}
    assert typ in set(types.values())
    if preset in ("IQ2_S", "IQ2_M", "IQ3_XXS"):  # llama.cpp's IQ3_S attn_output in these
        assert types["model.layers.0.self_attn.o_proj"] == "IQ3_S"
    if preset == "IQ3_XXS":  # and the IQ2_S type for attn_q / attn_k
        assert types["model.layers.0.self_attn.q_proj"] == types["model.layers.0.self_attn.k_proj"] == "IQ2_S"
    for m in mods.values():  # the gguf package's reader and ours agree on the stored bytes
        assert torch.equal(m.dequantize_reference(), m.dequantize_weight())
        if m.gguf_type == typ:
            assert abs(m.bits_per_weight() - gl.LATTICE_TYPES[typ].bits) < 1e-9
    out = tmp_path / "m.gguf"
    res = export_model(folder, out, "gguf")  # no --gguf-type, no lossy: exact
    assert not res.changed
    assert _check_weights(folder, out, "llama") == types
    from gguf import GGUFReader, LlamaFileType

    assert GGUFReader(str(out)).fields["general.file_type"].contents() == LlamaFileType[f"MOSTLY_{preset}"]


def test_llama_cpp_runs_the_lattice_file(lattice_model, tmp_path):
    """llama.cpp loads the file and its logits follow bitmosaic's (it multiplies with 8-bit activations)."""
    pytest.importorskip("llama_cpp")
    folder, _ = lattice_model
    out = tmp_path / "m.gguf"
    export_model(folder, out, "gguf")
    ids = [1, 5, 9, 17, 33, 65, 100, 3]
    theirs = llama_cpp_logits(out, ids)
    with torch.inference_mode():
        ours = bitmosaic.load(folder)(torch.tensor([ids])).logits[0]
    assert torch.isfinite(theirs).all()
    assert float((theirs - ours).norm() / ours.norm()) < 0.05

def _smollm2_type_counts(preset: str) -> dict[str, int]:
    """How many of SmolLM2's 210 decoder linears (576 wide, down_proj 1536) get each type under ``preset``."""
    counts: dict[str, int] = {}
    for i in range(30):
        for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):  # fmt: skip
            t = tensor_type(preset, f"model.layers.{i}.{p}", 1536 if p.endswith("down_proj") else 576, 30, 3)
            counts[t] = counts.get(t, 0) + 1
    return counts
