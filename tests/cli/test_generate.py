"""``bitmosaic generate DIR --prompt TEXT`` (cli/generate.py, issue 74): through the CLI entry on a tiny
saved model; the text on stdout is what transformers' own greedy ``generate`` of the same folder decodes
to, the rates are on stderr, bad input is one line and exit 2."""

from __future__ import annotations

import re

import pytest
import torch

from bitmosaic.cli import main
from bitmosaic.modules.decode import NO_COMPILE_ENV
from bitmosaic.testing import save_hf_dir
from tests.helpers import varied_quantized_dir

PROMPT = "w3 w17 w5 w40 w9"
NEW = 12


@pytest.fixture(scope="module")
def qdir(tmp_path_factory):
    return varied_quantized_dir(tmp_path_factory.mktemp("gen") / "w4")  # with its tokenizer


def reference_text(path) -> str:
    """The greedy continuation by transformers' loader and ``generate`` (eager), decoded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["generate", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


RATE = re.compile(r"^(prefill|decode): \d+ tokens in [\d.]+ s \([\d.]+ tok/s\)")


def test_generate_streams_the_greedy_text_and_prints_rates(qdir, capsys):
    ref = reference_text(qdir)
    assert len(set(ref.split())) > 1  # a continuation that can differ
    rc, out, err = run(
        capsys, qdir, "--prompt", PROMPT, "--max-new-tokens", NEW, "--threads", 1, "--no-compile"
    )
    assert rc == 0, err
    assert out.strip() == ref.strip()
    lines = err.strip().splitlines()
    assert [m.group(1) for x in lines if (m := RATE.match(x))] == ["prefill", "decode"], err
    assert "compiling" not in err
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)


def test_generate_with_runtime_int16_activations(qdir, capsys):
    """``--runtime-act int16``: the weight-only layers run 16-bit integer activations (stderr says how many;
    stdout stays the text alone), and the greedy text is the weight-only one (its steps are 1/32639 of
    each token's largest input: no greedy choice of this model moves); ``int8`` is accepted too."""
    ref = reference_text(qdir)
    rc, out, err = run(
        capsys, qdir, "--prompt", PROMPT, "--max-new-tokens", NEW, "--no-compile", "--runtime-act", "int16"
    )
    assert rc == 0, err
    assert out.strip() == ref.strip()
    n = re.search(r"^runtime activations int16: (\d+) weight-only layers \(not saved\)$", err, re.M)
    assert n and int(n.group(1)) > 0, err
    rc, out, err = run(
        capsys, qdir, "--prompt", PROMPT, "--max-new-tokens", 4, "--no-compile", "--runtime-act", "int8"
    )
    assert rc == 0 and out.strip() and "runtime activations int8" in err


def test_generate_samples_with_a_temperature(qdir, capsys):
    torch.manual_seed(0)
    rc, out, err = run(
        capsys, qdir, "--prompt", PROMPT, "--max-new-tokens", 6, "--temperature", 1.5, "--no-compile"
    )
    assert rc == 0, err
    assert out.strip() and "decode:" in err


@pytest.mark.slow
def test_generate_compiles_by_default_with_the_eager_text(qdir, capsys, monkeypatch):
    ref = reference_text(qdir)  # eager: the session's $BITMOSAIC_NO_COMPILE=1 (test_reference_is_eager)
    monkeypatch.delenv(NO_COMPILE_ENV, raising=False)
    torch._dynamo.reset()
    rc, out, err = run(capsys, qdir, "--prompt", PROMPT, "--max-new-tokens", NEW)
    assert rc == 0, err
    assert out.strip() == ref.strip()
    assert "bitmosaic: compiling the decode step" in err
    assert re.search(
        r"^decode: .*tok/s\) \(after the first decode step, [\d.]+ s, which compiles\)$", err, re.M
    )


def test_reference_is_eager(qdir):
    """``reference_text`` under the test session's default ($BITMOSAIC_NO_COMPILE=1, conftest) is eager."""
    from transformers import AutoModelForCausalLM

    assert not hasattr(AutoModelForCausalLM.from_pretrained(qdir), "_compiled_call")


@pytest.mark.parametrize(
    "make,argv,expect",
    [
        (None, ["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, not 0"),
        (None, ["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (None, ["--temperature", "nan"], "--temperature must be a finite number >= 0"),
        (None, ["--threads", "0"], "--threads must be at least 1"),
        (
            "missing",
            [],
            "does not exist: bitmosaic generate takes a folder saved by `bitmosaic quantize",
        ),
        ("gguf", [], "a GGUF file (run it with llama.cpp)"),
        ("float", [], "is not a bitmosaic folder (a float model?): quantize it first"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(qdir, tmp_path, capsys, make, argv, expect):
    target = qdir
    if make == "missing":
        target = tmp_path / "nothing"
    elif make == "gguf":
        target = tmp_path / "model.gguf"
        target.write_bytes(b"GGUF\x03\x00\x00\x00")
    elif make == "float":
        target = save_hf_dir(tmp_path / "float")
    capsys.readouterr()  # the writer's progress bar
    rc, out, err = run(capsys, target, "--prompt", PROMPT, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and expect in err, err


def test_missing_prompt_is_an_argparse_error(qdir, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", str(qdir)])
    assert e.value.code == 2 and "--prompt" in capsys.readouterr().err
