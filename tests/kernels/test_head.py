"""The run-time 8-bit output head (modules/head.py): llama.cpp's Q8_0 codes, exact where the head came
from Q8_0, Q8_0 x Q8_0 products, never saved, every load path, the CLI flag."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

import bitmosaic
from bitmosaic.errors import OptionError
from bitmosaic.modules.head import (
    HEAD_GROUP,
    RUNTIME_HEAD_ENV,
    int8_head_codes,
    runtime_head,
    set_runtime_head,
)
from tests.helpers import word_tokenizer
from tests.methods.saved_bytes import calib, tiny_llama


def test_codes_are_gguf_q8_0s():
    """Our codes are the ``qs`` gguf-py's own Q8_0 quantizer stores (an independent implementation);
    our scale is its ``d`` before the float16 rounding."""
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(0)) * 0.05
    codes, s = int8_head_codes(w)
    raw = gguf_quantize(w.numpy(), GGMLQuantizationType.Q8_0).reshape(40, -1, 2 + HEAD_GROUP)
    d = raw[..., :2].copy().view(np.float16)[..., 0]
    qs = raw[..., 2:].copy().view(np.int8).reshape(40, -1)
    assert torch.equal(codes.to(torch.int16) - 128, torch.from_numpy(qs).to(torch.int16))
    torch.testing.assert_close(torch.from_numpy(d.astype(np.float32)), s.half().float())


def _q8_0_origin(n: int, k: int) -> torch.Tensor:
    """A head stored as Q8_0 blocks (as SmolLM2's GGUF stores its tied embeddings): ``q * d``, ``d`` in
    float16, each block with a code of magnitude 127."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (n, k), generator=g).float()
    q[:, ::HEAD_GROUP] = 127 * torch.sign(torch.randn(n, k // HEAD_GROUP, generator=g))
    d = (torch.rand(n, k // HEAD_GROUP, generator=g) * 0.01 + 1e-4).half().float()
    return q * d.repeat_interleave(HEAD_GROUP, dim=1)


def test_int8_head_is_exact_on_a_q8_0_head_and_q8_0_matches_llama_cpps_dot():
    model = tiny_llama()
    head = model.get_output_embeddings()
    head.weight.data = _q8_0_origin(*head.weight.shape)  # tied: the embeddings too
    x = torch.randn(3, 7, head.in_features, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = head(x)
        assert set_runtime_head(model, "int8") and runtime_head(model) == "int8"
        torch.testing.assert_close(head(x), ref, rtol=1e-5, atol=1e-5)
        assert set_runtime_head(model, "q8_0") and runtime_head(model) == "q8_0"
        y = head(x)
    # ggml_vec_dot_q8_0_q8_0 written out: both sides in int8 blocks of 32, one scale each
    xb = x.reshape(-1, head.in_features // HEAD_GROUP, HEAD_GROUP)
    dx = xb.abs().amax(-1, keepdim=True) / 127
    qx = torch.round(xb / dx)
    codes, dw = int8_head_codes(head.weight)
    qw = (codes.float() - 128).reshape(head.out_features, -1, HEAD_GROUP)
    blocks = torch.einsum("mgk,ngk->mng", qx.double(), qw.double())  # exact integer sums
    expect = (blocks * dx[..., 0].double()[:, None, :] * dw.double()[None]).sum(-1).float()
    torch.testing.assert_close(y.reshape(-1, head.out_features), expect, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(y, ref, rtol=1e-5, atol=1e-5)  # the activations' rounding is there


def test_not_saved_tie_kept_training_and_off_switch():
    model = tiny_llama()
    keys = sorted(model.state_dict())
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    set_runtime_head(model, "q8_0")
    assert sorted(model.state_dict()) == keys and head.weight is emb.weight
    x = torch.randn(2, head.in_features, requires_grad=True)
    head(x).sum().backward()  # with a gradient the float head runs: training still works
    assert head.weight.grad is not None
    assert set_runtime_head(model, "none") is False and runtime_head(model) == "none"
    assert "forward" not in head.__dict__
    with pytest.raises(OptionError, match="'int4' is not one of none, int8, q8_0"):
        set_runtime_head(model, "int4")


def test_from_the_environment_on_load_and_in_eval(tmp_path, monkeypatch, capsys):
    from bitmosaic.cli import main
    from bitmosaic.io import load_quantized, save_quantized

    model = tiny_llama()
    bitmosaic.quantize_(model, "rtn", calib(), progress=False, bits=4, group_size=32)
    path = save_quantized(model, tmp_path / "m", {"method": "rtn"}, tokenizer=word_tokenizer())
    before = sorted((f.name, f.read_bytes()) for f in path.iterdir())
    monkeypatch.setenv(RUNTIME_HEAD_ENV, "int8")
    loaded = load_quantized(path, load_tokenizer=False)[0]
    assert runtime_head(loaded) == "int8"
    monkeypatch.setenv(RUNTIME_HEAD_ENV, "int3")
    with pytest.raises(OptionError, match=r"\$BITMOSAIC_RUNTIME_HEAD='int3' is not one of"):
        load_quantized(path, load_tokenizer=False)
    monkeypatch.delenv(RUNTIME_HEAD_ENV)
    assert runtime_head(load_quantized(path, load_tokenizer=False)[0]) == "none"
    assert sorted((f.name, f.read_bytes()) for f in path.iterdir()) == before
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat and the dog ran in the park " * 20)
    capsys.readouterr()
    assert main(["eval", str(path), "--runtime-head", "q8_0", "--ppl", str(text), "--seqlen", "16"]) == 0
    assert "runtime head q8_0: the output head runs an 8-bit copy" in capsys.readouterr().out


def test_load_gives_a_q8_0_origin_head_its_int8_copy_by_default(tmp_path, monkeypatch):
    """Unset $BITMOSAIC_RUNTIME_HEAD: a head whose weights are their int8 copy bit for bit (stored as Q8_0)
    loads on the int8 head (the same weights, float32 sums in another order), a head of other floats on
    the float one; ``none`` keeps the float head either way, and a head that differs only in its last row
    block is not taken for exact."""
    from bitmosaic.io import load_quantized, save_quantized
    from bitmosaic.modules import head as head_mod

    monkeypatch.delenv(RUNTIME_HEAD_ENV, raising=False)
    model = tiny_llama()
    head = model.get_output_embeddings()
    bitmosaic.quantize_(model, "rtn", calib(), progress=False, bits=4, group_size=32)
    float_path = save_quantized(model, tmp_path / "float", {"method": "rtn"}, tokenizer=word_tokenizer())
    head.weight.data = _q8_0_origin(*head.weight.shape)  # tied: the embeddings too
    assert head_mod.int8_head_is_exact(model)
    path = save_quantized(model, tmp_path / "q8", {"method": "rtn"}, tokenizer=word_tokenizer())
    ids = torch.randint(0, head.out_features, (1, 9), generator=torch.Generator().manual_seed(4))
    loaded = load_quantized(path, load_tokenizer=False)[0]
    assert runtime_head(loaded) == "int8"
    monkeypatch.setenv(RUNTIME_HEAD_ENV, "none")
    plain = load_quantized(path, load_tokenizer=False)[0]
    assert runtime_head(plain) == "none"
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    monkeypatch.delenv(RUNTIME_HEAD_ENV)
    assert runtime_head(load_quantized(float_path, load_tokenizer=False)[0]) == "none"
    monkeypatch.setattr(head_mod, "_EXACT_ROWS", 16)  # several chunks; only the last one differs
    w = head.weight.data.clone()
    w[-1, 0] = float(torch.nextafter(w[-1, 0], torch.tensor(1.0)))
    head.weight.data = w
    assert not head_mod.int8_head_is_exact(model)


@pytest.mark.parametrize("mode", ["int8", "q8_0"])
def test_compiled_forward_with_an_8bit_head_equals_eager(mode):
    """The run-time head's kernels are operators too: ``torch.compile(fullgraph=True)`` traces the model
    with the head's forward attribute and gives the eager logits."""
    model = tiny_llama()
    set_runtime_head(model, mode)
    ids = calib()[:1, :12]
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model(ids).logits
        out = torch.compile(model, fullgraph=True, dynamic=False)(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_many_rows_take_the_gemm_over_the_same_int8_weights(monkeypatch):
    """From ``HEAD_GEMM_ROWS`` rows on, the ``int8`` head multiplies by torch's GEMM over its dequantized
    int8 weights, a chunk of rows at a time (prefill, evaluation windows): below, the low-bit kernel.
    Either way the product is the int8 weights' (not the float head's), up to float32 order, and equal
    to the kernel's.  A traced forward keeps the kernel (an operator): a whole graph of many rows that
    gives the eager logits."""
    from bitmosaic.modules import head as head_mod

    model = tiny_llama()
    head = model.get_output_embeddings()
    monkeypatch.setattr(head_mod, "_EXACT_ROWS", 24)  # several chunks, the last one short
    assert head.out_features % 24 and head.out_features > 48
    set_runtime_head(model, "int8")
    fwd = head.__dict__["forward"]
    codes, s = int8_head_codes(head.weight)
    wq = (codes.float() - 128) * s.repeat_interleave(HEAD_GROUP, dim=1)[:, : head.in_features]
    assert not torch.equal(wq, head.weight)  # float weights: the int8 head is not the float one
    calls = []
    monkeypatch.setattr(fwd, "gemm", lambda x2, f=fwd.gemm: calls.append(len(x2)) or f(x2))
    g = torch.Generator().manual_seed(5)
    for m in (head_mod.HEAD_GEMM_ROWS - 1, head_mod.HEAD_GEMM_ROWS, 2 * head_mod.HEAD_GEMM_ROWS + 3):
        x = torch.randn(m, head.in_features, generator=g)
        with torch.no_grad():
            y = head(x)
            torch.testing.assert_close(y, F.linear(x, wq), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(y, fwd.kernel(x), rtol=1e-5, atol=1e-5)
    assert calls == [head_mod.HEAD_GEMM_ROWS, 2 * head_mod.HEAD_GEMM_ROWS + 3]
    ids = torch.randint(0, head.out_features, (1, head_mod.HEAD_GEMM_ROWS), generator=g)
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model(ids).logits
        out = torch.compile(model, fullgraph=True, dynamic=False)(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
