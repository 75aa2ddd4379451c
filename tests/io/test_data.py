"""bitmosaic.data: data-folder resolution, text sources, calibration windows, evaluation tokens.

No network and no shared data needed: every data folder is built under ``tmp_path`` and the tokenizer is a
real ``PreTrainedTokenizerFast`` built in memory from a ``tokenizers`` WordLevel model.
"""

import hashlib
import sys
import types

import pytest
import torch

from bitmosaic.data import ENV_VAR, calibration_samples, eval_tokens, load_text, resolve_data_dir

NWORDS = 600


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def make_tokenizer(model_max_length: int = 64):
    """Whitespace word-level tokenizer: ``w{i}`` -> id ``i + 1``, anything else -> ``[UNK]`` (0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(NWORDS)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", model_max_length=model_max_length)


def words(n: int, per_line: int = 10) -> str:
    """``w0 w1 ... w{n-1}``, ``per_line`` words a line: token at position p has id p + 1."""
    toks = [f"w{i}" for i in range(n)]
    return "".join(" ".join(toks[i : i + per_line]) + " \n" for i in range(0, n, per_line))


def make_data_dir(root, test_text="test text\n", valid_text=None, crlf=False):
    (root / "wikitext-2-raw").mkdir(parents=True)
    (root / "wikitext-2").mkdir(parents=True)
    raw = test_text.replace("\n", "\r\n") if crlf else test_text
    (root / "wikitext-2-raw" / "wiki.test.raw").write_bytes(raw.encode("utf-8"))
    (root / "wikitext-2" / "valid.txt").write_text(valid_text or words(NWORDS), encoding="utf-8")
    return root


# --- resolve_data_dir -------------------------------------------------------------------------------


def test_resolve_none_without_env():
    assert resolve_data_dir(None) is None


def test_resolve_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    assert resolve_data_dir(None) == tmp_path


def test_resolve_argument_beats_env(tmp_path, monkeypatch):
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    assert resolve_data_dir(other) == other
    assert resolve_data_dir(str(other)) == other


def test_resolve_missing_dir_errors(tmp_path, monkeypatch):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope.*data_dir"):
        resolve_data_dir(missing)
    monkeypatch.setenv(ENV_VAR, str(missing))
    with pytest.raises(FileNotFoundError, match=ENV_VAR):
        resolve_data_dir(None)


# --- load_text --------------------------------------------------------------------------------------


def test_local_text_file(tmp_path):
    p = tmp_path / "my.txt"
    p.write_bytes("héllo\r\nwörld\n".encode())
    assert load_text(str(p), "test") == "héllo\nwörld\n"  # UTF-8, universal newlines
    assert load_text(p, "calib") == "héllo\nwörld\n"  # split ignored, PathLike accepted


def test_local_text_file_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt.*neither a known dataset"):
        load_text(str(tmp_path / "missing.txt"), "test")


def test_local_text_file_empty(tmp_path):
    p = tmp_path / "empty.txt"
    p.write_text(" \n\n")
    with pytest.raises(ValueError, match="empty"):
        load_text(str(p), "test")


def test_wikitext2_paths(tmp_path):
    root = make_data_dir(tmp_path / "data", test_text=" = T = \n raw test \n", valid_text=" valid <unk> \n")
    assert load_text("wikitext2", "test", data_dir=root) == " = T = \n raw test \n"
    assert load_text("wikitext-2", "test", data_dir=root) == " = T = \n raw test \n"
    assert load_text("WikiText2", "calib", data_dir=root) == " valid <unk> \n"
    assert load_text("wikitext2", "validation", data_dir=str(root)) == " valid <unk> \n"


def test_wikitext2_crlf_file_normalised(tmp_path):
    root = make_data_dir(tmp_path / "data", test_text=" a \n b \n", crlf=True)
    assert load_text("wikitext2", "test", data_dir=root) == " a \n b \n"


def test_wikitext2_via_env(tmp_path, monkeypatch):
    root = make_data_dir(tmp_path / "data", test_text="from env\n")
    monkeypatch.setenv(ENV_VAR, str(root))
    assert load_text("wikitext2", "test") == "from env\n"


def test_wikitext2_bad_split_and_missing_file(tmp_path):
    root = make_data_dir(tmp_path / "data")
    with pytest.raises(ValueError, match="unknown split"):
        load_text("wikitext2", "dev", data_dir=root)
    (root / "wikitext-2" / "valid.txt").unlink()
    with pytest.raises(FileNotFoundError, match="valid.txt"):
        load_text("wikitext2", "calib", data_dir=root)


def test_sha256sums_checked(tmp_path):
    import warnings

    root = make_data_dir(tmp_path / "data", test_text="checked\n")
    good = hashlib.sha256(b"checked\n").hexdigest()
    (root / "SHA256SUMS").write_text(
        f"{good}  wikitext-2-raw/wiki.test.raw\n{'0' * 64}  wikitext-2/valid.txt\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_text("wikitext2", "test", data_dir=root) == "checked\n"
    with pytest.warns(UserWarning, match="SHA256"):
        text = load_text("wikitext2", "calib", data_dir=root)
    assert text  # a mismatch warns, it does not fail


def test_hub_fallback_without_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(RuntimeError, match=f"datasets.*--data-dir.*{ENV_VAR}"):
        load_text("wikitext2", "test")


def test_hub_fallback_offline(monkeypatch):
    def load_dataset(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(RuntimeError, match=f"no network.*--data-dir.*{ENV_VAR}"):
        load_text("wikitext2", "test")


def test_hub_fallback_joins_rows_like_the_file(monkeypatch):
    calls = []
    rows = ["", " = Title = \n", "", " para one . \n", " para two . \n", ""]

    def load_dataset(path, name, split):
        calls.append((path, name, split))
        return {"text": rows}

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert load_text("wikitext2", "test") == " = Title = \n para one . \n para two . \n"
    load_text("wikitext2", "calib")
    load_text("wikitext2", "validation")
    assert calls == [
        ("wikitext", "wikitext-2-raw-v1", "test"),
        ("wikitext", "wikitext-2-raw-v1", "train"),
        ("wikitext", "wikitext-2-raw-v1", "validation"),
    ]


# --- calibration_samples ----------------------------------------------------------------------------


def test_calibration_samples_shape_and_windows(tmp_path):
    tok = make_tokenizer()
    root = make_data_dir(tmp_path / "data")
    s = calibration_samples(tok, "wikitext2", nsamples=8, seqlen=32, seed=0, data_dir=root)
    assert s.shape == (8, 32) and s.dtype == torch.long
    # each sample is a contiguous window of the stream (id = position + 1), starting at <= N - seqlen - 1
    starts = s[:, 0] - 1
    assert torch.equal(s, starts[:, None] + 1 + torch.arange(32)[None, :])
    assert int(starts.min()) >= 0 and int(starts.max()) <= NWORDS - 32 - 1


def test_calibration_samples_seeded(tmp_path, monkeypatch):
    tok = make_tokenizer()
    monkeypatch.setenv(ENV_VAR, str(make_data_dir(tmp_path / "data")))
    a = calibration_samples(tok, "wikitext2", 16, 16, seed=1)
    b = calibration_samples(tok, "wikitext2", 16, 16, seed=1)
    c = calibration_samples(tok, "wikitext2", 16, 16, seed=2)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_calibration_samples_from_local_file(tmp_path):
    p = tmp_path / "calib.txt"
    p.write_text(words(100))
    s = calibration_samples(make_tokenizer(), str(p), 4, 10, seed=0)
    assert s.shape == (4, 10)
    assert int(s.min()) >= 1 and int(s.max()) <= 100


def test_calibration_samples_too_short(tmp_path):
    p = tmp_path / "short.txt"
    p.write_text(words(20))
    tok = make_tokenizer()
    with pytest.raises(ValueError, match="20 tokens.*seqlen \\+ 1 = 21"):
        calibration_samples(tok, str(p), 2, 20, seed=0)
    s = calibration_samples(tok, str(p), 3, 19, seed=0)  # exactly seqlen + 1 tokens: the only start is 0
    assert torch.equal(s, (torch.arange(19) + 1).expand(3, 19))


def test_calibration_samples_plain_tokenizer(tmp_path):
    """Any callable returning ``{"input_ids": ...}`` (lists or tensors) works, not only HF tokenizers."""

    class CharTokenizer:
        def __call__(self, text, return_tensors=None, **kwargs):
            return {"input_ids": [[ord(ch) for ch in text]]}

    p = tmp_path / "chars.txt"
    p.write_text("abcdefghijklmnopqrstuvwxyz")
    s = calibration_samples(CharTokenizer(), str(p), 5, 4, seed=3)
    assert s.shape == (5, 4) and s.dtype == torch.long
    assert torch.equal(s[:, 1:] - s[:, :-1], torch.ones(5, 3, dtype=torch.long))


# --- eval_tokens ------------------------------------------------------------------------------------


def test_eval_tokens_whole_text(tmp_path, capfd):
    tok = make_tokenizer(model_max_length=16)  # the text is far longer: no length warning wanted
    root = make_data_dir(tmp_path / "data", test_text=words(300), crlf=True)
    ids = eval_tokens(tok, "wikitext2", data_dir=root)
    assert ids.shape == (1, 300) and ids.dtype == torch.long
    assert torch.equal(ids[0], torch.arange(300) + 1)
    assert "longer than the specified maximum" not in capfd.readouterr().err


def test_eval_tokens_split_and_local_file(tmp_path):
    tok = make_tokenizer()
    root = make_data_dir(tmp_path / "data", valid_text=words(50))
    assert eval_tokens(tok, "wikitext2", data_dir=root, split="validation").shape == (1, 50)
    p = tmp_path / "eval.txt"
    p.write_text("w3 w4 unknown w5")
    assert eval_tokens(tok, str(p)).tolist() == [[4, 5, 0, 6]]


def test_calibration_samples_with_bos_need_one_text_token(tmp_path):
    from tokenizers import processors

    tok = make_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", NWORDS + 1)]
    )
    tok.add_special_tokens({"bos_token": "[BOS]"})
    assert tok("w1")["input_ids"] == [NWORDS + 1, 2]
    p = tmp_path / "calib.txt"
    p.write_text(words(100))
    s = calibration_samples(tok, str(p), 3, 8, seed=0)
    assert (s[:, 0] == NWORDS + 1).all() and torch.equal(
        s[:, 2:] - s[:, 1:-1], torch.ones(3, 6, dtype=torch.long)
    )
    with pytest.raises(ValueError, match="seqlen must be >= 2"):
        calibration_samples(tok, str(p), 3, 1, seed=0)


def test_c4_from_a_data_folder_joins_the_first_1100_documents(tmp_path):
    import gzip
    import json

    from bitmosaic.data import load_text
    from bitmosaic.errors import DataError

    (tmp_path / "c4").mkdir()
    docs = [{"text": f"doc {i}", "url": "u"} for i in range(1200)]
    with gzip.open(tmp_path / "c4" / "c4-validation.00000-of-00008.json.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(d) + "\n" for d in docs))
    text = load_text("c4", data_dir=tmp_path)
    assert text == " ".join(f"doc {i}" for i in range(1100))
    with pytest.raises(DataError, match="calibrate"):
        load_text("c4", "calib", data_dir=tmp_path)


def test_json_lines_file_gives_its_text_fields_and_bad_lines_are_named(tmp_path):
    import json

    from bitmosaic.data import load_text
    from bitmosaic.errors import DataError

    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps({"text": "a b"}) + "\n\n" + json.dumps({"text": "c"}) + "\n")
    assert load_text(p) == "a b\n\nc"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match="line 2 is not JSON"):
        load_text(bad)
    (tmp_path / "notext.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match="no string field 'text'"):
        load_text(tmp_path / "notext.jsonl")
