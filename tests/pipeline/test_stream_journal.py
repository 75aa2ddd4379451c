"""Resume inside a streamed layer, expert by expert (issue 71, item 4; pipeline/journal.py): a run
killed between two experts' solves (in-process, and ``kill -9`` of the CLI) resumes to the bytes of an
uninterrupted run, solving only what the killed run had not journaled."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bitmosaic.api import as_recipe
from bitmosaic.errors import OptionError
from bitmosaic.formats.act import ActQuantSpec
from bitmosaic.io.sources.checkpoint import Checkpoint
from bitmosaic.pipeline import RunSettings, solve
from bitmosaic.pipeline.journal import LayerJournal, journal_dir
from bitmosaic.pipeline.stream import partial_dir, quantize_streaming
from bitmosaic.testing import word_tokenizer, words

from .test_stream import SRC, _same_folder
from .test_stream import _src as _dense_src
from .test_stream_moe import _calib, _src

GPTQ = ("gptq", {"bits": 4, "group_size": 16})


class _Stop(KeyboardInterrupt):
    """A signal between two solves (SIGINT/SIGTERM reach a run as a KeyboardInterrupt)."""


def _run(src, out, recipe=GPTQ, **kw):
    settings = RunSettings(progress=False, **{"moe_min_tokens": 1, **kw})
    return quantize_streaming(Checkpoint(src), word_tokenizer(), out, as_recipe(*recipe), _calib(), settings)


def _crash_after(monkeypatch, n: int, error=None) -> list:
    """Raise ``error`` (default a signal) after the ``n``-th journaled unit (a kill between two solves); the
    units written, by layer."""
    real_add, written = LayerJournal.add, []

    def add(self, solved):
        real_add(self, solved)
        if solved:
            written.append(self.folder.name)
            if len(written) == n:
                raise (error or _Stop)()

    monkeypatch.setattr(LayerJournal, "add", add)
    return written


def _count_solves(monkeypatch) -> list:
    real, calls = solve.quantize_shared, []

    def counted(job, *a, **k):
        calls.extend(f"{job.prefix}.{n}" for n in job.names)
        return real(job, *a, **k)

    monkeypatch.setattr("bitmosaic.pipeline.loop.quantize_shared", counted)
    return calls


@pytest.mark.parametrize(
    "naming,settings,units",  # a kill inside layer 1; inside layer 0 (no progress.json yet); in parts,
    [("fused", {}, 14), ("hub", {}, 3),  # with thin experts on the pooled Hessian, experts read lazily
     ("hub", {"max_memory": 20_000, "moe_min_tokens": 120}, 13)],
)  # fmt: skip
def test_a_kill_between_experts_resumes_to_the_same_bytes(naming, settings, units, tmp_path, monkeypatch):
    src = _src(tmp_path, "qwen3_moe", naming, layers=2)
    whole = _run(src, tmp_path / "whole", **settings)
    per_layer = len(whole.layers) // 2
    written = _crash_after(monkeypatch, units)
    with pytest.raises(_Stop):
        _run(src, tmp_path / "out", **settings)
    work = partial_dir(tmp_path / "out")
    layer = int(written[-1].split("-")[1])
    assert json.loads((work / "progress.json").read_text())["layers_done"] == layer
    kept = LayerJournal(journal_dir(work, layer))
    assert 0 < len(kept) < per_layer and kept.count == written.count(written[-1])
    monkeypatch.undo()
    solved = _count_solves(monkeypatch)
    rep = _run(src, tmp_path / "out", **settings)
    _same_folder(tmp_path / "whole", tmp_path / "out")
    assert len(solved) == (2 - layer) * per_layer - len(kept)  # journaled linears were not solved again
    assert not set(solved) & {f"model.layers.{layer}.{n}" for n in kept.where}
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert strip(json.loads(json.dumps(rep.layers))) == strip(json.loads(json.dumps(whole.layers)))
    assert rep.bits_per_weight == whole.bits_per_weight
    assert not work.exists()


def test_a_static_input_scale_is_restored_with_its_linear(tmp_path, monkeypatch):
    """A dense layer's attention solved before the kill: its W4A8-static input scales come back from the
    journal, so the layer's later groups and the next layer see the same quantized inputs."""
    src = _dense_src(tmp_path, layers=2)
    recipe = ("gptq", {"bits": 4, "group_size": 32, "act": ActQuantSpec("int", 8, granularity="tensor",
                                                                        static=True)})
    _run(src, tmp_path / "whole", recipe)
    _crash_after(monkeypatch, 5)  # layer 0's q/k/v, o, gate/up, down, then layer 1's q/k/v
    with pytest.raises(_Stop):
        _run(src, tmp_path / "out", recipe)
    kept = LayerJournal(journal_dir(partial_dir(tmp_path / "out"), 1))
    assert kept.count == 1 and len(kept) == 3
    assert all(s is not None for *_, s in kept.take(list(kept.where)))
    monkeypatch.undo()
    _run(src, tmp_path / "out", recipe)
    _same_folder(tmp_path / "whole", tmp_path / "out")


