"""transformers integration: ``AutoModelForCausalLM.from_pretrained(dir)`` and
``bitmosaic.load(dir)`` load every module kind bitmosaic saves, bit for bit, and ``generate`` works."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import SPECIALS, VOCAB, tiny_llama, word_tokenizer

# (method, options) -> the module kinds (and activation quantizers) they save
CASES = {
    "rtn-w4": ("rtn", {"bits": 4, "group_size": 32}),
    "gptq-act-w3": ("gptq", {"bits": 3, "group_size": 32, "order": "act"}),  # packed + g_idx
    "ssqr": ("ssqr", {"bits": 3, "group_size": 32, "outlier_rate": 0.02}),  # packed+csr
    "dpq": ("dpq", {"group_size": 32}),  # dpq kind, FP8 static activations
    "fp8": ("fp8", {"scheme": "W8A8-FP8"}),  # fp8 kind
    "hptq": ("hptq", {"target_bits": 3.5}),  # huffman
    "hrtn": ("hrtn", {"target_bits": 3.5, "scale_per": "row"}),  # huffman, a scale per row
    "smoothquant-w8a8": ("smoothquant", {"scheme": "W8A8", "group_size": None, "alpha": 0.5}),  # folded
    "gptq-w4a8-fp8": ("gptq", {"scheme": "W4A8-FP8", "group_size": 32}),  # static act scales
}


def _calib():
    return torch.randint(len(SPECIALS), VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))


def _save(path, method, options, model=None):
    from bitmosaic import quantize_
    from bitmosaic.io import save_quantized

    m = model if model is not None else tiny_llama()
    quantize_(m, method, _calib(), progress=False, **options)
    save_quantized(m, path, {"method": method}, tokenizer=word_tokenizer())
    return m


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: (root / name, _save(root / name, *case)) for name, case in CASES.items()}


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sb:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("name", list(CASES))
def test_from_pretrained_loads_every_kind_bit_for_bit(saved, name):
    from transformers import AutoModelForCausalLM

    import bitmosaic  # noqa: F401  (registers the quantizer)
    from bitmosaic.io import load_quantized
    from bitmosaic.io.saved.save import quantized_modules

    path, quantized = saved[name]
    hf = AutoModelForCausalLM.from_pretrained(path)
    ours, _ = load_quantized(path)
    _same_state(hf, ours)
    kinds = {n: m.kind for n, m in quantized_modules(hf).items()}
    assert kinds == {n: m.kind for n, m in quantized_modules(quantized).items()}
    def acts(model):
        return {n: getattr(m, "input_quant", None) is not None for n, m in quantized_modules(model).items()}

    assert acts(hf) == acts(ours)
    x = torch.randint(len(SPECIALS), VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(hf(x).logits, ours(x).logits)
        assert torch.equal(hf(x).logits, quantized(x).logits)
    gen = hf.generate(x[:1], max_new_tokens=6, do_sample=False)
    assert torch.equal(gen, ours.generate(x[:1], max_new_tokens=6, do_sample=False))
    assert hf.quantization_info["modules"] == ours.quantization_info["modules"]


def test_load_short_form_and_save_pretrained_round_trip(saved, tmp_path):
    import bitmosaic
    from bitmosaic.io import load_quantized

    path, _ = saved["gptq-act-w3"]
    model = bitmosaic.load(path)
    model.save_pretrained(tmp_path / "again")  # writes the same quantization_config back
    again, _ = load_quantized(tmp_path / "again", load_tokenizer=False)
    _same_state(again, model)
    qc = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "bitmosaic" and qc["modules"] == model.quantization_info["modules"]


def test_bfloat16_request_keeps_the_stored_formats(saved):
    import bitmosaic

    path, _ = saved["rtn-w4"]
    model = bitmosaic.load(path, dtype=torch.bfloat16)
    q = model.model.layers[0].self_attn.q_proj
    assert q.qweight.dtype == torch.uint8 and q.scales.dtype == torch.float16
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    x = torch.randint(len(SPECIALS), VOCAB, (1, 8))
    assert model.generate(x, max_new_tokens=3, do_sample=False).shape == (1, 11)


def test_folder_from_an_older_bitmosaic_loads(tmp_path):
    """First-format folders listed layers without ``kind`` (packed was the only kind) and carried
    no recipe or provenance: both loaders still take them."""
    import bitmosaic
    from bitmosaic.io import load_quantized

    path = tmp_path / "old"
    _save(path, "rtn", {"bits": 4, "group_size": 32})
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg["quantization_config"]
    qc = {k: v for k, v in qc.items() if k in ("quant_method", "format_version", "method", "modules")}
    for lc in qc["modules"].values():
        lc.pop("kind")
    cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg))
    _same_state(bitmosaic.load(path), load_quantized(path)[0])


def test_damaged_folders_give_one_line_errors(saved, tmp_path):
    import shutil

    import bitmosaic
    from bitmosaic.errors import CorruptModelError

    with pytest.raises(CorruptModelError, match="no config.json"):
        bitmosaic.load(tmp_path)
    path = tmp_path / "newer"
    shutil.copytree(saved["rtn-w4"][0], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["format_version"] = 99
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="upgrade bitmosaic"):
        bitmosaic.load(path)
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="upgrade bitmosaic"):
        AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.model
def test_smollm2_through_transformers(smollm, smollm_calib, tmp_path):
    import copy

    import bitmosaic
    from bitmosaic.io import load_quantized, save_quantized

    model = copy.deepcopy(smollm[0])
    bitmosaic.quantize_(model, "rtn", smollm_calib, bits=4, group_size=128, progress=False)
    save_quantized(model, tmp_path / "q", {"method": "rtn"}, tokenizer=smollm[1])
    hf = bitmosaic.load(tmp_path / "q")
    ours, tok = load_quantized(tmp_path / "q")
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    a = hf.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, ours.generate(ids, max_new_tokens=8, do_sample=False))
    assert a.shape[1] == ids.shape[1] + 8


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_a_mixture_of_experts_loads_through_transformers(model_type, tmp_path):
    """``bitmosaic.load`` (transformers' ``from_pretrained``) of a quantized MoE: its experts unfused as
    the saved per-expert modules are, the same state and logits as ``load_quantized``, and it generates."""
    import bitmosaic
    from bitmosaic.io import load_quantized
    from bitmosaic.testing import tiny_moe

    path = tmp_path / model_type
    _save(path, "gptq", {"bits": 4, "group_size": 32, "moe_min_tokens": 1}, model=tiny_moe(model_type))
    got, ref = bitmosaic.load(path), load_quantized(path)[0]
    _same_state(got, ref)
    ids = _calib()[:1]
    with torch.inference_mode():
        assert torch.equal(got(ids).logits, ref(ids).logits)
        out = got.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4
