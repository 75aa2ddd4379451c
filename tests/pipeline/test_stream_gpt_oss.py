"""Streaming gpt-oss (issue 71, item 4): its fused experts, stored as transformers' ``GptOssExperts``
declares them (``gate_up_proj`` ``[E, H, 2I]``, gate/up interleaved along the last dimension, with biases;
``down_proj`` ``[E, I, H]``) by ``save_pretrained`` in bf16, or as the hub's MXFP4 blocks and scales (rows
the output features), are read one expert at a time (``get_slice`` of one expert, never the whole fused
tensor); the model so read gives transformers' own logits, and GPTQ w4 g128 streamed gives the bytes of
the in-memory run."""

from __future__ import annotations

import math

import pytest
import safetensors
import torch

from bitmosaic.api import as_recipe, quantize_
from bitmosaic.io import save_quantized
from bitmosaic.io.sources.checkpoint import Checkpoint
from bitmosaic.io.sources.loading import load_model
from bitmosaic.modules.experts import unfuse_experts
from bitmosaic.pipeline import RunSettings
from bitmosaic.pipeline.stream import quantize_streaming
from bitmosaic.testing import tiny_moe, word_tokenizer
from tests.io.test_mxfp4_source import _mxfp4_folder

from .test_stream import _same_folder

RECIPE = ("gptq", {"bits": 4, "group_size": 128})
_FUSED = ("experts.gate_up_proj", "experts.down_proj")  # and their _bias, _blocks, _scales


def _model():
    """A tiny gpt-oss whose every linear is 128 wide (one group of 128): 4 heads of 32, experts of 128."""
    return tiny_moe("gpt_oss", hidden_size=128, intermediate_size=128, head_dim=32)


def _src(tmp, layout: str):
    """The tiny gpt-oss as ``save_pretrained`` writes it in bf16, or with MXFP4 experts (the hub's)."""
    folder = tmp / f"src-{layout}"
    if layout == "mxfp4":
        _mxfp4_folder(folder, model=_model())
    else:
        _model().to(torch.bfloat16).save_pretrained(folder)
        word_tokenizer().save_pretrained(folder)
    return folder


def _reference(src, layout: str):
    """transformers' own model of the checkpoint (its MXFP4 decoding: ``Mxfp4Config(dequantize=True)``)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    kw = {"quantization_config": Mxfp4Config(dequantize=True)} if layout == "mxfp4" else {}
    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw).eval()


def _calib():
    return torch.randint(3, 128, (8, 32), generator=torch.Generator().manual_seed(0))


class _Reads:
    """A spy on ``safetensors.safe_open``: every fused expert tensor read, as (name, index, shape read)."""

    def __init__(self, monkeypatch) -> None:
        self.parts, self.whole = [], []
        real = safetensors.safe_open
        spy = self

        class _Slice:
            def __init__(self, sl, name):
                self.sl, self.name = sl, name

            def get_shape(self):
                return self.sl.get_shape()

            def __getitem__(self, idx):
                t = self.sl[idx]
                spy.parts.append((self.name, self.sl.get_shape(), idx, tuple(t.shape)))
                return t

        class _File:
            def __init__(self, *a, **k):
                self.f = real(*a, **k)

            def __enter__(self):
                self.f.__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def get_slice(self, name):
                sl = self.f.get_slice(name)
                return _Slice(sl, name) if any(s in name for s in _FUSED) else sl

            def get_tensor(self, name):
                if any(s in name for s in _FUSED):
                    spy.whole.append(name)
                return self.f.get_tensor(name)

            def __getattr__(self, attr):
                return getattr(self.f, attr)

        monkeypatch.setattr(safetensors, "safe_open", _File)

    def check_one_expert_each(self, experts: int, layers: int) -> None:
        """No fused tensor read whole; each slice read one expert (no more than that expert's elements,
        MXFP4 gate/up blocks: only half its rows), and every expert of every layer read."""
        assert not self.whole and self.parts
        seen = set()
        for name, full, idx, shape in self.parts:
            first = idx[0] if isinstance(idx, tuple) else idx
            assert isinstance(first, slice) and first.stop - first.start == 1, (name, idx)
            assert shape[0] == 1 and math.prod(shape) <= math.prod(full[1:]), (name, full, shape)
            if name.endswith("gate_up_proj_blocks"):
                assert shape[1] == full[1] // 2, (name, shape)
            seen.add((name, first.start))
        names = {n for n, *_ in self.parts}
        assert len(names) == layers * (6 if any(n.endswith("_blocks") for n in names) else 4)
        assert seen == {(n, e) for n in names for e in range(experts)}


@pytest.mark.parametrize("layout", ["bf16", "mxfp4"])
def test_experts_read_one_by_one_give_transformers_logits(layout, tmp_path, monkeypatch):
    src = _src(tmp_path, layout)
    ref = _reference(src, layout)
    reads = _Reads(monkeypatch)
    ckpt = Checkpoint(src)
    model = ckpt.empty_model(torch.float32)
    assert unfuse_experts(model) == 2
    ckpt.fill(model, "", torch.float32)
    reads.check_one_expert_each(experts=4, layers=2)
    for li, layer in enumerate(model.model.layers):  # each projection exactly transformers' own weights
        fused = ref.model.layers[li].mlp.experts
        for e, expert in enumerate(layer.mlp.experts):
            gu, gub = fused.gate_up_proj[e], fused.gate_up_proj_bias[e]
            assert torch.equal(expert.gate_proj.weight, gu[:, 0::2].T)
            assert torch.equal(expert.up_proj.weight, gu[:, 1::2].T)
            assert torch.equal(expert.down_proj.weight, fused.down_proj[e].T)
            assert torch.equal(expert.gate_proj.bias, gub[0::2])
            assert torch.equal(expert.up_proj.bias, gub[1::2])
            assert torch.equal(expert.down_proj.bias, fused.down_proj_bias[e])
            assert expert.gate_proj.weight.is_contiguous()
    ids = _calib()[:2]
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids).logits
    assert torch.isfinite(want).all()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()  # the unfused sums' order only


@pytest.mark.parametrize("layout,budget", [("bf16", None), ("mxfp4", None), ("bf16", 40_000)])
def test_streamed_gpt_oss_bytes_equal_the_in_memory_run(layout, budget, tmp_path, monkeypatch):
    """``budget``: past it the experts are read part by part during the layer (lazy_experts.py)."""
    src = _src(tmp_path, layout)
    model, _ = load_model(str(src), dtype=torch.float32)  # bitmosaic's in-memory load (MXFP4 decoded)
    quantize_(model, RECIPE[0], _calib(), progress=False, moe_min_tokens=1, **RECIPE[1])
    mem = save_quantized(model, tmp_path / "mem")
    reads = _Reads(monkeypatch)
    quantize_streaming(Checkpoint(src), word_tokenizer(), tmp_path / "str", as_recipe(*RECIPE), _calib(),
                       RunSettings(progress=False, moe_min_tokens=1, max_memory=budget))  # fmt: skip
    reads.check_one_expert_each(experts=4, layers=2)
    _same_folder(mem, tmp_path / "str")
