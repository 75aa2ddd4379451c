"""Calibration activations spilled to disk (``bitmosaic.pipeline.spill``): the same saved bytes with and
without spilling (in memory, streamed, and resumed after an interruption while spilled), at most two
batches in memory at once, the spill folder removed however the run ends, the streamed resume file
written and read one batch at a time, and ``--max-memory`` parsed with one-line errors."""

from __future__ import annotations

import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import bitmosaic
from bitmosaic import quantize_
from bitmosaic.cli import build_parser, main
from bitmosaic.errors import OptionError
from bitmosaic.io import save_quantized
from bitmosaic.pipeline import loop as P
from bitmosaic.pipeline import spill as S
from bitmosaic.pipeline.calibration import LayerInputs
from bitmosaic.pipeline.spill import SpillStore, TensorFile, parse_size, write_tensor_file
from bitmosaic.pipeline.stream import LayerStore, partial_dir
from bitmosaic.testing import save_hf_dir, words
from tests.pipeline.test_pipeline import tiny_llama
from tests.pipeline.test_stream import CASES, _calib, _same_folder, _src, _stream

_TINY = "1KB"  # a budget every activation exceeds: always spill


# --- the store and the file format ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_spill_store_gives_back_the_bytes_written_one_generation_at_a_time(dtype, tmp_path):
    g = torch.Generator().manual_seed(0)
    first = [torch.randn(n, 5, 8, generator=g).to(dtype) for n in (4, 4, 2)]
    s = SpillStore(tmp_path)
    assert s.dir.parent == tmp_path and s.dir.name.startswith(S.SPILL_PREFIX)
    for t in first:
        s.append(t)
    assert len(s) == 3 and all(torch.equal(s.read(i), first[i]) for i in (2, 0, 1))
    nxt = [t * 2 for t in first]
    for i in (1, 0, 2):  # any order; batch i of this generation stays readable until advance()
        assert torch.equal(s.read(i), first[i])
        s.write(i, nxt[i])
    assert sorted(p.name for p in s.dir.iterdir()) == ["activations-00000.bin", "activations-00001.bin"]
    s.advance()
    assert [p.name for p in s.dir.iterdir()] == ["activations-00001.bin"]  # the old generation is gone
    assert all(torch.equal(s.read(i), nxt[i]) and s.read(i).dtype == dtype for i in range(3))
    assert s.nbytes() == sum(t.numel() * t.element_size() for t in nxt)
    with pytest.raises(RuntimeError, match="only 1 of 3"):
        s.write(0, nxt[0])
        s.advance()
    s.close()
    s.close()  # idempotent
    assert not s.dir.exists()
    gone = SpillStore(tmp_path)
    shutil.rmtree(gone.dir)  # a write that fails (a full disk, a vanished folder) says what to do
    with pytest.raises(OSError, match="free disk space there, or raise --max-memory"):
        gone.append(first[0])


def test_a_streamed_tensor_file_is_a_safetensors_file_both_ways(tmp_path):
    g = torch.Generator().manual_seed(1)
    ts = {"b0": torch.randn(3, 4, generator=g).bfloat16(), "b1": torch.randn(2, 4, generator=g),
          "gen_state": torch.Generator().manual_seed(3).get_state()}  # fmt: skip
    names = list(ts)
    write_tensor_file(tmp_path / "a.safetensors", [(n, tuple(ts[n].shape), ts[n].dtype) for n in names],
                      lambda i: ts[names[i]], {"format": "pt"})  # fmt: skip
    back = load_file(str(tmp_path / "a.safetensors"))  # safetensors reads ours
    assert sorted(back) == sorted(ts) and all(torch.equal(back[n], ts[n]) for n in ts)
    save_file(ts, str(tmp_path / "b.safetensors"))  # and we read safetensors'
    with TensorFile(tmp_path / "b.safetensors") as f:
        assert sorted(f.keys()) == sorted(ts) and all(torch.equal(f.get(n), ts[n]) for n in ts)
    with pytest.raises(ValueError, match="announced"):
        write_tensor_file(tmp_path / "c.safetensors", [("x", (2,), torch.float32)], lambda i: torch.zeros(3))


def test_parse_size():
    assert parse_size("8GB") == 8 * 2**30 and parse_size("8gib") == parse_size("8G") == 8 * 2**30
    assert parse_size("512MB") == 512 * 2**20 and parse_size("1.5TB") == int(1.5 * 2**40)
    assert parse_size("100B") == 100 and parse_size(4096) == 4096 and parse_size(" 2 kb ") == 2048
    assert parse_size(None) is None and parse_size("auto") is None
    for bad, needle in [("8", "unit"), ("8XB", "unit"), ("lots", "unit"), ("-1GB", "unit"),
                        ("0MB", "more than 0"), (0, "more than 0"), (1.5, "not a size"),
                        (True, "not a size")]:  # fmt: skip
        with pytest.raises(OptionError, match=needle) as e:
            parse_size(bad)
        assert "\n" not in str(e.value)


