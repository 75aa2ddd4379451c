"""Streaming quantization (``bitmosaic.pipeline.stream``): the same bytes as the in-memory path for
every method that can stream, a one-line refusal for the one that cannot, and resume after an
interruption (in-process at every layer, and ``kill -9`` of the CLI) with bit-identical output."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import bitmosaic
from bitmosaic.api import as_recipe
from bitmosaic.errors import OptionError
from bitmosaic.io import save_quantized
from bitmosaic.io.sources.checkpoint import Checkpoint
from bitmosaic.pipeline import RunSettings, stream
from bitmosaic.pipeline.stream import LayerStore, partial_dir, quantize_streaming
from bitmosaic.testing import word_tokenizer, words

SRC = Path(__file__).resolve().parents[2] / "src"

CASES = {
    "rtn": ("rtn", {"bits": 4, "group_size": 32}, None),
    "gptq-act": ("gptq", {"bits": 3, "group_size": 32, "order": "act"}, None),
    "awq": ("awq", {"bits": 3, "group_size": 32}, None),
    "smoothquant-w8a8": ("smoothquant", {"group_size": None}, "W8A8"),
    "mosaic": ("mosaic", {"budget_frac": 0.25, "block": "32x32"}, "W4A8"),
    "sq-acts-static": ("sq-acts", {"bits": 4, "group_size": 32, "sq": "16-(8/4)-0.5", "strategy": "static"},
                       None),
    "dpq": ("dpq", {"bits": 4, "group_size": 32}, None),
    "hptq": ("hptq", {"target_bits": 3.5}, None),
}


def _model(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=layers % 2 == 0)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def _src(tmp: Path, layers: int = 2) -> Path:
    m = _model(layers)
    m.save_pretrained(tmp / "src", safe_serialization=True)
    word_tokenizer().save_pretrained(tmp / "src")
    return tmp / "src"


def _calib():
    return torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _same_folder(a: Path, b: Path) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)
    assert not [k for k in ta if not torch.equal(ta[k], tb[k])]
    qa = json.loads((a / "config.json").read_text())["quantization_config"]
    qb = json.loads((b / "config.json").read_text())["quantization_config"]
    assert qa == qb


_QUIET = RunSettings(progress=False)


def _stream(src: Path, out: Path, case: str, **kw):
    method, opts, scheme = CASES[case]
    return quantize_streaming(Checkpoint(src), word_tokenizer(), out, as_recipe(method, dict(opts), scheme),
                              _calib(), RunSettings(progress=False, **kw))  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_bytes_equal_the_in_memory_run(case, tmp_path):
    src = _src(tmp_path)
    method, opts, scheme = CASES[case]
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    bitmosaic.quantize_(m, method, _calib(), progress=False, scheme=scheme, **opts)
    mem = save_quantized(m, tmp_path / "mem")
    _stream(src, tmp_path / "str", case)
    _same_folder(mem, tmp_path / "str")
    assert (tmp_path / "str" / "model.safetensors.index.json").is_file()
    assert not partial_dir(tmp_path / "str").exists()
    with torch.inference_mode():  # and it loads through transformers' own loader as before
        x = _calib()[:1]
        assert torch.equal(bitmosaic.load(mem)(x).logits, bitmosaic.load(tmp_path / "str")(x).logits)


def test_a_method_with_a_whole_model_step_is_refused_in_one_line(tmp_path):
    src = _src(tmp_path)
    with pytest.raises(OptionError, match="whole-model step") as e:
        quantize_streaming(Checkpoint(src), word_tokenizer(), tmp_path / "o",
                           as_recipe("sfmp", {"bpw": 3.25}), _calib(), _QUIET)  # fmt: skip
    assert "\n" not in str(e.value)


class _Crash(Exception):
    pass


@pytest.mark.parametrize(
    "case,at,when",  # every layer, both moments, a Hessian method, a smoothing one and a Hessian-free one
    [("gptq-act", 0, "after-commit"), ("awq", 1, "before-commit"), ("rtn", 2, "after-commit"),
     ("gptq-act", 2, "before-commit"), ("awq", 0, "before-commit")],
)  # fmt: skip
def test_resume_after_an_interruption_gives_the_same_bytes(case, at, when, tmp_path, monkeypatch):
    src = _src(tmp_path, layers=3)
    _stream(src, tmp_path / "whole", case)
    real_done, real_write = LayerStore.done, stream.atomic_write_text

    def done(self, li, *a):
        if when == "before-commit" and li == at:  # the shard is written, progress.json is not
            monkeypatch.setattr(stream, "atomic_write_text", lambda *x: (_ for _ in ()).throw(_Crash()))
        real_done(self, li, *a)
        if li == at:
            raise _Crash

    monkeypatch.setattr(LayerStore, "done", done)
    with pytest.raises(_Crash):
        _stream(src, tmp_path / "out", case)
    progress = json.loads((partial_dir(tmp_path / "out") / "progress.json").read_text()) if at or when == \
        "after-commit" else None  # fmt: skip
    if progress is not None:
        assert progress["layers_done"] == (at + 1 if when == "after-commit" else at)
    monkeypatch.setattr(LayerStore, "done", real_done)
    monkeypatch.setattr(stream, "atomic_write_text", real_write)
    rep = _stream(src, tmp_path / "out", case)
    _same_folder(tmp_path / "whole", tmp_path / "out")
    assert len(rep.layers) == 3 * 7


def test_a_rerun_with_another_recipe_or_calibration_refuses(tmp_path, monkeypatch):
    src = _src(tmp_path, layers=3)

    def done(self, li, *a):
        LayerStore.__dict__["_real"](self, li, *a)
        raise _Crash

    monkeypatch.setattr(LayerStore, "_real", LayerStore.done, raising=False)
    monkeypatch.setattr(LayerStore, "done", done)
    with pytest.raises(_Crash):
        _stream(src, tmp_path / "out", "rtn")
    with pytest.raises(OptionError, match="different recipe") as e:
        quantize_streaming(Checkpoint(src), word_tokenizer(), tmp_path / "out", as_recipe("rtn", {"bits": 3}),
                           _calib(), RunSettings(progress=False))  # fmt: skip
    assert "delete" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(OptionError, match="different calibration tokens"):
        quantize_streaming(Checkpoint(src), word_tokenizer(), tmp_path / "out",
                           as_recipe(*CASES["rtn"][:2]), _calib() + 1, _QUIET)  # fmt: skip


_SLOW_MAIN = """
import sys, time
from bitmosaic.pipeline.stream import LayerStore
real = LayerStore.done
def done(self, *a):
    real(self, *a)
    time.sleep(0.4)  # time for the test to kill -9 between layers
