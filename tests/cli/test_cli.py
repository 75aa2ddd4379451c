"""The CLI: parsing and the registry listing, and end to end on tiny offline models: ``--out`` never
destroys a model, damaged or non-finite models and every documented error give one line + exit 2, and
``--device``/``--dtype`` reach the loader, the pipeline and the evaluation."""

from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import bitmosaic.io as bm_io
import bitmosaic.pipeline.pipeline as bm_pipeline  # the driver module: run() calls it by name
from bitmosaic.cli import build_parser, main
from tests.helpers import is_bitmosaic, quantized_dir, save_hf_dir, snapshot, tiny_llama, words


def test_cli_rejects_bad_model(capsys):
    assert main(["eval", "/no/such/model"]) == 2
    assert "cannot load model" in capsys.readouterr().err


def test_cli_inspect_rejects_non_model_dir(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no config.json" in err and err.count("\n") == 1


def test_cli_methods_lists_registry(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "gptq" in out and "babai" in out and "rtn" in out


def test_cli_group_size_and_flags_parse():
    a = build_parser().parse_args(
        [
            "quantize",
            "--method",
            "gptq",
            "--wbits",
            "3",
            "--group-size",
            "-1",
            "--sym",
            "--order",
            "min-pivot",
            "--direction",
            "back",
            "--no-clip",
            "--scale",
            "mse",
        ]
    )
    assert a.bits == 3 and a.group_size == -1 and a.sym and a.clip is False and a.scale == "mse"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["quantize", "--order", "random"])


def test_cli_unknown_method_is_a_clear_error(capsys):
    assert main(["quantize", "--method", "nope"]) == 2
    assert "unknown method" in capsys.readouterr().err


def test_cli_lattice_options_reach_the_method_config():
    from bitmosaic.cli import method_options
    from bitmosaic.methods import get_method

    p = build_parser()
    a = p.parse_args(
        ["quantize", "--method", "ssqr", "--bits", "3", "--group-size", "128", "--outlier-rate", "0.02"]
    )
    cfg = get_method("ssqr").make_config(**method_options(a, get_method("ssqr")))
    assert cfg.outlier_rate == 0.02 and cfg.bits == 3 and cfg.group_size == 128 and cfg.order == "act"
    a = p.parse_args(["quantize", "--method", "hptq", "--target-bits", "3.125", "--scale-per", "row"])
    cfg = get_method("hptq").make_config(**method_options(a, get_method("hptq")))
    assert cfg.target_bits == 3.125 and cfg.scale_per == "row" and cfg.group_size is None
    a = p.parse_args(["quantize", "--method", "rtn", "--outlier-rate", "0.02"])
    with pytest.raises(ValueError, match="does not apply"):
        method_options(a, get_method("rtn"))


PPL_MODULE = importlib.import_module("bitmosaic.eval.perplexity")


class Stop(Exception):
    """Raised by spies to end a run once the arguments were seen."""


@pytest.fixture
def text(tmp_path):
    f = tmp_path / "text.txt"
    f.write_text(words(2000))
    return f


def _quantize(model_dir, text, *extra) -> list[str]:
    flags = "--method rtn --group-size 32 --nsamples 2 --seqlen 16 --no-progress --device cpu".split()
    return ["quantize", "--model", str(model_dir), "--calib", str(text), *flags, *extra]


def _error_line(capsys, argv) -> str:
    """Exit status 2 and exactly one ``error:`` line (progress bars of the loaders aside), no traceback."""
    capsys.readouterr()  # drop what building the fixtures printed
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _never(*args, **kwargs):
    raise AssertionError("must not be reached")


# --- task 1: --out --------------------------------------------------------------------------------


def test_out_at_the_source_model_is_refused_before_any_work(tmp_path, text, capsys, monkeypatch):
    src = save_hf_dir(tmp_path / "float")
    before = snapshot(src)
    monkeypatch.setattr(bm_io, "load_model", _never)
    line = _error_line(capsys, _quantize(src, text, "--out", str(src), "--overwrite"))
    assert "not a bitmosaic model folder" in line and "--out" in line
    assert snapshot(src) == before


def test_out_existing_bitmosaic_folder_needs_overwrite(tmp_path, text, capsys):
    src = save_hf_dir(tmp_path / "float")
    out = quantized_dir(tmp_path / "q")
    before = snapshot(out)
    assert "--overwrite" in _error_line(capsys, _quantize(src, text, "--out", str(out)))
    assert snapshot(out) == before
    assert main(_quantize(src, text, "--out", str(out), "--overwrite", "--bits", "3")) == 0
    assert (
        is_bitmosaic(out)
        and json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 3
    )


# --- task 2: damaged models and documented errors: one line, exit 2 ---------------------------------


def test_eval_of_truncated_model(tmp_path, capsys):
    out = quantized_dir(tmp_path / "q")
    f = out / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    line = _error_line(capsys, ["eval", str(out), "--device", "cpu"])
    assert "model.safetensors" in line and "truncated" in line


def test_eval_of_state_dict_mismatch(tmp_path, capsys):
    out = quantized_dir(tmp_path / "q")
    sd = load_file(str(out / "model.safetensors"))
    del sd[next(k for k in sd if k.endswith("scales"))]
    save_file(sd, str(out / "model.safetensors"))
    assert "do not match" in _error_line(capsys, ["eval", str(out), "--device", "cpu"])


@pytest.mark.parametrize("damage", ["garbage", "config", "layer", "none"])
def test_inspect_damaged_or_foreign_folders(tmp_path, capsys, damage):
    out = quantized_dir(tmp_path / "q")
    if damage == "garbage":
        (out / "model.safetensors").write_bytes(b"\x07" * 64)
    elif damage == "config":
        (out / "config.json").write_text("{")
    elif damage == "layer":
        raw = json.loads((out / "config.json").read_text())
        next(iter(raw["quantization_config"]["modules"].values())).pop("in_features")
        (out / "config.json").write_text(json.dumps(raw))
    else:
        out = save_hf_dir(tmp_path / "float")
    line = _error_line(capsys, ["inspect", str(out)])
    needle = {"garbage": "model.safetensors", "config": "config.json", "layer": "in_features"}
    assert needle.get(damage, "not a bitmosaic model") in line


def test_inspect_of_a_good_folder(tmp_path, capsys):
    out = quantized_dir(tmp_path / "q")
    assert main(["inspect", str(out), "--layers"]) == 0
    assert "bits per weight" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["damping", "unpackable", "option"])