def test_the_decision_compares_inputs_and_outputs_with_40_percent_of_the_budget():
    need = 2 * 1000 * 64 * 2  # 1000 tokens x 64 values in bf16, in and out
    at = S.spill_decision(1000, 64, torch.bfloat16, int(need / S.SPILL_FRACTION), host=True)
    assert not at["spilled"] and at["budget_from"] == "max_memory"
    assert S.spill_decision(1000, 64, torch.bfloat16, int(need / S.SPILL_FRACTION) - 1, host=True)["spilled"]
    assert not S.spill_decision(1000, 64, torch.bfloat16, 1, host=False)["spilled"]  # on a GPU
    auto = S.spill_decision(1000, 64, torch.bfloat16, None, host=True)
    assert auto["budget_from"] == "MemAvailable" and auto["budget_mb"] > 0 and not auto["spilled"]


# --- the pipeline -----------------------------------------------------------------------------------


@pytest.fixture
def calib():
    return torch.randint(0, 128, (6, 32), generator=torch.Generator().manual_seed(0))


_KW = {"bits": 3, "group_size": 32, "progress": False, "batch_size": 2}


@pytest.mark.parametrize(
    "method,opts,dtype",
    [("gptq", {"order": "act"}, torch.float32), ("gptq", {}, torch.bfloat16), ("awq", {}, torch.float32)],
)
def test_spilled_in_memory_run_saves_the_same_bytes(method, opts, dtype, calib, tmp_path):
    saved = {}
    for budget in (None, _TINY):
        m = tiny_llama(layers=3).to(dtype)
        rep = quantize_(m, method, calib, max_memory=budget, spill_dir=tmp_path, **_KW, **opts)
        rec = rep.calibration["spill"]
        assert rec["spilled"] is (budget is not None)
        assert rep.calibration["output_cache"] is (budget is None)  # it, too, must fit in 40% of the budget
        if budget is not None:
            assert Path(rec["dir"]).parent == tmp_path and not Path(rec["dir"]).exists()
        saved[budget] = save_quantized(m, tmp_path / f"out-{budget}")
    assert not list(tmp_path.glob(S.SPILL_PREFIX + "*"))
    _same_folder(saved[None], saved[_TINY])


def test_spilling_holds_at_most_two_batches_and_its_files_go(calib, tmp_path, monkeypatch):
    """Every batch the run holds comes from a read of the spill file or is an output written to it:
    at most two of them (one batch of inputs, one of outputs) are alive at any read or write."""
    alive: list[weakref.ref] = []
    peak, seen = [0], []
    real_read, real_write = SpillStore.read, SpillStore.write

    def count():
        alive[:] = [r for r in alive if r() is not None]
        peak[0] = max(peak[0], len(alive))

    def read(self, i):
        count()
        t = real_read(self, i)
        alive.append(weakref.ref(t))
        return t

    def write(self, i, t):
        alive.append(weakref.ref(t))
        count()
        seen.append(sorted(p.name for p in self.dir.iterdir()))
        real_write(self, i, t)

    monkeypatch.setattr(SpillStore, "read", read)
    monkeypatch.setattr(SpillStore, "write", write)
    kept = []
    real_init = LayerInputs.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        kept.append(self)

    monkeypatch.setattr(LayerInputs, "__init__", init)
    m = tiny_llama(layers=3)
    big = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(0))  # 8 batches
    rep = quantize_(m, "gptq", big, max_memory=_TINY, spill_dir=tmp_path, **_KW)
    assert len(seen) == 3 * 8  # every output of every layer went to the file
    assert seen[0] == ["activations-00000.bin"]
    assert seen[1] == ["activations-00000.bin", "activations-00001.bin"]
    assert 1 <= peak[0] <= 2, peak
    assert kept and kept[0].spilled and kept[0].batches == []  # nothing kept in memory
    assert not Path(rep.calibration["spill"]["dir"]).exists()


def test_the_spill_folder_goes_when_the_run_fails(calib, tmp_path, monkeypatch):
    made = []
    real = SpillStore.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        made.append(self.dir)

    def boom(*a, **k):
        assert made and made[0].is_dir() and any(made[0].iterdir())  # spilled before the failure
        raise RuntimeError("solver failed")

    monkeypatch.setattr(SpillStore, "__init__", init)
    monkeypatch.setattr(P, "quantize_shared", boom)
    with pytest.raises(RuntimeError, match="solver failed"):
        quantize_(tiny_llama(), "gptq", calib, max_memory=_TINY, spill_dir=tmp_path, **_KW)
    assert made and not made[0].exists()


