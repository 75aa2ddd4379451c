"""BOS protocol: for tokenizers that add a BOS by default, every calibration sample
and every perplexity window starts with BOS; for the others nothing changes."""

from __future__ import annotations

import torch

from bitmosaic.cli import main
from bitmosaic.data import bos_token_id, calibration_samples, eval_tokens
from bitmosaic.eval import perplexity
from tests.helpers import save_hf_dir, tiny_gemma, word_tokenizer, words


def _text_file(tmp_path, n=3000):
    f = tmp_path / "text.txt"
    f.write_text(words(n))
    return f


def test_bos_detection():
    assert bos_token_id(word_tokenizer(bos=True)) == 2
    assert bos_token_id(word_tokenizer(bos=False)) is None


def test_calibration_samples_start_with_bos(tmp_path):
    f = _text_file(tmp_path)
    tok = word_tokenizer(bos=True)
    s = calibration_samples(tok, f, 5, 32, seed=0)
    assert s.shape == (5, 32)
    assert (s[:, 0] == 2).all() and not (s[:, 1:] == 2).any()
    plain = calibration_samples(word_tokenizer(bos=False), f, 5, 32, seed=0)
    assert plain.shape == (5, 32) and not (plain == 2).any()


def test_eval_tokens_carry_no_bos_and_windows_get_one(tmp_path):
    f = _text_file(tmp_path)
    tok = word_tokenizer(bos=True)
    ids = eval_tokens(tok, f)
    assert not (ids == 2).any()  # the text alone; perplexity adds one BOS per window
    seen = []

    class Spy(torch.nn.Module):
        def forward(self, x, use_cache=False):
            seen.append(x.clone())
            return type("O", (), {"logits": torch.zeros(*x.shape, 200)})()

    r = perplexity(Spy(), ids, 16, max_windows=3, progress=False, bos_token_id=2)
    assert r["bos"] is True and r["windows"] == 3 and r["tokens"] == 3 * 15
    batch = torch.cat(seen)
    assert (batch[:, 0] == 2).all()
    assert torch.equal(batch[:, 1:].reshape(-1), ids[0, : 3 * 15])  # consecutive text, 15 per window
    r0 = perplexity(Spy(), ids, 16, max_windows=3, progress=False)
    assert r0["bos"] is False and r0["tokens"] == 3 * 15


def test_gemma_cli_eval_uses_bos_and_records_it(tmp_path, capsys):
    import json

    d = save_hf_dir(tmp_path / "gemma", tiny_gemma(), bos=True)
    f = _text_file(tmp_path)
    js = tmp_path / "ppl.json"
    assert (
        main(
            [
                "eval",
                str(d),
                "--ppl",
                str(f),
                "--seqlen",
                "32",
                "--max-windows",
                "4",
                "--json",
                str(js),
                "--no-progress",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    res = json.loads(js.read_text())
    assert res["bos"] is True
    # the same model scored without BOS windows differs: the protocol really changed
    from bitmosaic.io import load_model

    model, tok = load_model(str(d))
    ids = eval_tokens(tok, f)
    with_bos = perplexity(model, ids, 32, max_windows=4, progress=False, bos_token_id=2)["ppl"]
    assert abs(with_bos - res["ppl"]) < 1e-6 * res["ppl"]
    without = perplexity(model, ids, 32, max_windows=4, progress=False)["ppl"]
    assert without != with_bos
