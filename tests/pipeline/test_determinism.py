"""Determinism (issue 26, section 4): the same ``bitmosaic quantize`` command gives the same saved bytes
-- every tensor, bit for bit, and the ``model.safetensors`` file itself -- run twice in a row, with
``--threads 1`` and ``--threads 2``, and with the calibration cache off, cold (written) and warm (read).
The model is a small random Llama wide enough (256 inputs, 512 for ``down_proj``) that torch's CPU
matmuls and reductions split their work over threads.  Streamed vs in-memory and resumed runs are
checked in ``tests/pipeline/test_stream.py`` (``test_streamed_bytes_equal_the_in_memory_run``,
``test_resume_after_an_interruption_gives_the_same_bytes``); see ``docs/determinism.md``."""

import hashlib

import pytest
import torch


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from bitmosaic.testing import VOCAB, save_hf_dir, words

    root = tmp_path_factory.mktemp("determinism")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)  # fmt: skip
    model = save_hf_dir(root / "model", LlamaForCausalLM(cfg).eval())
    text = root / "text.txt"
    text.write_text(words(4000))
    return root, model, text


def _quantize(wide, name: str, method: str, *extra: str) -> dict[str, str]:
    """Run the command into ``name``; digest of every saved tensor and of the whole weights file."""
    from safetensors.torch import load_file

    from bitmosaic.cli import main

    root, model, text = wide
    out = root / name
    threads = torch.get_num_threads()
    try:
        argv = ["quantize", "--model", str(model), "--method", method, "--bits", "4", "--group-size", "64",
                "--calib", str(text), "--nsamples", "8", "--seqlen", "64", "--seed", "0", "--no-progress",
                "--out", str(out), *extra]  # fmt: skip
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    digests = {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
               for k, v in load_file(str(out / "model.safetensors")).items()}  # fmt: skip
    digests["<file>"] = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    return digests


@pytest.mark.parametrize("method", ["gptq", "babai", "awq", "rtn"])
def test_the_same_command_gives_bit_identical_tensors(wide, method):
    cache = ["--cache-dir", str(wide[0] / f"cache-{method}")]
    runs = {
        "threads 1, no cache": _quantize(wide, f"{method}-a", method, "--threads", "1", "--no-cache"),
        "again": _quantize(wide, f"{method}-b", method, "--threads", "1", "--no-cache"),
        "threads 2, cache cold": _quantize(wide, f"{method}-c", method, "--threads", "2", *cache),
        "threads 2, cache warm": _quantize(wide, f"{method}-d", method, "--threads", "2", *cache),
    }
    first = runs["threads 1, no cache"]
    assert len(first) > 10
    for what, got in runs.items():
        differ = sorted(k for k in first if got[k] != first[k])
        assert not differ, f"{method}, {what}: {differ[:5]} differ from the first run"
