"""Bad inputs tried as a hostile user would (issue 26, section 0): each gives one ``error:`` line on
stderr and exit status 2 (or, for a warning, one ``bitmosaic: warning:`` line), with no traceback and
no output left behind.  ``docs/errors.md`` lists every row with the test that checks it."""

from __future__ import annotations

import errno
import json
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import bitmosaic.io as bm_io
from bitmosaic.cli import main
from tests.helpers import SPECIALS, VOCAB, quantized_dir, save_hf_dir, snapshot, tiny_llama, words


def _error_line(capsys, argv) -> str:
    """Exit status 2 and exactly one ``error:`` line, no usage text, no traceback; the line without
    its ``error: `` prefix."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err and "usage:" not in err, err
    return lines[0].removeprefix("error: ")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _never(*args, **kwargs):
    raise AssertionError("must not be reached: the bad input is refused before any work")


@pytest.fixture(scope="module")
def qdir(tmp_path_factory):
    """A good bitmosaic folder (tiny Llama, RTN w4 g32, with tokenizer); copy it before damaging it."""
    return quantized_dir(tmp_path_factory.mktemp("q") / "q")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A float tiny-Llama folder and a calibration text."""
    root = tmp_path_factory.mktemp("src")
    (root / "text.txt").write_text(words(2000))
    return save_hf_dir(root / "float"), root / "text.txt"


def _quantize(model_dir, text, *extra) -> list[str]:
    flags = "--method rtn --group-size 32 --nsamples 2 --seqlen 16 --no-progress --device cpu".split()
    return ["quantize", "--model", str(model_dir), "--calib", str(text), *flags, *extra]


# --- 1 and 6: damaged saved folders, the same line from every loader --------------------------------


def _damage(path, how: str) -> None:
    if how in ("tensor", "module"):
        cfg = json.loads((path / "config.json").read_text())
        name = "model.layers.0.mlp.down_proj"
        if how == "tensor":  # one packed tensor deleted from the weights
            sd = load_file(str(path / "model.safetensors"))
            del sd[f"{name}.qweight"]
            save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
        else:  # one layer deleted from the per-layer table
            del cfg["quantization_config"]["modules"][name]
            (path / "config.json").write_text(json.dumps(cfg))
    elif how == "bits9":  # the config edited to a width no packing holds
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"]["bits"] = 9
        for lc in cfg["quantization_config"]["modules"].values():
            lc["bits"] = 9
        (path / "config.json").write_text(json.dumps(cfg))
    elif how == "no-weights":
        (path / "model.safetensors").unlink()


def _loaders():
    from transformers import AutoModelForCausalLM

    import bitmosaic
    from bitmosaic.io import load_quantized

    return {
        "bitmosaic.load": bitmosaic.load,
        "from_pretrained": AutoModelForCausalLM.from_pretrained,
        "load_quantized": load_quantized,
    }


@pytest.mark.parametrize("how", ["tensor", "module", "bits9", "no-weights"])
def test_damaged_folder_gives_one_line_from_every_loader(qdir, tmp_path, capsys, how):
    from bitmosaic.errors import CorruptModelError

    path = tmp_path / "q"
    shutil.copytree(qdir, path)
    _damage(path, how)
    lines = {}
    loaders = _loaders()
    if how == "no-weights":  # transformers looks for the weight files before any quantizer runs
        with pytest.raises(OSError, match="model.safetensors"):
            loaders.pop("from_pretrained")(str(path))
    for name, load in loaders.items():
        with pytest.raises(CorruptModelError) as e:
            load(str(path))
        lines[name] = _one_line(e.value)
    lines["eval"] = _error_line(capsys, ["eval", str(path), "--device", "cpu", "--no-progress"])
    lines["inspect"] = _error_line(capsys, ["inspect", str(path)])
    export = ["export", str(path), "--format", "gptq", "--out", str(tmp_path / "x")]
    lines["export"] = _error_line(capsys, export)
    assert len(set(lines.values())) == 1, lines
    line = lines["eval"]
    needle = {
        "tensor": "model.layers.0.mlp.down_proj.qweight",
        "module": "model.layers.0.mlp.down_proj",
        "bits9": "bits 9",
        "no-weights": "model.safetensors",
    }[how]
    assert needle in line and str(path) in line, line
    assert not (tmp_path / "x").exists()


