"""Saving never destroys a folder bitmosaic did not write; damaged saved models fail with one clear line;
non-finite weights are refused when a model loads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from bitmosaic.errors import BitmosaicError, CorruptModelError, NonFiniteError, OutputExistsError
from bitmosaic.io import load_model, load_quantized, save_quantized
from tests.helpers import is_bitmosaic, quantized_dir, save_hf_dir, snapshot, tiny_llama


def _quantized_model():
    from bitmosaic import quantize_

    m = tiny_llama(seed=1)
    quantize_(m, "rtn", torch.randint(4, 128, (2, 16)), bits=3, group_size=32, progress=False)
    return m


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg, msg
    return msg


# --- task 1: save_quantized never deletes what it did not write ------------------------------------


def test_save_refuses_the_float_model_folder(tmp_path):
    src = save_hf_dir(tmp_path / "float")
    before = snapshot(src)
    with pytest.raises(OutputExistsError, match="not a bitmosaic"):
        save_quantized(_quantized_model(), src, {"method": "rtn"})
    assert snapshot(src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["float"]  # no temp leftovers


def test_save_refuses_other_non_empty_folders(tmp_path):
    for name, files in [
        ("notes", {"a.txt": b"keep me"}),
        ("badjson", {"config.json": b"{not json", "x.bin": b"1"}),
        ("noqc", {"config.json": b'{"model_type": "llama"}'}),
        ("otherq", {"config.json": json.dumps({"quantization_config": {"quant_method": "gptq"}}).encode()}),
    ]:
        d = tmp_path / name
        d.mkdir()
        for f, data in files.items():
            (d / f).write_bytes(data)
        with pytest.raises(OutputExistsError):
            save_quantized(_quantized_model(), d, {"method": "rtn"}, overwrite=True)
        assert snapshot(d) == files


def test_save_refuses_a_file(tmp_path):
    f = tmp_path / "out"
    f.write_text("precious")
    with pytest.raises(OutputExistsError, match="not a folder"):
        save_quantized(_quantized_model(), f, {"method": "rtn"}, overwrite=True)
    assert f.read_text() == "precious"


def test_save_refuses_existing_bitmosaic_folder_unless_overwrite(tmp_path):
    out = quantized_dir(tmp_path / "q")
    before = snapshot(out)
    with pytest.raises(OutputExistsError, match="overwrite"):
        save_quantized(_quantized_model(), out, {"method": "rtn", "bits": 3})
    assert snapshot(out) == before
    save_quantized(_quantized_model(), out, {"method": "rtn", "bits": 3}, overwrite=True)
    assert is_bitmosaic(out) and snapshot(out) != before
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # old copy and temp folder removed


def test_save_into_empty_or_new_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    for name in ("empty", "new/nested"):
        out = save_quantized(_quantized_model(), tmp_path / name, {"method": "rtn"})
        assert is_bitmosaic(out)


# --- task 2: damaged folders give one clear line ---------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    return quantized_dir(tmp_path / "q", tokenizer=False)


def _expect_corrupt(path, *needles):
    with pytest.raises(CorruptModelError) as ei:
        load_quantized(path, load_tokenizer=False)
    msg = _one_line(ei.value)
    for n in needles:
        assert n in msg, msg
    assert isinstance(ei.value, BitmosaicError) and isinstance(ei.value, ValueError)
    return msg


def test_truncated_safetensors(saved):
    f = saved / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    _expect_corrupt(saved, "model.safetensors")


def test_garbage_safetensors(saved):
    (saved / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    _expect_corrupt(saved, "model.safetensors")


def test_empty_safetensors(saved):
    (saved / "model.safetensors").write_bytes(b"")
    _expect_corrupt(saved, "model.safetensors")


def test_no_weights_file(saved):
    (saved / "model.safetensors").unlink()
    _expect_corrupt(saved, "model.safetensors")


def test_missing_shard_and_broken_index(tmp_path, monkeypatch):
    import bitmosaic.io.saved.shards as shards

    monkeypatch.setattr(shards, "SHARD_BYTES", 20_000)
    out = save_quantized(_quantized_model(), tmp_path / "sharded", {"method": "rtn"})
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1
    load_quantized(out, load_tokenizer=False)  # the sharded folder itself loads
    shards[1].unlink()
    _expect_corrupt(out, shards[1].name)
    (out / "model.safetensors.index.json").write_text("{oops")
    _expect_corrupt(out, "model.safetensors.index.json")


@pytest.mark.parametrize(
    "text,needle",
    [
        ("{broken", "config.json"),
        ("[]", "config.json"),
        (None, "quantization_config"),  # modules table removed
    ],
)
def test_broken_config(saved, text, needle):
    cfg = saved / "config.json"
    if text is None:
        raw = json.loads(cfg.read_text())
        del raw["quantization_config"]["modules"]
        text = json.dumps(raw)
    cfg.write_text(text)
    _expect_corrupt(saved, needle)


def test_bad_layer_entry(saved):
    cfg = saved / "config.json"
    raw = json.loads(cfg.read_text())
    name = next(iter(raw["quantization_config"]["modules"]))
    del raw["quantization_config"]["modules"][name]["in_features"]
    cfg.write_text(json.dumps(raw))
    _expect_corrupt(saved, name)


@pytest.mark.parametrize("change", ["missing", "unexpected", "shape", "dtype"])
def test_state_dict_mismatch(saved, change):
    f = saved / "model.safetensors"
    sd = load_file(str(f))
    key = next(k for k in sd if k.endswith("qweight"))
    if change == "missing":
        del sd[key]
    elif change == "unexpected":
        sd["model.layers.0.extra"] = torch.zeros(3)
    elif change == "shape":
        sd[key] = torch.zeros(3, 5, dtype=torch.uint8)
    else:
        sd[key] = sd[key].float()
    save_file(sd, str(f), metadata={"format": "pt"})
    _expect_corrupt(saved, "model.layers")


def test_missing_config(saved):
    (saved / "config.json").unlink()
    with pytest.raises(BitmosaicError, match="config.json"):
        load_quantized(saved, load_tokenizer=False)


def test_broken_tokenizer(tmp_path):
    out = quantized_dir(tmp_path / "q")
    (out / "tokenizer.json").write_text("{nope")
    with pytest.raises(CorruptModelError, match="tokenizer"):
        load_quantized(out)


def test_no_tokenizer_saved_loads_as_none(saved):
    _, tok = load_quantized(saved)
    assert tok is None


# --- task 3: non-finite weights are refused at load time, naming the tensor ------------------------


def test_load_model_refuses_nan_weight(tmp_path):
    m = tiny_llama()
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
    src = save_hf_dir(tmp_path / "nan", model=m)
    with pytest.raises(NonFiniteError) as ei:
        load_model(str(src))
    msg = _one_line(ei.value)
    assert "model.layers.1.mlp.down_proj.weight" in msg and "NaN" in msg and "[3, 5]" in msg


def test_load_model_refuses_inf_embedding(tmp_path):
    m = tiny_llama()
    with torch.no_grad():
        m.model.embed_tokens.weight[7, 0] = float("-inf")
    src = save_hf_dir(tmp_path / "inf", model=m)
    with pytest.raises(NonFiniteError, match=r"embed_tokens\.weight.*1 Inf"):
        load_model(str(src))


@pytest.mark.parametrize("suffix", ["scales", "model.norm.weight"])
def test_load_quantized_refuses_non_finite_float_tensors(saved, suffix):
    f = saved / "model.safetensors"
    sd = load_file(str(f))
    key = next(k for k in sd if k.endswith(suffix))
    sd[key] = sd[key].clone()
    sd[key].view(-1)[0] = float("nan")
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(NonFiniteError) as ei:
        load_quantized(saved, load_tokenizer=False)
    assert key in _one_line(ei.value)