def test_a_journal_of_another_run_is_refused_not_installed(tmp_path, monkeypatch):
    src = _src(tmp_path, "qwen3_moe", "hub", layers=2)
    _crash_after(monkeypatch, 2)  # inside layer 0: only the journal's progress.json holds the fingerprint
    with pytest.raises(_Stop):
        _run(src, tmp_path / "out")
    monkeypatch.undo()
    with pytest.raises(OptionError, match="different recipe") as e:
        _run(src, tmp_path / "out", ("gptq", {"bits": 3, "group_size": 16}))
    assert "\n" not in str(e.value)


_SLOW_MAIN = """
import sys, time
from bitmosaic.pipeline.journal import LayerJournal
real = LayerJournal.add
def add(self, solved):
    real(self, solved)
    time.sleep(0.3)  # time for the test to kill -9 between two experts
LayerJournal.add = add
from bitmosaic.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_kill_9_between_experts_then_the_same_command_finishes_bit_identical(tmp_path):
    src = _src(tmp_path, "qwen3_moe", "fused", layers=2)
    text = tmp_path / "t.txt"
    text.write_text(words(3000))
    env = {**os.environ, "PYTHONPATH": str(SRC)}

    def argv(out):
        return ["quantize", "--model", str(src), "--method", "gptq", "--bits", "4", "--group-size", "16",
                "--calib", str(text), "--nsamples", "4", "--seqlen", "32", "--out", str(out),
                "--stream", "on", "--moe-min-tokens", "1", "--no-progress"]  # fmt: skip

    from bitmosaic.cli import main

    assert main(argv(tmp_path / "whole")) == 0
    p = subprocess.Popen([sys.executable, "-c", _SLOW_MAIN, *argv(tmp_path / "out")], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    folder = journal_dir(partial_dir(tmp_path / "out"), 1)
    t0 = time.time()
    while time.time() - t0 < 120 and len(list(folder.glob("unit-*.safetensors"))) < 6:
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    units = len(list(folder.glob("unit-*.safetensors")))
    assert units >= 6 and not (tmp_path / "out").exists()
    again = subprocess.run([sys.executable, "-m", "bitmosaic.cli", *argv(tmp_path / "out")], env=env,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resuming after 1 finished layers, {units} solves of layer 1 kept" in again.stdout
    _same_folder(tmp_path / "whole", tmp_path / "out")


def test_an_error_in_the_first_layer_leaves_nothing_to_resume(tmp_path, monkeypatch):
    """An error (not a signal) before any layer is committed removes the work folder, journal included,
    so the rerun with the fix starts afresh instead of refusing a changed command."""
    src = _src(tmp_path, "qwen3_moe", "hub", layers=2)
    _crash_after(monkeypatch, 2, error=lambda: OptionError("a refused setting"))
    with pytest.raises(OptionError, match="a refused setting"):
        _run(src, tmp_path / "out")
    assert not partial_dir(tmp_path / "out").exists()
    monkeypatch.undo()
    _run(src, tmp_path / "out", ("gptq", {"bits": 3, "group_size": 16}))  # another command: not refused
    assert (tmp_path / "out").is_dir()