def test_reproduce_refuses_an_edited_config(tmp_path, src, capsys):
    model, text = src
    out = tmp_path / "q"
    assert main(_quantize(model, text, "--out", str(out))) == 0
    good = snapshot(out)
    _damage(out, "bits9")
    line = _error_line(capsys, ["reproduce", str(out), "--device", "cpu", "--no-progress"])
    assert "config.json differs" in line and "SHA256SUMS" in line  # the hashes are checked first
    (out / "SHA256SUMS").unlink()  # as a folder saved before the hashes: the config's own check
    line = _error_line(capsys, ["reproduce", str(out), "--device", "cpu", "--no-progress"])
    assert "bits 9" in line
    # a valid but edited per-layer setting (bits 3 stored in 4-bit codes): the tensors all match, the
    # settings do not, so reproduce must say so
    for name, data in good.items():
        (out / name).write_bytes(data)
    (out / "SHA256SUMS").unlink()
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["modules"]["model.layers.1.mlp.up_proj"]["bits"] = 3
    (out / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main(["reproduce", str(out), "--device", "cpu", "--no-progress"]) == 1
    assert "model.layers.1.mlp.up_proj" in capsys.readouterr().out


# --- 2: compare --out ------------------------------------------------------------------------------


def test_compare_refuses_a_folder_it_did_not_write(tmp_path, src, capsys, monkeypatch):
    import bitmosaic.cli.compare as compare

    model, text = src
    out = tmp_path / "mine"
    out.mkdir()
    (out / "results.csv").write_text("my own table\n")
    (out / "results.md").write_text("my notes\n")
    before = snapshot(out)
    monkeypatch.setattr(compare, "_run", _never)
    argv = ["compare", "--model", str(model), "--configs", "rtn:w4g32", "--calib", str(text),
            "--out", str(out), "--no-progress"]  # fmt: skip
    line = _error_line(capsys, argv)
    assert str(out) in line and "compare" in line
    assert snapshot(out) == before and sorted(p.name for p in out.iterdir()) == ["results.csv", "results.md"]


def test_compare_output_folder_check():
    from bitmosaic.errors import OutputExistsError
    from bitmosaic.eval.compare import check_compare_out

    def folder(tmp, *names):
        for n in names:
            p = tmp / n
            if n.endswith("/"):
                p.mkdir(parents=True)
            else:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text("x")
        return tmp

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        check_compare_out(root / "new")  # does not exist: fine
        check_compare_out(folder(root / "empty"))
        # written by an earlier bitmosaic (no marker): only compare's own names
        check_compare_out(folder(root / "old", "runs/float.json", "logs/", "models/", "results.csv"))
        check_compare_out(folder(root / "marked", "compare.json", "notes.txt"))
        for bad in (folder(root / "b1", "results.csv"), folder(root / "b2", "runs/", "logs/", "thesis.tex")):
            with pytest.raises(OutputExistsError, match="not a bitmosaic compare folder"):
                check_compare_out(bad)
        with pytest.raises(OutputExistsError, match="not a folder"):
            check_compare_out(folder(root, "file") / "file")


# --- 3: non-finite evaluation -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory):
    """A model whose first norm weight is scaled by 1e30: finite weights, Inf/NaN activations."""
    m = tiny_llama()
    with torch.no_grad():
        m.model.layers[0].input_layernorm.weight.mul_(1e30)
    return save_hf_dir(tmp_path_factory.mktemp("nan") / "m", model=m)


def test_eval_refuses_non_finite_logits(overflowing, src, capsys):
    _, text = src
    argv = ["eval", str(overflowing), "--ppl", str(text), "--seqlen", "32", "--max-windows", "3",
            "--no-progress", "--device", "cpu"]  # fmt: skip
    line = _error_line(capsys, argv)
    assert "window 1 of 3" in line and "not finite" in line
    assert "perplexity nan" not in capsys.readouterr().out


def test_perplexity_refuses_non_finite_logits():
    from bitmosaic.errors import NonFiniteError
    from bitmosaic.eval.perplexity import perplexity

    m = tiny_llama()
    ids = torch.randint(len(SPECIALS), VOCAB, (1, 80), generator=torch.Generator().manual_seed(0))
    real, calls = m.forward, []

    def forward(input_ids, **kw):  # the second window's logits overflow
        out = real(input_ids, **kw)
        calls.append(1)
        if len(calls) == 2:
            out.logits[0, 3, 5] = float("inf")
        return out

    m.forward = forward
    with pytest.raises(NonFiniteError, match=r"window 2 of 5 .*Inf"):
        perplexity(m, ids, 16, progress=False)


def test_streamed_quantize_with_non_finite_evaluation_names_the_saved_folder(src, tmp_path, capsys, monkeypatch):  # noqa: E501
    """A streamed run saves layer by layer before anything evaluates: when the saved model's evaluation
    is not finite, one line names the folder (it is kept: the user may inspect it), exit 2."""
    import importlib

    from bitmosaic.errors import NonFiniteError

    ppl_mod = importlib.import_module("bitmosaic.eval.perplexity")  # the module, not the function

    model, text = src

    def non_finite(*a, **k):
        raise NonFiniteError("window 1 of 3 has logits that are not finite (Inf)")

    monkeypatch.setattr(ppl_mod, "perplexity", non_finite)
    out = tmp_path / "q"
    argv = _quantize(model, text, "--stream", "on", "--out", str(out), "--eval", str(text))
    line = _error_line(capsys, argv)
    assert line.startswith(f"the model saved to {out} does not evaluate: window 1 of 3"), line
    assert (out / "config.json").is_file()


def test_quantize_with_non_finite_evaluation_names_the_saved_folder(overflowing, src, tmp_path, capsys):
    """In memory as streamed (one flow: run, save, evaluate): the saved folder is named and kept for the
    user to inspect, no report is written, and no work folder is left behind."""
    _, text = src
    out, js = tmp_path / "q", tmp_path / "r.json"
    argv = _quantize(overflowing, text, "--eval", str(text), "--eval-seqlen", "32", "--max-windows", "2",
                     "--out", str(out), "--json", str(js))  # fmt: skip
    line = _error_line(capsys, argv)
    assert line.startswith(f"the model saved to {out} does not evaluate: "), line
    assert "window 1 of 2" in line and "not finite" in line
    assert (out / "config.json").is_file() and not js.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_in_memory_non_finite_evaluation_without_out_saves_nothing(overflowing, src, tmp_path, capsys):
    _, text = src
    js = tmp_path / "r.json"
    argv = _quantize(overflowing, text, "--eval", str(text), "--eval-seqlen", "32", "--max-windows", "2",
                     "--json", str(js))  # fmt: skip
    line = _error_line(capsys, argv)
    assert "window 1 of 2" in line and line.endswith("nothing was saved") and not js.exists()


# --- 4: tracebacks where one line was promised ------------------------------------------------------


@pytest.fixture(scope="module")
def huge_layer(tmp_path_factory):
    """down_proj of layer 0 scaled by 1e8: finite, but its group scales overflow float16."""
    m = tiny_llama()
    with torch.no_grad():
        m.model.layers[0].mlp.down_proj.weight.mul_(1e8)
    return save_hf_dir(tmp_path_factory.mktemp("huge") / "m", model=m)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_layer_too_large_for_float16_scales(huge_layer, src, tmp_path, capsys, method):
    _, text = src
    argv = _quantize(huge_layer, text, "--method", method, "--out", str(tmp_path / "q"))
    line = _error_line(capsys, argv)
    assert "model.layers.0.mlp.down_proj" in line and "float16" in line and "65504" in line, line
    assert "internal" not in line and "no-clip" not in line  # (7) no clipping was turned off
    assert not (tmp_path / "q").exists()


def test_unpackable_codes_blame_no_clip_only_when_it_was_given():
    from bitmosaic.algorithms.types import QuantResult
    from bitmosaic.modules.qlinear import QuantLinear, UnpackableCodesError

    codes = torch.tensor([[0, 3000, -5, 1]], dtype=torch.int32)
    res = QuantResult(codes, torch.ones(1, 1), torch.zeros(1, 1), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(UnpackableCodesError) as e:
        QuantLinear.from_result(res, bits=4, group_size=None, symmetric=False, clip=True)
    assert "no-clip" not in str(e.value) and "clip" in str(e.value)
    with pytest.raises(UnpackableCodesError, match="no-clip quantization"):
        QuantLinear.from_result(res, bits=4, group_size=None, symmetric=False, clip=False)


class _Payload:
    """Unpickling this creates ``marker``: proof that the pickle ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_checkpoint_is_refused_unread(src, tmp_path, capsys):
    model, text = src
    folder = tmp_path / "pickled"
    shutil.copytree(model, folder)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "payload-ran"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"x": _Payload(marker)}))
    for argv in (_quantize(folder, text), ["eval", str(folder), "--device", "cpu"]):
        line = _error_line(capsys, argv)
        assert "pickle" in line and "safetensors" in line and str(folder) in line
    assert not marker.exists()


def test_saved_model_as_quantize_input(qdir, src, capsys, monkeypatch):
    import bitmosaic
    from bitmosaic.errors import OptionError
    from bitmosaic.io import load_quantized

    _, text = src
    monkeypatch.setattr(bm_io, "load_model", _never)
    line = _error_line(capsys, _quantize(qdir, text))
    assert "already quantized" in line and "float model" in line
    model, _ = load_quantized(qdir)
    calib = torch.randint(len(SPECIALS), VOCAB, (2, 16))
    with pytest.raises(OptionError, match="already quantized"):
        bitmosaic.quantize_(model, "rtn", calib, progress=False)


@pytest.mark.parametrize("where", ["safetensors", "config"])
def test_full_disk_during_save(src, tmp_path, capsys, monkeypatch, where):
    import bitmosaic.io.saved.save as ser
    import bitmosaic.io.saved.shards as shards

    model, text = src
    out = tmp_path / "out" / "q"

    def full(*args, **kwargs):
        if where == "safetensors":  # what safetensors raises (not an OSError)
            from safetensors import SafetensorError

            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "safetensors":
        monkeypatch.setattr(shards, "save_file", full)
    else:
        monkeypatch.setattr(ser, "_write_config", full)
    line = _error_line(capsys, _quantize(model, text, "--out", str(out)))
    assert str(out) in line and "No space left on device" in line
    assert not out.exists() and not (tmp_path / "out").exists()  # nor the folder made for it


# --- 5: option values ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--method", "gptq", "--damp", "-1"], "damp"),
        (["--scheme", "W4A4", "--abits", "8"], "--abits 8"),
        (["--scheme", "W4A8", "--afmt", "fp8"], "--afmt"),
        (["--threads", "0"], "--threads"),
        (["--batch-size", "0"], "--batch-size"),
        (["--group-size", "0"], "group"),
        (["--nsamples", "0"], "--nsamples"),
        (["--seqlen", "0"], "--seqlen"),
        (["--eval-seqlen", "1", "--eval", "x.txt"], "--eval-seqlen"),
        (["--max-windows", "0", "--eval", "x.txt"], "--max-windows"),
    ],
)
def test_bad_option_values_are_refused_before_loading(src, capsys, monkeypatch, extra, needle):
    model, text = src
    monkeypatch.setattr(bm_io, "load_model", _never)
    assert needle in _error_line(capsys, _quantize(model, text, *extra))


def test_matching_scheme_and_abits_are_accepted():
    from bitmosaic.cli import build_parser, method_options
    from bitmosaic.methods import get_method

    a = build_parser().parse_args(["quantize", "--scheme", "W4A8", "--abits", "8"])
    assert method_options(a, get_method("rtn"))["act"].bits == 8


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "x", "--threads", "0"],
        ["eval", "x", "--seqlen", "1"],
        ["compare", "--configs", "rtn:w4", "--out", "o", "--threads", "0"],
    ],
)
def test_bad_option_values_of_eval_and_compare(tmp_path, capsys, monkeypatch, argv):
    import bitmosaic.cli.compare as compare

    monkeypatch.chdir(tmp_path)  # nothing may be written, but never into the checkout
    monkeypatch.setattr(bm_io, "load_model", _never)
    monkeypatch.setattr(compare, "_run", _never)
    _error_line(capsys, argv)
    assert list(tmp_path.iterdir()) == []


def test_python_api_refuses_batch_size_zero():
    import bitmosaic
    from bitmosaic.errors import OptionError

    with pytest.raises(OptionError, match="batch_size"):
        bitmosaic.quantize_(tiny_llama(), "rtn", torch.randint(4, VOCAB, (2, 16)), batch_size=0)


# --- 7: misleading messages -------------------------------------------------------------------------


def test_non_utf8_calibration_file_is_named(src, tmp_path, capsys):
    model, _ = src
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(words(300).encode() + "caf\xe9".encode("latin-1") + b"\n")
    line = _error_line(capsys, _quantize(model, bad))
    assert str(bad) in line and "UTF-8" in line and "byte" in line


@pytest.mark.parametrize("stream", [False, True])
def test_seqlen_beyond_the_model_positions_warns(src, capsys, tmp_path, stream):
    model, text = src  # tiny Llama: 128 positions
    capsys.readouterr()
    extra = ["--stream", "on", "--out", str(tmp_path / "q")] if stream else []
    assert main(_quantize(model, text, "--seqlen", "160", "--nsamples", "1", *extra)) == 0
    warn = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert len(warn) == 1 and "--seqlen 160" in warn[0] and "128" in warn[0], warn


# --- 8: output paths checked before the run ---------------------------------------------------------


@pytest.mark.parametrize("flag", ["--out", "--json"])
def test_unwritable_output_is_refused_before_loading(src, tmp_path, capsys, monkeypatch, flag):
    model, text = src
    monkeypatch.setattr(bm_io, "load_model", _never)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    target = blocker / "sub" / ("r.json" if flag == "--json" else "q")
    extra = [flag, str(target)] + (["--out", str(tmp_path / "q")] if flag == "--json" else [])
    line = _error_line(capsys, _quantize(model, text, *extra))
    assert flag in line and str(blocker) in line
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("flag", ["--out", "--json"])
def test_output_without_write_permission_is_refused(src, tmp_path, capsys, monkeypatch, flag):
    import os

    model, text = src
    monkeypatch.setattr(bm_io, "load_model", _never)
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(locked) else real(p, mode))
    target = locked / ("r.json" if flag == "--json" else "q")
    extra = [flag, str(target)] + (["--out", str(tmp_path / "q")] if flag == "--json" else [])
    line = _error_line(capsys, _quantize(model, text, *extra))
    assert flag in line and "permission" in line and str(locked) in line
    assert not (tmp_path / "q").exists()


def test_docs_errors_table_names_tests_that_exist():
    """Every test ``docs/errors.md`` names is a test of this file, ``test_bad_models.py``,
    ``test_integrity.py``, ``tests/pipeline/test_recipe.py``, or of the file a row names
    (``tests/x/test_y.py::test_z``; parameter ids aside)."""
    import re
    from pathlib import Path

    from tests.cli import test_bad_models, test_integrity
    from tests.pipeline import test_recipe

    known = {**vars(test_recipe), **vars(test_bad_models), **vars(test_integrity), **globals()}
    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "errors.md").read_text()
    named = set(re.findall(r"`(test_\w+)", doc))
    elsewhere = {n: f for f, n in re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)", doc)}
    missing = [n for n in named if n not in elsewhere and not callable(known.get(n))]
    missing += [n for n, f in elsewhere.items() if f"def {n}(" not in (root / f).read_text()]
    assert named and not sorted(missing), missing
