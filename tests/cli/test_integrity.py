"""Integrity of saved folders and of runs that are stopped (issue 26, sections 0 and 2): file hashes
and ``inspect --verify``, one run per ``--out``, ``--overwrite`` never deleting a user's files,
temporaries of a ``kill -9`` cleaned by the next run, SIGINT/SIGTERM stopping cleanly, and ``compare``
stopping its child.  Real signals go to real subprocesses (a SIGTERM that escaped its handler would
end the test runner)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bitmosaic
import bitmosaic.io as bm_io
from bitmosaic.cli import main
from tests.cli.test_bad_inputs import _error_line, _never, _quantize
from tests.helpers import quantized_dir, save_hf_dir, snapshot, words


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    (root / "text.txt").write_text(words(2000))
    return save_hf_dir(root / "float"), root / "text.txt"


@pytest.fixture(scope="module")
def qdir(tmp_path_factory):
    return quantized_dir(tmp_path_factory.mktemp("q") / "q")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sums(folder: Path) -> dict[str, str]:
    lines = (folder / "SHA256SUMS").read_text().splitlines()
    return {ln[66:]: ln[:64] for ln in lines}


def _flip_tensor_byte(file: Path) -> None:
    """Change one byte of the tensor data (not the header): every loader's header check still passes."""
    data = bytearray(file.read_bytes())
    data[-1] ^= 0x01
    file.write_bytes(bytes(data))


def _child(tmp_path: Path, patch: str, argv: list[str], sig_wait: bool = True) -> subprocess.CompletedProcess:
    """Run ``main(argv)`` in a fresh interpreter after ``patch`` (Python that plants a signal)."""
    script = tmp_path / "child.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from pathlib import Path\n"
        "from bitmosaic.cli import main\n" + patch + f"\nsys.exit(main({argv!r}))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(bitmosaic.__file__).parents[1]),
                                                        str(Path(__file__).parents[2])])}  # fmt: skip
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)


_SIGNAL_IN_SAVE = """
import bitmosaic.io.saved.save as ser
real = ser.write_safetensors
def hit(*a, **k):
    real(*a, **k)
    os.kill(os.getpid(), signal.{sig})
    time.sleep(30)  # the signal arrives first
ser.write_safetensors = hit
"""


# --- hashes ----------------------------------------------------------------------------------------


def test_saved_folder_records_a_sha256_per_file(qdir, src, tmp_path):
    sums = _sums(qdir)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(sums)
    assert sums == {n: _sha(qdir / n) for n in sums}
    assert sorted(sums) == sorted(p.name for p in qdir.iterdir() if p.name != "SHA256SUMS")
    if shutil.which("sha256sum"):  # the list is in sha256sum's own format
        subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=qdir, check=True)
    model, text = src  # a streamed run writes shards: each is listed too
    out = tmp_path / "s"
    assert main(_quantize(model, text, "--out", str(out), "--stream", "on")) == 0
    sums = _sums(out)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) == 4 and set(shards) <= set(sums)
    assert sums == {n: _sha(out / n) for n in sums} and "model.safetensors.index.json" in sums


@pytest.mark.parametrize("how", ["tensor", "config", "deleted", "extra-shard"])
def test_inspect_verify_names_the_changed_file(qdir, tmp_path, capsys, how):
    path = tmp_path / "q"
    shutil.copytree(qdir, path)
    assert main(["inspect", str(path), "--verify"]) == 0
    assert "all" in capsys.readouterr().out
    if how == "tensor":
        _flip_tensor_byte(path / "model.safetensors")
        assert main(["inspect", str(path)]) == 0  # the headers still match: only the hashes see it
        name = "model.safetensors"
    elif how == "config":
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"]["method"] = "gptq"
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        name = "config.json"
    elif how == "deleted":
        (path / "tokenizer.json").unlink()
        name = "tokenizer.json"
    else:
        shutil.copy(path / "model.safetensors", path / "model-00002-of-00002.safetensors")
        name = "model-00002-of-00002.safetensors"
    line = _error_line(capsys, ["inspect", str(path), "--verify"])
    assert str(path / name) in line, line
    assert ("missing" if how == "deleted" else "not saved" if how == "extra-shard" else "differs") in line


def test_inspect_verify_says_when_a_folder_predates_the_hashes(qdir, tmp_path, capsys):
    path = tmp_path / "q"
    shutil.copytree(qdir, path)
    (path / "SHA256SUMS").unlink()
    capsys.readouterr()
    assert main(["inspect", str(path), "--verify"]) == 0
    captured = capsys.readouterr()
    warn = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert len(warn) == 1 and "no SHA256SUMS" in warn[0] and "cannot be verified" in warn[0], warn
    assert "verified" not in captured.out