# --- streamed runs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["gptq-act", "awq"])
def test_spilled_streamed_run_saves_the_in_memory_bytes(case, tmp_path, monkeypatch):
    src = _src(tmp_path)
    method, opts, scheme = CASES[case]
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    rep = bitmosaic.quantize_(m, method, _calib(), progress=False, scheme=scheme, **opts)
    assert rep.calibration["spill"]["spilled"] is False
    mem = save_quantized(m, tmp_path / "mem")
    where = []
    real_write = SpillStore.write

    def write(self, i, t):
        where.append(self.dir)
        real_write(self, i, t)

    monkeypatch.setattr(SpillStore, "write", write)
    rep = _stream(src, tmp_path / "str", case, max_memory=_TINY)
    assert rep.calibration["spill"]["spilled"] and where
    assert where[0].parent == partial_dir(tmp_path / "str")  # in the output's work folder
    _same_folder(mem, tmp_path / "str")
    assert not partial_dir(tmp_path / "str").exists()
    assert not [p for p in (tmp_path / "str").iterdir() if p.name.startswith(S.SPILL_PREFIX)]


class _Crash(Exception):
    pass


@pytest.mark.parametrize("at", [0, 1])
def test_resume_while_spilled_gives_the_same_bytes(at, tmp_path, monkeypatch):
    """An interrupted spilled run resumes -- spilled again, from a resume file read one batch at a
    time -- to the bytes of an uninterrupted run without spilling; a spill folder a killed process
    left in the work folder is removed and never reaches the output."""
    src = _src(tmp_path, layers=3)
    _stream(src, tmp_path / "whole", "gptq-act")
    real_done = LayerStore.done

    def done(self, li, *a):
        real_done(self, li, *a)
        if li == at:
            raise _Crash

    monkeypatch.setattr(LayerStore, "done", done)
    with pytest.raises(_Crash):
        _stream(src, tmp_path / "out", "gptq-act", max_memory=_TINY)
    work = partial_dir(tmp_path / "out")
    assert json.loads((work / "progress.json").read_text())["layers_done"] == at + 1
    assert not list(work.glob(S.SPILL_PREFIX + "*"))  # removed on the way out
    (work / (S.SPILL_PREFIX + "killed")).mkdir()  # what a kill -9 would leave
    (work / (S.SPILL_PREFIX + "killed") / "activations-00003.bin").write_bytes(b"x" * 100)
    monkeypatch.setattr(LayerStore, "done", real_done)
    reads = []
    real_get = TensorFile.get

    def get(self, name):
        reads.append(name)
        return real_get(self, name)

    monkeypatch.setattr(TensorFile, "get", get)
    rep = _stream(src, tmp_path / "out", "gptq-act", max_memory=_TINY)
    assert rep.calibration["spill"]["spilled"] and len(rep.layers) == 3 * 7
    assert reads == ["gen_state", "b0", "b1"]  # 8 samples, batch size 4: read one at a time
    _same_folder(tmp_path / "whole", tmp_path / "out")
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(S.SPILL_PREFIX)]


# --- the CLI ----------------------------------------------------------------------------------------


def test_cli_max_memory_spills_beside_out_and_bad_values_are_one_line(tmp_path, capsys):
    assert build_parser().parse_args(["quantize"]).max_memory == "auto"
    src = save_hf_dir(tmp_path / "float")
    text = tmp_path / "t.txt"
    text.write_text(words(2000))
    base = ["quantize", "--model", str(src), "--calib", str(text), "--method", "gptq", "--group-size", "32",
            "--nsamples", "4", "--seqlen", "16", "--batch-size", "2", "--no-progress", "--device", "cpu",
            "--stream", "off"]  # fmt: skip
    for bad in ("8", "lots", "0GB"):
        capsys.readouterr()
        assert main([*base, "--max-memory", bad, "--out", str(tmp_path / "never")]) == 2
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
        assert len(lines) == 1 and "--max-memory" in lines[0] and "8GB" in lines[0], err
    assert not (tmp_path / "never").exists()
    for budget, name in (("auto", "mem"), ("1KB", "spilled")):
        out = tmp_path / "runs" / name
        js = tmp_path / f"{name}.json"
        assert main([*base, "--max-memory", budget, "--out", str(out), "--json", str(js)]) == 0
        assert ("spilled to" in capsys.readouterr().out) is (budget != "auto")
    rec = json.loads((tmp_path / "spilled.json").read_text())["calibration"]["spill"]
    assert rec["spilled"] and Path(rec["dir"]).parent == tmp_path / "runs" and rec["budget_mb"] == 0.0
    assert json.loads((tmp_path / "mem.json").read_text())["calibration"]["spill"]["spilled"] is False
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["mem", "spilled"]  # nothing left
    _same_folder(tmp_path / "runs" / "mem", tmp_path / "runs" / "spilled")


def test_stream_auto_follows_the_budget(tmp_path):
    from bitmosaic.cli.stream import should_stream
    from bitmosaic.pipeline.recipe import Recipe

    src = save_hf_dir(tmp_path / "float")
    args = build_parser().parse_args(["quantize", "--model", str(src), "--out", str(tmp_path / "o")])
    recipe = Recipe.from_options("gptq", {})
    assert not should_stream(args, recipe, torch.float32)  # a tiny model: far under the free memory
    args.max_memory = "1KB"
    assert should_stream(args, recipe, torch.float32)
