"""Text sources for calibration and evaluation.

Where the text comes from, in this order:

1. an explicit ``data_dir`` argument (the CLI's ``--data-dir``),
2. the environment variable ``BITMOSAIC_DATA``,
3. the Hugging Face ``datasets`` hub (optional dependency ``bitmosaic[hub]``; needs network or a warm cache).

A data folder has the layout of the project's shared data::

    wikitext-2-raw/wiki.test.raw   WikiText-2 raw, test split         -> load_text("wikitext2", "test")
    wikitext-2/valid.txt           WikiText-2 (tokenized), valid split -> load_text("wikitext2", "calib")
    c4/c4-validation.00000-of-00008.json.gz   C4 (en) validation shard 0  -> load_text("c4")
    SHA256SUMS                     optional; checked when present (mismatch -> warning)

C4.  ``"c4"`` follows the GPTQ reference evaluation (``c4-new``): the first 1100 documents of the English
validation shard 0, their ``text`` joined with a space, tokenized once and cut into the same
non-overlapping windows as WikiText-2 (GPTQ keeps the first 256 windows: ``--max-windows 256``).  The
shard comes from the data folder (``.json.gz`` or ``.json``, one JSON object a line) or else from the hub
(``allenai/c4``, that file).  Any local JSON lines file (``*.jsonl``, ``*.jsonl.gz``, ``*.json.gz``) works
too: the ``text`` field of every line, joined with ``"\n\n"``.

Newlines.  Every text file is read as UTF-8 in Python's text mode, so ``\\r\\n`` becomes ``\\n``
(universal newlines); nothing else is changed.  The shared ``wiki.test.raw`` has Windows line endings and
apparently one line per non-empty row of the ``wikitext-2-raw-v1`` test split; read this way it
reproduces the reference perplexity of the shared README (SmolLM2-135M, first 40 x 512 tokens: 28.74;
keeping the ``\\r`` bytes would give 28.62).

Hub fallback.  ``load_dataset("wikitext", "wikitext-2-raw-v1", split=...)``.  The rows are joined the way
the shared file is laid out: the non-empty rows (each ends in ``"\\n"``) concatenated as they are
(``"".join``), meant to give the same text as the file for the test split (not checked offline).  The GPTQ
reference code instead joins *all* rows with ``"\\n\\n"``, which inserts extra blank lines and gives
slightly different perplexities (not comparable with the reference numbers).  Split ``"test"`` uses the
hub's ``test``, ``"validation"`` its ``validation`` and ``"calib"`` its ``train`` split (as GPTQ does; the
data-folder route calibrates on ``valid.txt``, which is disjoint from the test split too).

Tokenization (both :func:`calibration_samples` and :func:`eval_tokens`) follows the GPTQ reference
protocol: the whole text is tokenized once (``tokenizer(text, return_tensors="pt")``), then windowed.

BOS.  Models whose tokenizer adds a BOS token by default (the Gemma family, Llama 2/3, ...) were
trained with every sequence starting at BOS, and a window without one is out of distribution (a
Gemma model's perplexity comes out about 2.5x too high).  For those tokenizers (:func:`bos_token_id`
says which) the text is tokenized *without* special tokens and every window -- each calibration
sample, and each perplexity window (:func:`bitmosaic.eval.perplexity` with ``bos_token_id``) -- is
``[BOS] + (seqlen - 1)`` text tokens, as lm-eval-harness's rolling log-likelihood prefixes each window
with the prefix token; the BOS position is never scored.  Tokenizers that add no BOS (SmolLM2, GPT-2
style) keep the plain protocol and the same numbers as before.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import torch

from .errors import DataError

__all__ = [
    "resolve_data_dir",
    "load_text",
    "calibration_samples",
    "eval_tokens",
    "bos_token_id",
    "ENV_VAR",
    "DataError",
]

ENV_VAR = "BITMOSAIC_DATA"

_WIKITEXT2_NAMES = {"wikitext2", "wikitext-2"}
# split -> path of the file inside the data folder
_WIKITEXT2_FILES = {
    "test": "wikitext-2-raw/wiki.test.raw",
    "validation": "wikitext-2/valid.txt",
    "calib": "wikitext-2/valid.txt",
}
# split -> split of the hub dataset wikitext-2-raw-v1
_WIKITEXT2_HUB_SPLITS = {"test": "test", "validation": "validation", "calib": "train"}

_C4_FILE = "en/c4-validation.00000-of-00008.json.gz"
_C4_LOCAL = ("c4/c4-validation.00000-of-00008.json.gz", "c4/c4-validation.00000-of-00008.json")
_C4_DOCS = 1100
_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz")

_HINT = f"pass --data-dir (data_dir=...) or set {ENV_VAR} to a folder holding the data"

_verified: set[tuple[str, int, int]] = set()


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path | None:
    """The data folder: ``data_dir`` if given, else ``$BITMOSAIC_DATA`` if set (non-empty), else ``None``.

    Raises ``FileNotFoundError`` when the chosen folder does not exist (or is not a folder).
    """
    if data_dir is not None and str(data_dir) != "":
        origin = "data_dir"
        path = Path(data_dir)
    else:
        env = os.environ.get(ENV_VAR, "")
        if not env:
            return None
        origin = f"${ENV_VAR}"
        path = Path(env)
    path = path.expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"data folder {str(path)!r} (from {origin}) does not exist or is not a folder"
        )
    return path


def _read_text_file(path: Path) -> str:
    if not path.is_file():
        raise FileNotFoundError(f"text file {str(path)!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:  # text mode: universal newlines (\r\n -> \n)
            text = f.read()
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    if not text.strip():
        raise ValueError(f"text file {str(path)!r} is empty")
    return text


def _not_utf8(path: Path) -> DataError:
    """The one-line error for a text file that is not UTF-8, naming the file and the first bad byte."""
    import gzip

    try:
        raw = gzip.open(path).read() if path.name.endswith(".gz") else path.read_bytes()
        raw.decode("utf-8")
        where = ""
    except UnicodeDecodeError as e:
        where = f" (byte 0x{raw[e.start]:02x} at offset {e.start})"
    except OSError:
        where = ""
    return DataError(
        f"text file {str(path)!r} is not UTF-8 text{where}; convert it to UTF-8 "
        "(e.g. iconv -f latin1 -t utf-8)"
    )


def _check_sha256(root: Path, rel: str) -> None:
    """Compare ``root/rel`` with its line in ``root/SHA256SUMS`` (if both exist); warn on a mismatch."""
    sums = root / "SHA256SUMS"
    path = root / rel
    if not sums.is_file():
        return
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _verified:
        return
    expected = None
    for line in sums.read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split(maxsplit=1)
        if len(parts) == 2 and parts[1].lstrip("*").strip() == rel:
            expected = parts[0].lower()
            break
    if expected is None:
        return
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    if actual != expected:
        warnings.warn(
            f"{str(path)!r}: SHA256 {actual} does not match {expected} listed in {str(sums)!r}; "
            "results may not be comparable with the reference numbers",
            stacklevel=3,
        )
    else:
        _verified.add(key)


def _load_wikitext2_hub(split: str) -> str:
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            "no data folder given and the Hugging Face 'datasets' package is not installed "
            f"(pip install 'bitmosaic[hub]'); {_HINT}"
        ) from e
    hub_split = _WIKITEXT2_HUB_SPLITS[split]
    try:
        ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=hub_split)
    except Exception as e:  # offline, no cache, hub errors: all mean "no data"
        raise DataError(
            f"could not load wikitext-2-raw-v1 ({hub_split}) from the Hugging Face hub "
            f"({type(e).__name__}: {e}); {_HINT}"
        ) from e
    # Same text as the data-folder file: non-empty rows (each ends in "\n") joined as they are.
    text = "".join(row for row in ds["text"] if row).replace("\r\n", "\n")
    if not text.strip():
        raise ValueError(f"wikitext-2-raw-v1 ({hub_split}) from the hub is empty")
    return text


def _json_lines_texts(path: Path, limit: int | None = None) -> list[str]:
    """The ``text`` field of each line of a JSON lines file (gzip when the name ends in ``.gz``)."""
    import gzip
    import json

    opener = gzip.open if path.name.endswith(".gz") else open
    texts: list[str] = []
    with opener(path, "rt", encoding="utf-8") as f:
        lines = iter(f)
        n = 0
        while True:
            try:
                line = next(lines)
            except StopIteration:
                break
            except UnicodeDecodeError:
                raise _not_utf8(path) from None
            n += 1
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise DataError(f"{path}: line {n} is not JSON; expected one JSON object a line") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise DataError(f"{path}: line {n} has no string field 'text'")
            texts.append(row["text"])
            if limit is not None and len(texts) >= limit:
                break
    if not texts:
        raise DataError(f"{path} holds no JSON line with a 'text' field")
    return texts


def _load_c4(data_dir) -> str:
    root = resolve_data_dir(data_dir)
    if root is not None:
        for rel in _C4_LOCAL:
            if (root / rel).is_file():
                return " ".join(_json_lines_texts(root / rel, _C4_DOCS))
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            f"C4: no {_C4_LOCAL[0]} in the data folder and the 'datasets' package is not installed "
            f"(pip install 'bitmosaic[hub]'); {_HINT}"
        ) from e
    try:
        ds = datasets.load_dataset("allenai/c4", data_files={"validation": _C4_FILE}, split="validation")
    except Exception as e:  # offline, no cache, hub errors: all mean "no data"
        raise DataError(
            f"could not load C4 ({_C4_FILE}) from the hub ({type(e).__name__}); put the shard at "
            f"<data folder>/{_C4_LOCAL[0]} and {_HINT}"
        ) from e
    return " ".join(ds[:_C4_DOCS]["text"])


def load_text(
    source: str | os.PathLike, split: str = "test", data_dir: str | os.PathLike | None = None
) -> str:
    """The text of ``source``.

    ``source`` is ``"wikitext2"`` (alias ``"wikitext-2"``) or the path of a local UTF-8 text file (``split``
    is then ignored).  For wikitext2, ``split`` is ``"test"`` (raw test split), or ``"calib"`` /
    ``"validation"`` (the validation split); see the module docstring for files, hub fallback and newlines.
    ``"c4"`` is GPTQ's C4 evaluation text, and a JSON lines file gives its ``text`` fields (module doc).
    """
    name = os.fspath(source)
    if name.lower() == "c4":
        if split == "calib":  # the evaluation documents must not calibrate the model
            raise DataError(
                "C4 here is the evaluation text (validation shard 0); calibrate on wikitext2 or on a "
                "text / JSON lines file of C4 training documents"
            )
        return _load_c4(data_dir)
    if name.lower() in _WIKITEXT2_NAMES:
        if split not in _WIKITEXT2_FILES:
            raise ValueError(
                f"unknown split {split!r} for wikitext2; choose one of {sorted(_WIKITEXT2_FILES)}"
            )
        root = resolve_data_dir(data_dir)
        if root is None:
            return _load_wikitext2_hub(split)
        rel = _WIKITEXT2_FILES[split]
        path = root / rel
        if not path.is_file():
            raise FileNotFoundError(
                f"wikitext2 {split!r} split: expected {str(path)!r} in data folder {str(root)!r}"
            )
        _check_sha256(root, rel)
        return _read_text_file(path)
    path = Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"text source {name!r} is neither a known dataset ('wikitext2', 'c4') nor an existing file"
        )
    if path.name.endswith(_JSONL_SUFFIXES):
        return "\n\n".join(_json_lines_texts(path))
    return _read_text_file(path)


def bos_token_id(tokenizer) -> int | None:
    """The BOS id when ``tokenizer`` adds a BOS by default (checked by encoding a short text), else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    try:
        ids = tokenizer("a")["input_ids"]
    except Exception:  # a tokenizer that cannot encode a plain text has no default BOS to honour
        return None
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return int(bos) if ids and ids[0] == bos else None