def test_reproduce_checks_the_hashes_before_anything(qdir, tmp_path, capsys, monkeypatch):
    path = tmp_path / "q"
    shutil.copytree(qdir, path)
    _flip_tensor_byte(path / "model.safetensors")
    monkeypatch.setattr(bm_io, "load_model", _never)
    line = _error_line(capsys, ["reproduce", str(path), "--device", "cpu"])
    assert str(path / "model.safetensors") in line and "SHA-256" in line


# --- one run per --out, and --overwrite ----------------------------------------------------------


def test_a_second_run_into_the_same_out_refuses(src, tmp_path, capsys):
    model, text = src
    out = tmp_path / "q"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom bitmosaic.io.saved.outdir import output_lock\n"
         "with output_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(120)\n", str(out)],
        stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(bitmosaic.__file__).parents[1])},
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        line = _error_line(capsys, _quantize(model, text, "--out", str(out)))
        assert f"pid {holder.pid}" in line and str(out) in line and "another bitmosaic run" in line
        assert not out.exists()
    finally:
        holder.kill()  # as kill -9: the kernel drops its lock, its lock file stays behind
        holder.wait()
    assert (tmp_path / ".q.lock").exists()
    assert main(_quantize(model, text, "--out", str(out))) == 0  # a dead holder blocks nothing
    assert not (tmp_path / ".q.lock").exists()


@pytest.mark.parametrize("hashes", [True, False])
def test_overwrite_refuses_to_delete_a_users_files(qdir, src, tmp_path, capsys, monkeypatch, hashes):
    model, text = src
    out = tmp_path / "q"
    shutil.copytree(qdir, out)
    if not hashes:  # a folder from before SHA256SUMS: the names bitmosaic writes are its own
        (out / "SHA256SUMS").unlink()
    (out / "notes.txt").write_text("mine")
    (out / "plots").mkdir()
    before = snapshot(out)
    monkeypatch.setattr(bm_io, "load_model", _never)
    line = _error_line(capsys, _quantize(model, text, "--out", str(out), "--overwrite"))
    assert "notes.txt" in line and "plots/" in line and "--overwrite" in line
    assert snapshot(out) == before
    monkeypatch.undo()
    (out / "notes.txt").unlink()
    (out / "plots").rmdir()
    assert main(_quantize(model, text, "--out", str(out), "--overwrite")) == 0  # its own files only: fine
    assert (out / "SHA256SUMS").is_file()


# --- kill -9, SIGINT, SIGTERM ---------------------------------------------------------------------


def test_kill_9_leftovers_are_cleaned_by_the_next_run(src, tmp_path, capsys):
    model, text = src
    parent = tmp_path / "out"
    argv = _quantize(model, text, "--out", str(parent / "a"))
    r = _child(tmp_path, _SIGNAL_IN_SAVE.format(sig="SIGKILL"), argv)
    assert r.returncode == -signal.SIGKILL
    tmp_left = list(parent.glob(".a.tmp-*"))
    assert len(tmp_left) == 1 and (tmp_left[0] / "model.safetensors").is_file()
    assert main(_quantize(model, text, "--out", str(parent / "b"))) == 0  # same parent: cleans it
    assert not list(parent.glob(".a.tmp-*"))
    # kill -9 between the two renames of an --overwrite: the old model waits under .b.old-, b is gone
    renames = (
        "real = os.replace\n"
        "def rep(s, d):\n"
        "    if Path(s).name.startswith('.b.tmp-') and Path(d).name == 'b':\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return real(s, d)\n"
        "os.replace = rep\n"
    )
    old_b = snapshot(parent / "b")
    argv = _quantize(model, text, "--out", str(parent / "b"), "--overwrite", "--seed", "1")
    r = _child(tmp_path, renames, argv)
    assert r.returncode == -signal.SIGKILL and not (parent / "b").exists()
    assert len(list(parent.glob(".b.old-*"))) == 1 and len(list(parent.glob(".b.tmp-*"))) == 1
    (parent / ".c.tmp-mine").mkdir()  # looks like one, but bitmosaic did not mark it: never touched
    capsys.readouterr()
    assert main(_quantize(model, text, "--out", str(parent / "c"))) == 0
    err = capsys.readouterr().err
    left = sorted(p.name for p in parent.iterdir())
    assert left == [".c.tmp-mine", "b", "c"], left
    assert snapshot(parent / "b") == old_b  # put back, marker removed
    assert "restored" in err and "removed" in err


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_during_save_stops_cleanly(src, tmp_path, sig):
    model, text = src
    parent = tmp_path / "out"
    r = _child(tmp_path, _SIGNAL_IN_SAVE.format(sig=sig), _quantize(model, text, "--out", str(parent / "q")))
    signum = getattr(signal, sig)
    assert r.returncode == 128 + signum, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: interrupted by {sig}; temporary files removed, nothing half-written is left"]
    assert "Traceback" not in r.stderr
    assert not parent.exists()  # no model, no temporary, no lock file, not even the folder made for them


