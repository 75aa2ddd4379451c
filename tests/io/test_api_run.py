"""The Python API: a method name, a Recipe, a dict or a file as the method; token ids, a dataset name,
a text file or text as calibration data; one-line errors otherwise.  The run is attached to the model,
``save_quantized`` writes it, and ``bitmosaic reproduce`` works on a folder saved from Python."""

from __future__ import annotations

import json

import pytest
import torch

from bitmosaic import quantize_
from bitmosaic.errors import OptionError
from bitmosaic.io import load_model, save_quantized
from bitmosaic.pipeline.recipe import Recipe
from tests.helpers import SPECIALS, VOCAB, save_hf_dir, tiny_llama, word_tokenizer, words


@pytest.fixture
def env(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(words(2000))
    return save_hf_dir(tmp_path / "float"), text


def _ids():
    return torch.randint(len(SPECIALS), VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


def test_python_saved_folder_reproduces_bit_for_bit(env, tmp_path, capsys):
    from bitmosaic.cli import main

    model_dir, text = env
    model, tok = load_model(str(model_dir))
    report = quantize_(
        model, "gptq", str(text), tokenizer=tok, nsamples=2, seqlen=16, bits=4, group_size=32, damp=0.02,
        progress=False, device="cpu",
    )  # fmt: skip
    run = model.bitmosaic_run
    assert run["report"] is report and run["recipe"].settings == {"bits": 4, "group_size": 32, "damp": 0.02}
    out = save_quantized(model, tmp_path / "q", tokenizer=tok)  # no quant_info: what the model carries
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["method"] == "gptq" and qc["recipe"]["method"] == "gptq" and qc["config"]["damp"] == 0.02
    assert qc["provenance"]["calibration"]["source"] == str(text.resolve())
    capsys.readouterr()
    assert main(["reproduce", str(out), "--no-progress"]) == 0
    assert "tensors match bit for bit" in capsys.readouterr().out


def test_recipe_forms_are_the_same_run(env, tmp_path):
    import yaml

    model_dir, text = env
    d = {"method": "rtn", "settings": {"bits": 4, "group_size": 32}}
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(d))
    states = []
    for method in (d, Recipe.from_dict(d), str(f), f):
        m = tiny_llama()
        quantize_(m, method, _ids(), progress=False)
        assert m.bitmosaic_run["recipe"].to_dict() == d
        states.append(m.state_dict())
    m = tiny_llama()
    quantize_(m, "rtn", _ids(), bits=4, group_size=32, progress=False)
    states.append(m.state_dict())
    for s in states[1:]:
        assert all(torch.equal(s[k], states[0][k]) for k in states[0])


@pytest.mark.parametrize(
    "method, calib, kw, needle",
    [
        ("rtn", "wikitext2", {}, "is text: pass tokenizer="),
        ("rtn", 3.0, {}, "calib must be token ids"),
        ("rtn", torch.rand(2, 16), {}, "integer tensor of token ids"),
        ("rtn", "nosuchname", {"tokenizer": "tok"}, "no dataset name"),
        (42, None, {}, "method must be a method name"),
        ({"method": "rtn"}, None, {"bits": 3}, "a recipe sets the method"),
        ("nope", None, {}, "unknown method 'nope'"),
    ],
)
def test_bad_arguments_are_one_line_option_errors(method, calib, kw, needle):
    if kw.get("tokenizer") == "tok":
        kw = {**kw, "tokenizer": word_tokenizer()}
    with pytest.raises(OptionError, match=needle) as e:
        quantize_(tiny_llama(), method, _ids() if calib is None else calib, progress=False, **kw)
    assert "\n" not in str(e.value)


def test_raw_text_calibration_and_old_option_names(tmp_path):
    m = tiny_llama()
    with pytest.warns(FutureWarning, match="'percdamp' is now called 'damp'"):
        quantize_(m, "gptq", words(500), tokenizer=word_tokenizer(), nsamples=2, seqlen=16, percdamp=0.05,
                  group_size=32, progress=False)  # fmt: skip
    assert m.bitmosaic_run["recipe"].settings["damp"] == 0.05
    cal = m.bitmosaic_run["provenance"]["calibration"]
    assert cal["source"] == "tensor" and cal["nsamples"] == 2 and cal["seqlen"] == 16


def test_token_ids_cannot_be_reproduced_clear_error(tmp_path, capsys):
    from bitmosaic.cli import main

    m = tiny_llama()
    quantize_(m, "rtn", _ids(), bits=4, group_size=32, progress=False)
    out = save_quantized(m, tmp_path / "q")
    assert main(["reproduce", str(out)]) == 2
    assert "token ids given from Python" in capsys.readouterr().err
    with pytest.raises(ValueError, match="carries no quantization run"):
        del m.bitmosaic_run
        save_quantized(m, tmp_path / "q2")
