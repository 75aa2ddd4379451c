"""``--rotate`` composed with every method, saved, loaded by every load path, refused where it cannot go
(export formats, streaming), through the recipe and the CLI."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from bitmosaic.errors import OptionError
from bitmosaic.modules.rotation import _input_rotation_hook, input_rotation_spec
from tests.helpers import SPECIALS, VOCAB, tiny_llama, word_tokenizer


def _calib():
    return torch.randint(len(SPECIALS), VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))


def _eval_ids():
    return torch.randint(len(SPECIALS), VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


# every weight and activation quantizer, at settings near-lossless on the tiny model: a rotation
# folded wrongly into any of them (or a smoothing folded across the online rotation) shows as O(1) error
METHODS = {
    "rtn": {"bits": 8},
    "gptq": {"bits": 8, "order": "act"},
    "babai": {"bits": 8},
    "awq": {"bits": 8},
    "smoothquant": {"scheme": "W8A8", "alpha": 0.5},
    "mosaic": {},
    "sq-weights": {},
    "sq-acts": {},
    "dpq": {},
    "ssqr": {"bits": 8},
    "fp8": {},
    "sfmp": {"avg_bits": 6},
}


@pytest.fixture(scope="module")
def float_logits():
    with torch.no_grad():
        return tiny_llama()(_eval_ids()).logits


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_composes_with_rotation(method, float_logits):
    from bitmosaic import quantize_

    m = tiny_llama()
    report = quantize_(m, method, _calib(), progress=False, rotate="hadamard", **METHODS[method])
    assert report.calibration["rotation"] == {"kind": "hadamard", "seed": 0, "online": 4, "untied_head": True}
    down = m.model.layers[1].mlp.down_proj
    assert input_rotation_spec(down) == {"type": "hadamard", "n": 96}
    assert next(iter(down._forward_pre_hooks.values())) is _input_rotation_hook  # before any act quantizer
    with torch.no_grad():
        out = m(_eval_ids()).logits
    rel = ((out - float_logits).norm() / float_logits.norm()).item()
    assert rel < 0.15, rel  # a wrong fold gives ~1


def test_smoothing_skips_the_rotated_down_proj():
    """down_proj's input is rotated online, so per-channel factors cannot go into up_proj any more."""
    from bitmosaic import quantize_

    def folded(rotate):
        r = quantize_(tiny_llama(), "smoothquant", _calib(), progress=False, rotate=rotate, scheme="W8A8",
                      alpha=0.5)  # fmt: skip
        return {
            row["name"].split(".")[-1]: row["transform"]["folded"] for row in r.layers if "transform" in row
        }

    assert folded(None)["down_proj"] is True
    plain, rotated = folded(None), folded("hadamard")
    assert rotated["down_proj"] is False and rotated["o_proj"] is False
    assert rotated["q_proj"] is True and rotated["gate_proj"] is True and plain["q_proj"] is True


@pytest.fixture(scope="module")
def saved_rotated(tmp_path_factory):
    from bitmosaic import quantize_
    from bitmosaic.io import save_quantized

    m = tiny_llama()
    with torch.no_grad():  # a final norm with a scale of its own: the head must be untied from the embeddings
        m.model.norm.weight.uniform_(0.5, 1.5)
    quantize_(m, "gptq", _calib(), progress=False, rotate="hadamard", scheme="W4A8", group_size=32)
    path = tmp_path_factory.mktemp("rot") / "q"
    save_quantized(m, path, tokenizer=word_tokenizer())
    return path, m


def test_saved_model_records_and_every_loader_reapplies_the_rotation(saved_rotated):
    from transformers import AutoModelForCausalLM

    import bitmosaic
    from bitmosaic.io import load_quantized

    path, quantized = saved_rotated
    cfg = json.loads((path / "config.json").read_text())
    rot = cfg["quantization_config"]["rotation"]
    assert rot["kind"] == "hadamard" and cfg["tie_word_embeddings"] is False
    want = {f"model.layers.{i}.mlp.down_proj": {"type": "hadamard", "n": 96} for i in (0, 1)}
    want |= {f"model.layers.{i}.self_attn.o_proj": {"type": "hadamard", "n": 64} for i in (0, 1)}
    assert rot["online"] == want
    assert cfg["quantization_config"]["recipe"]["rotate"] == "hadamard"
    x = _eval_ids()
    with torch.no_grad():
        want = quantized(x).logits
        for model in (
            load_quantized(path)[0],
            bitmosaic.load(path),
            AutoModelForCausalLM.from_pretrained(path),
        ):
            down = model.model.layers[0].mlp.down_proj
            assert next(iter(down._forward_pre_hooks.values())) is _input_rotation_hook
            assert down.input_quant is not None  # the A8 quantizer runs after the rotation
            assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
            assert torch.equal(model(x).logits, want)
        # the online rotation matters: without it the same weights compute something else
        down._forward_pre_hooks.pop(down._input_rotation_handle.id)
        assert (model(x).logits - want).abs().max() > 1e-2