def test_sigterm_in_a_streamed_run_keeps_its_finished_layers(src, tmp_path):
    model, text = src
    out = tmp_path / "q"
    after_layer_0 = (
        "from bitmosaic.pipeline.stream import LayerStore\n"
        "real = LayerStore.done\n"
        "def done(self, li, *a):\n"
        "    real(self, li, *a)\n"
        "    if li == 0:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(30)\n"
        "LayerStore.done = done\n"
    )
    argv = _quantize(model, text, "--out", str(out), "--stream", "on")
    r = _child(tmp_path, after_layer_0, argv)
    assert r.returncode == 143, r.stderr[-2000:]
    assert "rerun the same command to resume" in r.stderr and "Traceback" not in r.stderr
    work = tmp_path / ".q.partial"
    assert json.loads((work / "progress.json").read_text())["layers_done"] == 1
    assert not out.exists() and not list(work.glob("*.tmp")) and not (tmp_path / ".q.lock").exists()
    assert main(argv) == 0  # resumes
    assert main(["inspect", str(out), "--verify"]) == 0 and not work.exists()


def test_stopping_compare_stops_its_child(src, tmp_path):
    psutil = pytest.importorskip("psutil")
    model, text = src
    out = tmp_path / "cmp"
    flags = ["--calib", str(text), "--nsamples", "2", "--seqlen", "16", "--eval", str(text),
             "--eval-seqlen", "16", "--max-windows", "2", "--device", "cpu", "--no-progress"]  # fmt: skip
    cmd = [sys.executable, "-m", "bitmosaic.cli", "compare", "--model", str(model), "--configs", "rtn:w4g32",
           "--out", str(out), *flags]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(bitmosaic.__file__).parents[1])}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        children = []
        while not children and time.monotonic() < deadline and proc.poll() is None:
            children = psutil.Process(proc.pid).children(recursive=True)
            time.sleep(0.05)
        assert children, "compare started no child"
        time.sleep(1.0)  # the child is importing or running
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-2000:]
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, [p.cmdline() for p in alive]
    assert not list(out.rglob("*.partial")) and not list(out.rglob(".*.tmp-*"))


_KILL_IN_EXPORT = """
import bitmosaic.io.export.common as common
real = common.write_safetensors
def hit(*a, **k):
    real(*a, **k)
    os.kill(os.getpid(), signal.SIGKILL)
common.write_safetensors = hit
"""


def test_export_kill_9_leftovers_are_cleaned_and_one_export_per_out(qdir, tmp_path, capsys):
    """``export --out`` builds in a marked temporary (a ``kill -9`` leaves it; the next export into the
    same parent removes it) and holds the output's lock (a second export refuses in one line)."""
    parent = tmp_path / "exp"

    def export(name):
        return ["export", str(qdir), "--format", "gptq", "--out", str(parent / name)]

    r = _child(tmp_path, _KILL_IN_EXPORT, export("a"))
    assert r.returncode == -signal.SIGKILL
    left = list(parent.glob(".a.tmp-*"))
    assert len(left) == 1 and (left[0] / "model.safetensors").is_file() and not (parent / "a").exists()
    capsys.readouterr()
    assert main(export("b")) == 0
    assert "removed" in capsys.readouterr().err
    assert sorted(p.name for p in parent.iterdir()) == ["b"]
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom bitmosaic.io.saved.outdir import output_lock\n"
         "with output_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(120)\n",
         str(parent / "c")],
        stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(bitmosaic.__file__).parents[1])},
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        line = _error_line(capsys, export("c"))
        assert f"pid {holder.pid}" in line and "another bitmosaic run" in line
        assert not (parent / "c").exists()
    finally:
        holder.kill()
        holder.wait()