def test_documented_pipeline_errors_are_one_line(tmp_path, text, capsys, monkeypatch, kind):
    from bitmosaic.algorithms.hessian import DampingError
    from bitmosaic.errors import OptionError
    from bitmosaic.modules.qlinear import UnpackableCodesError

    exc = {
        "damping": DampingError("Hessian of layer 3 is not positive definite\nafter 5 retries"),
        "unpackable": UnpackableCodesError("integers in [-9, 70] need 8 bits"),
        "option": OptionError("bad option"),
    }[kind]

    def boom(*args, **kwargs):
        raise exc

    monkeypatch.setattr(bm_pipeline, "quantize_model", boom)
    line = _error_line(capsys, _quantize(save_hf_dir(tmp_path / "m"), text))
    assert line.startswith("error: ") and str(exc).split()[0] in line


def test_data_unavailable_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("BITMOSAIC_DATA", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # no data folder, no hub
    argv = _quantize(save_hf_dir(tmp_path / "m"), "wikitext2")
    assert "--data-dir" in _error_line(capsys, argv)


def test_internal_bugs_still_raise(tmp_path, text, monkeypatch):
    def bug(*args, **kwargs):
        raise KeyError("internal")

    monkeypatch.setattr(bm_pipeline, "quantize_model", bug)
    with pytest.raises(KeyError):
        main(_quantize(save_hf_dir(tmp_path / "m"), text))


# --- task 3: NaN weights ----------------------------------------------------------------------------


def test_eval_of_nan_model_names_the_tensor(tmp_path, capsys):
    m = tiny_llama()
    with torch.no_grad():
        m.model.layers[0].self_attn.o_proj.weight[0, 0] = float("nan")
    line = _error_line(capsys, ["eval", str(save_hf_dir(tmp_path / "nan", model=m))])
    assert "model.layers.0.self_attn.o_proj.weight" in line and "NaN" in line
    assert "2147483648" not in line


# --- task 6: --device / --dtype ---------------------------------------------------------------------


def test_quantize_passes_device_and_dtype(tmp_path, text, monkeypatch):
    seen = {}

    def spy(model, calib, recipe, config=None, settings=None, **kw):
        seen.update(device=settings.device, dtype=model.model.embed_tokens.weight.dtype)
        raise Stop

    monkeypatch.setattr(bm_pipeline, "quantize_model", spy)
    src = save_hf_dir(tmp_path / "m", model=tiny_llama().to(torch.bfloat16))
    with pytest.raises(Stop):
        main(_quantize(src, text, "--dtype", "float16"))
    assert seen["device"] == torch.device("cpu") and seen["dtype"] is torch.float16
    with pytest.raises(Stop):  # auto on a CPU run: float32, whatever the checkpoint
        main(_quantize(src, text, "--dtype", "auto"))
    assert seen["dtype"] is torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(Stop):  # auto on a CUDA run: the checkpoint's dtype, loaded on the host
        main([*_quantize(src, text), "--device", "auto"])
    assert seen["device"] == torch.device("cuda") and seen["dtype"] is torch.bfloat16


def test_quantize_report_records_device_dtype_and_bos(tmp_path, text):
    js = tmp_path / "r.json"
    assert main(_quantize(save_hf_dir(tmp_path / "m"), text, "--dtype", "bfloat16", "--json", str(js))) == 0
    rep = json.loads(js.read_text())
    assert rep["device"] == "cpu" and rep["dtype"] == "bfloat16" and rep["calibration"]["bos"] is False


def test_cuda_unavailable_is_one_line(tmp_path, text, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bm_io, "load_model", _never)
    for argv in (_quantize("x", text, "--device", "cuda"), ["eval", "x", "--device", "cuda"]):
        assert "CUDA is not available" in _error_line(capsys, argv)


def test_eval_device_and_dtype(tmp_path, text, monkeypatch):
    seen = {}
    real = PPL_MODULE.perplexity

    def spy(model, ids, seqlen, **kw):
        seen.update(kw, dtype=model.model.embed_tokens.weight.dtype)
        return real(model, ids, seqlen, **kw)

    monkeypatch.setattr(PPL_MODULE, "perplexity", spy)
    js = tmp_path / "e.json"
    flags = "--seqlen 32 --max-windows 2 --no-progress --dtype bfloat16 --device cpu".split()
    argv = ["eval", str(save_hf_dir(tmp_path / "m")), "--ppl", str(text), *flags, "--json", str(js)]
    assert main(argv) == 0
    assert seen["device"] == torch.device("cpu") and seen["dtype"] is torch.bfloat16
    res = json.loads(js.read_text())
    assert res["device"] == "cpu" and res["dtype"] == "bfloat16" and res["bos"] is False


def test_help_documents_the_flags(capsys):
    for cmd in ("quantize", "eval"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = capsys.readouterr().out
        assert "--device" in out and "--dtype" in out and "CUDA" in out
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    assert "--overwrite" in capsys.readouterr().out


# --- eval --fidelity and --ppl none (issue 27, section 4) -------------------------------------------


def test_eval_fidelity_against_the_source_model(tmp_path, text):
    """``eval DIR --fidelity`` finds the float model in the folder's provenance and reports KL and
    top-1 on the perplexity windows; the float model against itself gives KL 0 and agreement 1."""
    src = save_hf_dir(tmp_path / "m")
    out = tmp_path / "q"
    assert main(_quantize(src, text, "--bits", "2", "--out", str(out))) == 0
    flags = ["--ppl", str(text), "--seqlen", "32", "--max-windows", "3", "--no-progress", "--device", "cpu"]
    js = tmp_path / "q.json"
    assert main(["eval", str(out), "--fidelity", *flags, "--json", str(js)]) == 0
    res = json.loads(js.read_text())
    assert res["fidelity_reference"] == str(src) and res["compared_tokens"] == 3 * 31
    assert res["kl_mean"] > 0 and 0 <= res["top1_agreement"] <= 1
    assert main(["eval", str(src), "--fidelity", str(src), *flags, "--json", str(js)]) == 0
    same = json.loads(js.read_text())
    assert same["kl_mean"] < 1e-6 and same["top1_agreement"] == 1.0
    assert same["ppl"] != res["ppl"]


def test_eval_fidelity_and_ppl_none_refusals(tmp_path, capsys):
    src = save_hf_dir(tmp_path / "m")
    assert "--tasks" in _error_line(capsys, ["eval", str(src), "--ppl", "none"])
    assert "--fidelity" in _error_line(capsys, ["eval", str(src), "--ppl", "none", "--fidelity", str(src)])
    line = _error_line(capsys, ["eval", str(src), "--fidelity"])  # a float folder records no source
    assert "--fidelity MODEL" in line or "provenance" in line