LayerStore.done = done
from bitmosaic.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_kill_9_then_the_same_command_finishes_bit_identical(tmp_path):
    src = _src(tmp_path, layers=5)
    text = tmp_path / "t.txt"
    text.write_text(words(3000))
    env = {**os.environ, "PYTHONPATH": str(SRC)}

    def argv(out):
        return ["quantize", "--model", str(src), "--method", "gptq", "--bits", "4", "--group-size", "32",
                "--calib", str(text), "--nsamples", "4", "--seqlen", "32", "--out", str(out),
                "--stream", "on", "--no-progress"]  # fmt: skip

    from bitmosaic.cli import main

    assert main(argv(tmp_path / "whole")) == 0  # the uninterrupted run, in this process
    run = [sys.executable, "-c", _SLOW_MAIN]
    p = subprocess.Popen(run + argv(tmp_path / "out"), env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)  # fmt: skip
    prog = partial_dir(tmp_path / "out") / "progress.json"
    t0 = time.time()
    while time.time() - t0 < 120:
        try:
            if json.loads(prog.read_text())["layers_done"] >= 2:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    done = json.loads(prog.read_text())["layers_done"]
    assert 2 <= done < 5 and not (tmp_path / "out").exists()
    again = subprocess.run([sys.executable, "-m", "bitmosaic.cli"] + argv(tmp_path / "out"), env=env,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming" in again.stdout
    _same_folder(tmp_path / "whole", tmp_path / "out")
    assert not partial_dir(tmp_path / "out").exists()
