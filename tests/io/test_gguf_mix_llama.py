"""llama.cpp's per-tensor mix of every GGUF preset bitmosaic calibrates for (``methods/gguf_mix.py``,
issue 72) against ``llama_model_quantize`` itself: tiny Llamas quantized by llama-cpp-python's library
(0.3.36, the llama.cpp the benchmark's tools are built from) with an importance matrix, each 2-D
``blk.*`` tensor's type read back with gguf-py and compared with :func:`tensor_type` for the same layer.
The shapes cover both sides of every width fallback (inputs of 256 and of 288 = 9 x 32 columns),
``n_gqa`` 2 and 4 and a model llama.cpp calls 70B (80 layers, grouped queries).  Needs the binding
(``llama_cpp`` importable, e.g. ``PYTHONPATH=~/.cache/bitmosaic/peers/llama-cpp-python-0.3.36-...``,
built by ``python -m benchmarks.peers.peer_llama``)."""

import ctypes
import re
from types import SimpleNamespace

import numpy as np
import pytest

from bitmosaic.methods.gguf_mix import PRESETS, TWO_BIT_PRESETS, mix_context, tensor_type
from bitmosaic.testing import tiny_gguf

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python's binding is the reference")
gguf = pytest.importorskip("gguf")

PRESETS_TESTED = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0", "IQ4_XS", "IQ4_NL", "IQ3_S", "IQ2_XS",
                  "IQ3_XXS", "IQ2_XXS", "IQ2_S", "IQ2_M")  # fmt: skip
ROLE = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj"}  # fmt: skip
# (hidden, intermediate, layers, kv heads of 4): 288 = 9 x 32 falls back from every 256-block type
MODELS = {"h256_i288_gqa2": (256, 288, 16, 2), "h288_i512_gqa4": (288, 512, 16, 1),
          "llama70b": (256, 256, 80, 1)}  # fmt: skip


def _quantize(src, dst, preset: str, names_widths: dict) -> None:
    """``llama_model_quantize`` of ``src`` to ``preset`` with an importance matrix of ones (as
    ``llama-quantize --imatrix``: llama.cpp's imatrix-only rules apply, IQ2 presets are allowed)."""
    keep = []
    rows = (llama_cpp.llama_model_imatrix_data * (len(names_widths) + 1))()
    for i, (name, width) in enumerate(names_widths.items()):
        data = (ctypes.c_float * width)(*([1.0] * width))
        keep.append(data)
        rows[i].name, rows[i].data, rows[i].size = name.encode(), data, width
    rows[len(names_widths)].name = None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{preset}")
    params.nthread, params.allow_requantize, params.imatrix = 2, True, rows
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0


def _blk_tensors(path) -> dict:
    """``{gguf name: (type name, input width)}`` of the 2-D ``blk.*`` tensors of a GGUF file."""
    return {t.name: (t.tensor_type.name, int(t.shape[0])) for t in gguf.GGUFReader(str(path)).tensors
            if t.name.startswith("blk.") and len(t.shape) == 2}  # fmt: skip


# the presets whose attn_v the 70B rule could touch (Q3_K / Q4_K; IQ2_XS: not), and IQ4_XS (Q5_K, n_gqa 4)
SEVENTY = ("Q2_K", "Q3_K_M", "Q4_K_M", "IQ3_S", "IQ2_XS", "IQ2_M", "IQ4_XS")
CASES = [(m, p) for m in MODELS for p in PRESETS_TESTED if m != "llama70b" or p in SEVENTY]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """``model label -> (folder, source GGUF, mix_context)``, each written once."""
    made = {}

    def get(label):
        if label not in made:
            hidden, inter, layers, kv = MODELS[label]
            root = tmp_path_factory.mktemp(label)
            src = tiny_gguf(root / "src.gguf", "llama", tied=False, layers=layers, hidden=hidden,
                            intermediate=inter, vocab="none", heads=(4, kv))  # fmt: skip
            config = SimpleNamespace(model_type="llama", num_hidden_layers=layers, num_attention_heads=4,
                                     num_key_value_heads=kv)  # fmt: skip
            made[label] = root, src, mix_context(config)
        return made[label]

    return get


@pytest.mark.parametrize("label,preset", CASES)
def test_each_tensor_gets_llama_quantizes_type(source, label, preset):
    root, src, ctx = source(label)
    assert preset in PRESETS
    widths = {n: w for n, (_, w) in _blk_tensors(src).items()}
    dst = root / f"{preset}.gguf"
    _quantize(src, dst, preset, widths)
    theirs = _blk_tensors(dst)
    assert len(theirs) == 7 * ctx["n_layers"]
    wrong = []
    for name, (typ, width) in theirs.items():
        i, role = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name).groups()
        ours = tensor_type(preset, f"model.layers.{i}.{ROLE[role]}", width, **ctx)
        if ours != typ:
            wrong.append(f"{name} ({width} wide): llama.cpp {typ}, bitmosaic {ours}")
    assert not wrong, f"{label} {preset}: " + "; ".join(wrong[:6])
    if label == "llama70b" and preset not in TWO_BIT_PRESETS:  # the rule is exercised, not only agreed on
        assert ctx["llm_70b"] and theirs["blk.40.attn_v.weight"][0] == "Q5_K"


def test_mix_context_follows_llama_cpps_model_type():
    cfg = dict(num_hidden_layers=80, num_attention_heads=64)
    assert mix_context(SimpleNamespace(model_type="llama", num_key_value_heads=8, **cfg))["llm_70b"]
    # 80 layers without grouped queries: llama.cpp's 65B, no 70B rule
    assert not mix_context(SimpleNamespace(model_type="llama", num_key_value_heads=64, **cfg))["llm_70b"]
    assert mix_context(SimpleNamespace(model_type="qwen2", num_key_value_heads=8, **cfg))["llm_70b"]
    assert not mix_context(SimpleNamespace(model_type="qwen2", num_key_value_heads=8, num_hidden_layers=64,
                                           num_attention_heads=40))["llm_70b"]  # fmt: skip
    assert mix_context(SimpleNamespace(model_type="llama", num_key_value_heads=8, **cfg))["n_gqa"] == 8
    assert np.isclose(mix_context(None)["n_gqa"], 1.0)