def test_online_rotation_runs_ahead_of_the_integer_activation_kernel(saved_rotated, monkeypatch):
    """A rotated W4A8 model on the integer path: the rotated ``down_proj`` quantizes the *rotated* input
    inside its integer kernel, and the logits equal the simulated path's up to float32 rounding."""
    import bitmosaic
    from bitmosaic.modules.intact import ACT_COMPUTE_ENV, IntActKernel

    path, _ = saved_rotated
    model = bitmosaic.load(path)
    down = model.model.layers[0].mlp.down_proj
    seen = {}

    def keep(name):
        def hook(mod, args, *out):
            seen.setdefault(name, args[0].clone())

        return hook

    down.register_forward_pre_hook(keep("raw"), prepend=True)  # before the rotation
    down.register_forward_hook(keep("kernel_input"))  # what forward got: after every pre-hook
    x = _eval_ids()
    with torch.no_grad():
        y_int = model(x).logits
        assert isinstance(down._int_act, IntActKernel)  # the integer path ran
        # forward got the rotated input, not yet quantized (the kernel quantizes it)
        assert torch.equal(seen["kernel_input"], down.input_rotation(seen["raw"]))
        assert not torch.equal(seen["kernel_input"], seen["raw"])
        monkeypatch.setenv(ACT_COMPUTE_ENV, "sim")
        y_sim = model(x).logits
        monkeypatch.delenv(ACT_COMPUTE_ENV)
    assert (y_int - y_sim).abs().max() <= 1e-2 * y_sim.abs().max()
    assert (y_int.argmax(-1) == y_sim.argmax(-1)).float().mean() >= 0.95


def test_resave_keeps_the_rotation(saved_rotated, tmp_path):
    import bitmosaic
    from bitmosaic.io import load_quantized

    path, quantized = saved_rotated
    bitmosaic.load(path).save_pretrained(tmp_path / "again")
    again, _ = load_quantized(tmp_path / "again", load_tokenizer=False)
    with torch.no_grad():
        assert torch.equal(again(_eval_ids()).logits, quantized(_eval_ids()).logits)


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_export_refused_in_one_line(saved_rotated, tmp_path, capsys, fmt):
    from bitmosaic.cli import main

    path, _ = saved_rotated
    assert main(["export", str(path), "--format", fmt, "--out", str(tmp_path / "x"), "--lossy"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot export as {fmt}: the model was quantized with --rotate hadamard")
    assert "at the input of 4 layer(s) (e.g. down_proj)" in err
    assert "\n" not in err and not (tmp_path / "x").exists()


def test_recipe_key_and_bad_values():
    from bitmosaic.pipeline.recipe import Recipe

    r = Recipe.from_dict({"method": "rtn", "rotate": "random"})
    assert r.rotate == "random" and r.to_dict()["rotate"] == "random"
    assert "rotate" not in Recipe.from_dict({"method": "rtn"}).to_dict()
    with pytest.raises(OptionError, match="'rotate' must be one of none, hadamard, random"):
        Recipe.from_dict({"method": "rtn", "rotate": "spin"})
    from bitmosaic import quantize_

    with pytest.raises(OptionError, match="cannot be given too"):
        quantize_(tiny_llama(), {"method": "rtn"}, _calib(), rotate="hadamard")


def test_recipe_rotation_equals_the_flag():
    from bitmosaic import quantize_

    a, b = tiny_llama(), tiny_llama()
    quantize_(
        a, {"method": "rtn", "settings": {"bits": 4}, "rotate": "random"}, _calib(), progress=False, seed=3
    )
    quantize_(b, "rtn", _calib(), progress=False, bits=4, rotate="random", seed=3)
    assert a.bitmosaic_rotation == b.bitmosaic_rotation and a.bitmosaic_rotation["kind"] == "random"
    with torch.no_grad():
        assert torch.equal(a(_eval_ids()).logits, b(_eval_ids()).logits)


def test_cli_quantize_inspect_eval_and_stream_refusal(tmp_path, capsys):
    from bitmosaic.cli import main
    from tests.helpers import cli_quantize_args

    out = tmp_path / "q"
    base = cli_quantize_args(tmp_path)
    assert main([*base, "--rotate", "hadamard", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert (
        "rotation         hadamard (seed 0): online hadamard at the input of 4 layer(s)"
        in capsys.readouterr().out
    )
    ev = ["eval", str(out), "--ppl", str(tmp_path / "calib.txt"), "--seqlen", "32", "--max-windows", "2",
          "--no-progress"]  # fmt: skip
    assert main(ev) == 0
    capsys.readouterr()
    assert main(["reproduce", str(out)]) == 0  # the recipe's rotate key reruns the same rotation
    assert "match bit for bit" in capsys.readouterr().out
    assert main([*base, "--rotate", "hadamard", "--stream", "on", "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("error: --rotate hadamard folds rotations")
        and "--stream off" in err
        and "\n" not in err
    )
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"method": "rtn"}))
    assert main(["quantize", "--model", base[2], "--recipe", str(recipe), "--rotate", "random"]) == 2
    assert "--rotate (the recipe's 'rotate' key)" in capsys.readouterr().err


def test_pipeline_refuses_a_store_with_rotation():
    from bitmosaic.pipeline import quantize_model
    from bitmosaic.pipeline.recipe import Recipe

    recipe = Recipe.from_options("rtn", {}, rotate="hadamard")
    with pytest.raises(OptionError, match="--stream off"):
        quantize_model(tiny_llama(), _calib(), recipe, store=object())


def test_random_rotation_seeds_differ():
    from bitmosaic import quantize_

    a, b = tiny_llama(), copy.deepcopy(tiny_llama())
    quantize_(a, "rtn", _calib(), progress=False, bits=4, rotate="random", seed=0)
    quantize_(b, "rtn", _calib(), progress=False, bits=4, rotate="random", seed=1)
    assert not torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