def _tokenize(tokenizer, text: str) -> torch.Tensor:
    """The whole text tokenized once (GPTQ protocol): LongTensor ``[1, N]``; without special tokens
    when the tokenizer adds a BOS (the windows get their own, see the module doc)."""
    kwargs = {"return_tensors": "pt"}
    if bos_token_id(tokenizer) is not None:
        kwargs["add_special_tokens"] = False
    try:
        from transformers import PreTrainedTokenizerBase

        if isinstance(tokenizer, PreTrainedTokenizerBase):
            kwargs["verbose"] = False  # no "sequence longer than model_max_length" warning: we window it
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    enc = tokenizer(text, **kwargs)
    ids = enc["input_ids"]
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(ids)
    ids = ids.to(torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"tokenizer returned input_ids of shape {tuple(ids.shape)}, expected [1, N]")
    return ids


def calibration_samples(
    tokenizer,
    source: str | os.PathLike,
    nsamples: int,
    seqlen: int,
    seed: int,
    data_dir: str | os.PathLike | None = None,
) -> torch.Tensor:
    """``nsamples`` random windows of ``seqlen`` calibration tokens: LongTensor ``[nsamples, seqlen]``.

    GPTQ reference protocol: the text (``load_text(source, "calib")``) is tokenized once; each window starts
    at a uniform random offset in ``[0, N - seqlen - 1]`` (windows may overlap), drawn from a
    ``torch.Generator`` seeded with ``seed`` -- the same seed gives identical samples.  For a tokenizer
    that adds a BOS, each sample is BOS + ``seqlen - 1`` text tokens (module doc), so ``seqlen >= 2``.

    Raises :class:`~bitmosaic.errors.DataError` when the text cannot be had (no data folder, no hub).
    """
    if nsamples < 1:
        raise ValueError(f"nsamples must be >= 1, got {nsamples}")
    if seqlen < 1:
        raise ValueError(f"seqlen must be >= 1, got {seqlen}")
    ids = _tokenize(tokenizer, load_text(source, "calib", data_dir=data_dir))[0]
    bos = bos_token_id(tokenizer)
    if bos is not None:
        if seqlen < 2:
            raise ValueError(f"seqlen must be >= 2 with a BOS-adding tokenizer (BOS + text), got {seqlen}")
        seqlen -= 1  # text tokens per sample
    n = ids.numel()
    if n < seqlen + 1:
        need = f"seqlen + 1 = {seqlen + 1}" if bos is None else f"seqlen = {seqlen + 1} (BOS + {seqlen})"
        raise ValueError(f"calibration text {os.fspath(source)!r} has {n} tokens; need at least {need}")
    gen = torch.Generator().manual_seed(int(seed))
    starts = torch.randint(0, n - seqlen, (nsamples,), generator=gen)
    offsets = torch.arange(seqlen)
    out = ids[starts[:, None] + offsets[None, :]]
    if bos is not None:
        out = torch.cat([torch.full((nsamples, 1), bos, dtype=out.dtype), out], dim=1)
    return out.contiguous()


def eval_tokens(
    tokenizer, source: str | os.PathLike, data_dir: str | os.PathLike | None = None, split: str = "test"
) -> torch.Tensor:
    """The whole evaluation text, tokenized once (no truncation): ``[1, N]``; default special tokens,
    except for a tokenizer that adds a BOS: then the text tokens alone (no BOS, see the module doc).

    Feed it to :func:`bitmosaic.eval.perplexity`, which cuts it into non-overlapping windows (pass
    ``bos_token_id=bos_token_id(tokenizer)`` so BOS-trained models see one per window).
    """
    return _tokenize(tokenizer, load_text(source, split, data_dir=data_dir))
