"""Recipes: parsing with one-line errors, per-layer overrides and skips in the pipeline
(a different method per layer, stacking only within one method + config), flags = a one-entry
recipe, and ``bitmosaic reproduce``."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from bitmosaic.errors import OptionError
from bitmosaic.pipeline import RunSettings, quantize_model
from bitmosaic.pipeline.recipe import Recipe, load_recipe
from tests.helpers import SPECIALS, VOCAB, save_hf_dir, tiny_llama, words

QPROJ0 = "model.layers.0.self_attn.q_proj"


def _calib():
    return torch.randint(len(SPECIALS), VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))


MIXED = {
    "method": "gptq",
    "settings": {"bits": 4, "group_size": 32, "order": "act"},
    "overrides": [
        {"match": r"mlp\.down_proj$", "method": "rtn", "settings": {"bits": 8, "group_size": -1}},
        {"match": r"layers\.0\.self_attn\.q_proj$", "settings": {"bits": 3}},
    ],
    "skip": [r"layers\.1\.mlp\.gate_proj"],
}


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"method": "gptq", "setings": {}}, "unknown key 'setings'; allowed keys are method"),
        ({"settings": {}}, "needs 'method: NAME'"),
        ({"method": "gpq"}, "unknown method 'gpq'"),
        ({"method": "rtn", "settings": {"order": "act"}}, "no option(s) ['order']"),
        ({"method": "hptq", "settings": {"bits": 3}}, "hptq/hrtn do not use bits=3"),
        ({"method": "rtn", "settings": [4]}, "key 'settings' must be a mapping"),
        (
            {"method": "rtn", "overrides": [{"match": "(", "settings": {}}]},
            "overrides[0].match '(' is not a valid",
        ),
        ({"method": "rtn", "overrides": [{"mtch": "x"}]}, "overrides[0]: unknown key 'mtch'"),
        (
            {"method": "rtn", "overrides": [{"match": "x", "method": "awq", "settings": {"bits": 9}}]},
            "overrides[0]",
        ),
        ({"method": "rtn", "skip": "lm_head"}, "key 'skip' must be a list"),
    ],
)
def test_bad_recipes_give_one_line_errors(bad, needle):
    with pytest.raises(OptionError) as e:
        Recipe.from_dict(bad)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_yaml_and_json_files_agree(tmp_path):
    import yaml

    (tmp_path / "r.json").write_text(json.dumps(MIXED))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(MIXED))
    assert load_recipe(tmp_path / "r.json") == load_recipe(tmp_path / "r.yaml")
    assert Recipe.from_dict(load_recipe(tmp_path / "r.yaml").to_dict()) == load_recipe(tmp_path / "r.json")
    (tmp_path / "bad.yaml").write_text("method: [unclosed")
    with pytest.raises(OptionError, match="not valid YAML"):
        load_recipe(tmp_path / "bad.yaml")


def test_a_pattern_that_matches_nothing_warns(capsys):
    r = Recipe.from_dict({"method": "rtn", "skip": ["mlp.dwn_proj"]})
    report = quantize_model(tiny_llama(), _calib(), r, settings=RunSettings(progress=False))
    warn = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert len(warn) == 1 and "skip[0] 'mlp.dwn_proj' matches no linear" in warn[0], warn
    assert len(report.layers) == 14  # nothing skipped


@pytest.mark.parametrize(
    "recipe, needle",
    [
        ({"skip": ["down_proj", r"mlp\.down_proj$"]}, "skip[1]"),  # the same linears twice
        ({"skip": ["layers\\.1\\."], "overrides": [{"match": "layers\\.1\\.mlp", "settings": {"bits": 8}}]},
         "overrides[0].match"),  # every match already skipped
        ({"overrides": [{"match": "proj", "settings": {"bits": 8}}, {"match": "q_proj"}]},
         "overrides[1].match"),  # shadowed by the first override
    ],
)
def test_an_entry_that_could_never_apply_is_refused(recipe, needle):
    r = Recipe.from_dict({"method": "rtn", **recipe})
    with pytest.raises(OptionError) as e:
        quantize_model(tiny_llama(), _calib(), r, settings=RunSettings(progress=False))
    assert needle in str(e.value) and "already took" in str(e.value) and "\n" not in str(e.value)


def test_one_entry_recipe_is_the_plain_method():
    from bitmosaic import quantize_

    a, b = tiny_llama(), tiny_llama()
    quantize_(a, "gptq", _calib(), bits=4, group_size=32, order="act", progress=False)
    quantize_model(b, _calib(), Recipe.from_options("gptq", {"bits": 4, "group_size": 32, "order": "act"}))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_overrides_and_skips_reach_every_linear(tmp_path):
    from bitmosaic.algorithms import rtn_quantize
    from bitmosaic.formats.grid import IntGrid
    from bitmosaic.io import save_quantized
    from bitmosaic.io.saved.save import quantized_modules

    model = tiny_llama()
    float_down = model.model.layers[1].mlp.down_proj.weight.detach().clone()
    report = quantize_model(model, _calib(), Recipe.from_dict(MIXED), settings=RunSettings(progress=False))
    q = quantized_modules(model)
    assert isinstance(model.model.layers[1].mlp.gate_proj, nn.Linear)  # skipped: float
    assert "model.layers.1.mlp.gate_proj" not in q and len(q) == 13
    assert q[QPROJ0].bits == 3 and q["model.layers.0.self_attn.k_proj"].bits == 4
    assert q["model.layers.1.self_attn.q_proj"].bits == 4
    down = q["model.layers.1.mlp.down_proj"]
    assert down.bits == 8 and down.group_size == down.in_features
    # RTN needs no inputs: the override's result is RTN of the float weight itself
    ref = rtn_quantize(float_down.float(), IntGrid(8, False), None).dequantize(torch.float32)
    assert torch.equal(down.dequantize_weight(torch.float32), ref)
    rows = {r["name"]: r for r in report.layers}
    assert rows[QPROJ0]["method"] == "gptq" and "stacked_with" not in rows[QPROJ0]  # own config
    assert rows["model.layers.0.self_attn.k_proj"]["stacked_with"] == ["self_attn.v_proj"]
    assert rows["model.layers.1.self_attn.q_proj"]["stacked_with"] == ["self_attn.k_proj", "self_attn.v_proj"]
    assert rows["model.layers.0.mlp.down_proj"]["method"] == "rtn"
    # saved and loaded through transformers with the mixed kinds
    import bitmosaic

    save_quantized(model, tmp_path / "mixed", {"method": "gptq", "recipe": Recipe.from_dict(MIXED).to_dict()})
    loaded = bitmosaic.load(tmp_path / "mixed")
    x = _calib()[:1]
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    assert loaded.quantization_info["recipe"] == Recipe.from_dict(MIXED).to_dict()


def test_smoothing_only_where_a_group_shares_one_smoothing_method():
    r = Recipe.from_dict(
        {
            "method": "smoothquant",
            "scheme": "W8A8",
            "settings": {"group_size": None, "alpha": 0.5},
            "overrides": [{"match": r"mlp\.up_proj$", "method": "rtn", "settings": {"bits": 8}}],
        }
    )
    report = quantize_model(tiny_llama(), _calib(), r, settings=RunSettings(progress=False))
    rows = {r["name"]: r for r in report.layers}
    assert rows[QPROJ0]["transform"]["folded"] is True
    assert "transform" not in rows["model.layers.0.mlp.gate_proj"]  # gate/up: mixed methods
    assert "act" not in rows["model.layers.0.mlp.up_proj"] and rows["model.layers.0.mlp.gate_proj"]["act"]


# --- CLI ---------------------------------------------------------------------------------------------


@pytest.fixture
def cli_env(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(words(2000))
    return save_hf_dir(tmp_path / "float"), text


def _argv(model_dir, text, out, *extra):
    flags = "--nsamples 2 --seqlen 16 --no-progress --device cpu".split()
    return ["quantize", "--model", str(model_dir), "--calib", str(text), *flags, "--out", str(out), *extra]


def test_cli_recipe_then_reproduce(cli_env, tmp_path, capsys):
    import yaml

    from bitmosaic.cli import main

    model_dir, text = cli_env
    rfile = tmp_path / "recipe.yaml"
    rfile.write_text(yaml.safe_dump(MIXED))
    out = tmp_path / "q"
    assert main(_argv(model_dir, text, out, "--recipe", str(rfile))) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["recipe"] == Recipe.from_dict(MIXED).to_dict()
    prov = qc["provenance"]
    assert prov["versions"]["torch"] == torch.__version__ and prov["versions"]["transformers"]
    assert prov["calibration"]["nsamples"] == 2 and len(prov["calibration"]["sample_sha256"]) == 2
    assert qc["modules"][QPROJ0]["bits"] == 3
    capsys.readouterr()
    assert main(["reproduce", str(out), "--no-progress"]) == 0
    assert "tensors match bit for bit" in capsys.readouterr().out
    # one changed scale: exit 1, the tensor named with its difference
    from safetensors.torch import load_file, save_file

    sd = load_file(out / "model.safetensors")
    key = f"{QPROJ0}.scales"
    before = sd[key][0, 0].double().item()
    sd[key][0, 0] += 1.0
    moved = abs(sd[key][0, 0].double().item() - before)  # 1.0 after fp16 rounding
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    assert main(["reproduce", str(out), "--no-progress"]) == 2  # SHA256SUMS: the file changed since the save
    assert "model.safetensors differs" in capsys.readouterr().err
    (out / "SHA256SUMS").unlink()  # as a folder from before the hashes: the rerun compares the tensors
    assert main(["reproduce", str(out), "--no-progress", "--json", str(tmp_path / "r.json")]) == 1
    assert f"DIFFERS {key}" in capsys.readouterr().out
    res = json.loads((tmp_path / "r.json").read_text())
    assert [r["name"] for r in res["differing"]] == [key] and res["differing"][0]["max_abs_diff"] == moved


def test_reproduce_pins_a_default_that_changed_since_the_save(cli_env, tmp_path, capsys):
    """A model saved when GPTQ's groups defaulted to dynamic records no ``static_groups`` in its recipe
    but ``false`` in its config: reproduce reruns with the recorded value, where today's default (auto:
    static at 4 bits) would give other tensors."""
    from bitmosaic.cli import main

    model_dir, text = cli_env
    out = tmp_path / "old"
    flags = ("--method", "gptq", "--bits", "4", "--group-size", "16", "--no-static-groups")
    assert main(_argv(model_dir, text, out, *flags)) == 0
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["recipe"]["settings"].pop("static_groups") is False and qc["config"]["static_groups"] is False
    (out / "config.json").write_text(json.dumps(cfg))  # as the older release recorded it
    (out / "SHA256SUMS").unlink()  # else the edited config.json is refused first, as changed
    capsys.readouterr()
    assert main(["reproduce", str(out), "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "the recorded values are used: static_groups=False" in said and "tensors match bit for bit" in said
    qc["config"]["static_groups"] = None  # nothing to pin: today's default runs, and the tensors differ
    (out / "config.json").write_text(json.dumps(cfg))
    assert main(["reproduce", str(out), "--no-progress"]) == 1
    said = capsys.readouterr().out
    assert "recorded values are used" not in said and "DIFFERS" in said


def test_cli_flags_are_a_one_entry_recipe_and_exclude_recipe(cli_env, tmp_path, capsys):
    from bitmosaic.cli import main

    model_dir, text = cli_env
    out = tmp_path / "flags"
    assert main(_argv(model_dir, text, out, "--method", "rtn", "--bits", "3", "--group-size", "32")) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["recipe"]["method"] == "rtn" and qc["recipe"]["settings"] == {"bits": 3, "group_size": 32}
    rfile = tmp_path / "r.json"
    rfile.write_text(json.dumps({"method": "rtn"}))
    capsys.readouterr()
    assert main(_argv(model_dir, text, tmp_path / "x", "--recipe", str(rfile), "--bits", "3")) == 2
    err = capsys.readouterr().err
    assert "--recipe sets the method and its settings, so --bits cannot be given too" in err
    # a folder without a recipe cannot be reproduced: one line, exit 2
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]["recipe"]
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "SHA256SUMS").unlink()  # else the edited config.json is refused first, as changed
    assert main(["reproduce", str(out)]) == 2
    assert "records no recipe and provenance" in capsys.readouterr().err
