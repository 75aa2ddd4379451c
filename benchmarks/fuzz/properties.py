"""Fuzz properties of every parser of untrusted input (issue 26, section 3), shared by the test suite
(``tests/fuzz/test_fuzz.py``, a few thousand cases) and the long run (``python -m
benchmarks.fuzz.fuzz_long --examples N``).

The one property: whatever the bytes or text, the parser either accepts them or raises a
:class:`~bitmosaic.errors.BitmosaicError` whose message is one line (what the CLI prints after
``error:`` with exit status 2).  Any other exception -- a ``KeyError``, numpy's "cannot reshape", a
``RecursionError``, an ``OverflowError`` -- is a defect, and hypothesis shrinks it to a small input.

Each entry of :data:`PROPERTIES` is a strategy of inputs (mutated bytes of small valid files written with
``safetensors``/``gguf``, mutated JSON trees, random text near each grammar) and a check that feeds one
input to the parsers.  :func:`run` runs one property for ``examples`` cases, derandomized (the same cases
on every machine and run).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import json
import os
import shutil
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bitmosaic.errors import BitmosaicError

__all__ = ["OUTCOMES", "PROPERTIES", "Property", "run", "ours"]


OUTCOMES: Counter = Counter()  # "<function>: accepted" / "<function>: <ErrorClass>" -> count


def ours(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``; a :class:`BitmosaicError` with a one-line message counts as a refusal
    (returns ``None``); every other exception propagates (the defect the fuzzing looks for).  Each
    outcome is counted in :data:`OUTCOMES`."""
    name = getattr(fn, "__qualname__", str(fn))
    try:
        out = fn(*args, **kwargs)
    except BitmosaicError as e:
        msg = str(e).strip()
        assert msg and "\n" not in msg, f"{type(e).__name__} message is not one line: {msg!r}"
        OUTCOMES[f"{name}: {type(e).__name__}"] += 1
        return None
    OUTCOMES[f"{name}: accepted"] += 1
    return out


@contextlib.contextmanager
def _scratch():
    d = tempfile.mkdtemp(prefix="bitmosaic-fuzz-")
    try:
        yield Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -- strategies ---------------------------------------------------------------------------------------
_INTS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, 0, 1, 2, 3, 4, 8, 9, 16, 17, 32, 64, 2**31, 2**32, 2**53 + 1, 2**63, 2**64]),
)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    _INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        [
            "int",
            "fp8",
            "e4m3",
            "rtn",
            "gptq",
            "W4A8",
            "64x64",
            "16-(8/4)-0.5",
            "float16",
            "uint8",
            "I32",
            "F16",
            "BF16",
            "",
            "none",
            "-1",
            "nan",
        ]
    ),
)
JSON = st.recursive(
    _SCALARS,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
    max_leaves=8,
)


def _paths(tree, prefix=()) -> list[tuple]:
    """Every path (a tuple of keys/indices) into a JSON tree, the root first."""
    out = [prefix]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated_json(draw, tree, under: tuple = ()):
    """``tree`` (a JSON value) with one to three edits at paths below ``under``: a value replaced by
    random JSON, a key deleted, or an unknown key added."""
    import copy

    tree = copy.deepcopy(tree)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(tree) if p[: len(under)] == under]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = tree
        for k in path[:-1]:
            parent = parent[k]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if not path:  # the root itself
            tree = draw(JSON) if action == "replace" else tree
            continue
        key = path[-1]
        if action == "replace":
            parent[key] = draw(JSON)
        elif action == "delete" and isinstance(parent, dict):
            del parent[key]
        elif action == "add" and isinstance(parent[key], dict):
            parent[key][draw(st.text(max_size=8))] = draw(JSON)
    return tree


@st.composite
def mutated_bytes(draw, data: bytes, hot: int):
    """``data`` with one to four edits (truncation, byte overwrites, a random splice, an insertion,
    a little-endian integer overwritten with an extreme value), most of them in its first ``hot``
    bytes (the header, where the parser works)."""
    b = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        if not b:
            break
        span = min(hot, len(b)) if draw(st.integers(0, 4)) else len(b)
        at = draw(st.integers(0, span - 1))
        kind = draw(st.sampled_from(["truncate", "byte", "byte", "int", "int", "splice", "insert"]))
        if kind == "truncate":
            del b[at:]
        elif kind == "byte":
            b[at] = draw(st.integers(0, 255))
        elif kind == "int":
            width = draw(st.sampled_from([4, 8]))
            v = draw(st.sampled_from([0, 1, 2, 7, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1]))
            b[at : at + width] = v.to_bytes(8, "little")[:width]
        elif kind == "splice":
            b[at : at + draw(st.integers(1, 16))] = draw(st.binary(min_size=1, max_size=16))
        else:
            b[at:at] = draw(st.binary(min_size=1, max_size=16))
    return bytes(b)


# -- grammars -----------------------------------------------------------------------------------------
def _near(examples: list[str], alphabet: str):
    """Text near a grammar: its valid examples edited, or random text over its alphabet."""
    pieces = st.text(alphabet=alphabet, max_size=24)
    edited = st.tuples(st.sampled_from(examples), st.integers(0, 30), pieces).map(
        lambda t: t[0][: t[1]] + t[2] + t[0][t[1] :]
    )
    return st.one_of(st.sampled_from(examples), edited, pieces, st.text(max_size=24))


_GRAMMARS = {
    # flag: (methods that take it, valid examples, alphabet of the grammar)
    "--sq": (
        ("sq-weights", "sq-acts"),
        ["16-(8/4)-0.5", "64-(fp8/fp4)-0.875", "8-(4/2)-0"],
        "0123456789-()/.fpFP e",
    ),
    "--block": (("mosaic", "sfmp"), ["64x64", "512x128", "1x1"], "0123456789xX -+e."),
    "--scheme": (
        ("rtn", "gptq", "mosaic"),
        ["W4A8", "W4A16", "W8A8-FP8", "W4A4-FP4", "W4A8-E5M2"],
        "WA0123456789-FPEM wa_",
    ),
    "--group-size": (("rtn", "gptq"), ["128", "-1", "32"], "0123456789-+ e."),
    "--alpha": (("smoothquant", "awq"), ["0.5", "search", "1"], "0123456789.-e+ nainfsearch"),
    "--alpha-grid": (("smoothquant",), ["0.3,0.5,0.7", "0.5"], "0123456789.,-e+ nainf"),
    "--max-memory": (("gptq",), ["8GB", "512MB", "1.5T", "64GiB", "auto"], "0123456789.KMGTiBkmgtb -e+"),
    "--bits": (("gptq",), ["4", "3", "8"], "0123456789-+ ."),
}


def grammar_strategy():
    return st.sampled_from(sorted(_GRAMMARS)).flatmap(
        lambda flag: st.tuples(
            st.just(flag), st.sampled_from(_GRAMMARS[flag][0]), _near(_GRAMMARS[flag][1], _GRAMMARS[flag][2])
        )
    )


def check_grammar(case) -> None:
    """One flag's text through the parsers: the function itself, then the CLI's path up to the model
    load (argparse, the method's flags, the one-entry recipe and its config)."""
    from bitmosaic.algorithms.mosaic import parse_block as mosaic_block
    from bitmosaic.cli import build_parser
    from bitmosaic.cli.quantize import recipe_from_args
    from bitmosaic.formats.act import normalize_fmt, parse_scheme
    from bitmosaic.formats.sq import parse_sq
    from bitmosaic.methods.options import parse_alpha, parse_block, parse_floats, parse_group_size
    from bitmosaic.pipeline.spill import parse_size

    flag, method, text = case
    direct = {
        "--sq": [parse_sq],
        "--block": [parse_block, mosaic_block],
        "--scheme": [parse_scheme],
        "--group-size": [parse_group_size],
        "--alpha": [parse_alpha],
        "--alpha-grid": [parse_floats],
        "--max-memory": [parse_size],
        "--bits": [],
    }[flag]
    for fn in direct:
        ours(fn, text)
    ours(normalize_fmt, text)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = build_parser().parse_args(["quantize", "--method", method, f"{flag}={text}"])
    except SystemExit:  # argparse's own refusal of a typed flag (usage + exit 2)
        return
    if flag == "--max-memory":
        return
    recipe = ours(recipe_from_args, args)
    if recipe is not None:
        ours(recipe.default)


# -- recipes ------------------------------------------------------------------------------------------
_RECIPE = {
    "method": "gptq",
    "scheme": "W4A16",
    "settings": {"bits": 4, "group_size": 128, "order": "act"},
    "overrides": [
        {"match": "mlp\\.down_proj$", "settings": {"bits": 8}},
        {"match": "layers\\.0\\.self_attn", "method": "rtn", "settings": {"bits": 8, "group_size": -1}},
    ],
    "skip": ["layers\\.1\\.mlp\\.gate_proj"],
}


def recipe_strategy():
    return st.one_of(mutated_json(_RECIPE), JSON)


def check_recipe(d) -> None:
    from bitmosaic.pipeline.recipe import Recipe

    recipe = ours(Recipe.from_dict, d)
    if recipe is not None:
        names = [
            f"model.layers.{i}.{n}"
            for i in range(2)
            for n in ("self_attn.q_proj", "mlp.down_proj", "mlp.gate_proj")
        ]
        resolve = ours(recipe.resolver, names)
        if resolve is not None:
            for n in names:
                resolve(n)


def recipe_file_strategy():
    as_text = mutated_json(_RECIPE).map(lambda d: json.dumps(d).encode())
    yaml_text = st.sampled_from(
        [
            b"method: gptq\nsettings: {bits: 4}\n",
            b"- a\n- [b, {c: d}]\n",
            b"method: &a [*a]\n",
            b"a: !!python/object/apply:os.system ['true']\n",
            b"[" * 400,
            b"{a: " * 300,
            b"method: gptq\nsettings: !!binary aGVsbG8=\n",
        ]
    )
    raw = st.one_of(as_text, yaml_text, st.binary(max_size=64))
    data = raw.flatmap(lambda b: st.one_of(st.just(b), mutated_bytes(b, len(b) or 1)))
    return st.tuples(data, st.sampled_from([".json", ".yaml", ".yml", ".txt"]))


def check_recipe_file(case) -> None:
    from bitmosaic.pipeline.recipe import load_recipe

    data, suffix = case
    with _scratch() as d:
        f = d / f"recipe{suffix}"
        f.write_bytes(data)
        ours(load_recipe, f)


# -- safetensors headers ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _safetensors_bytes() -> bytes:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    sd = {
        "a.qweight": torch.randint(0, 2**31 - 1, (4, 8), dtype=torch.int32, generator=g),
        "a.scales": torch.randn(4, 2, generator=g).half(),
        "b.weight": torch.randn(3, 5, generator=g),
        "c.bias": torch.zeros(0),
        "d.codes": torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g),
    }
    with _scratch() as d:
        save_file(sd, str(d / "x.safetensors"), metadata={"format": "pt", "bitmosaic_format_version": "1"})
        return (d / "x.safetensors").read_bytes()


@st.composite
def _header_mutated(draw):
    """The valid file with its JSON header edited (re-encoded with a correct length prefix, so that
    the edit reaches the header's validation), the tensor bytes kept, perhaps cut."""
    data = _safetensors_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    new = json.dumps(draw(mutated_json(header))).encode()
    body = data[8 + n :]
    if draw(st.booleans()):
        body = body[: draw(st.integers(0, len(body)))]
    return len(new).to_bytes(8, "little") + new + body


_SHARD = "model-00001-of-00001.safetensors"


def safetensors_strategy():
    """``(file bytes, None)``: one ``model.safetensors`` mutated; or ``(valid bytes, index)``: one shard
    and a mutated ``model.safetensors.index.json`` (names with folder parts, ``..``, non-strings)."""
    data = _safetensors_bytes()
    hot = 8 + int.from_bytes(data[:8], "little")
    n = int.from_bytes(data[:8], "little")
    keys = [k for k in json.loads(data[8 : 8 + n]) if k != "__metadata__"]
    index = {"metadata": {"total_size": len(data)}, "weight_map": dict.fromkeys(keys, _SHARD)}
    evil = st.sampled_from(["../x.safetensors", "/etc/passwd", "..", ".", "", "a/b.safetensors", "..\\x"])
    index_cases = st.one_of(
        mutated_json(index, ("weight_map",)),
        st.tuples(st.sampled_from(keys), evil).map(
            lambda kv: {**index, "weight_map": {**index["weight_map"], kv[0]: kv[1]}}
        ),
    )
    return st.one_of(
        st.tuples(st.one_of(mutated_bytes(data, hot), _header_mutated()), st.none()),
        st.tuples(st.just(data), index_cases),
    )


def check_safetensors(case) -> None:
    """The header readers of a saved folder and of a float checkpoint, and the full read."""
    from bitmosaic.io.saved.load import (
        _load_safetensors,
        stored_module_bits,
        stored_tensors,
        stored_tensors_of_file,
    )
    from bitmosaic.io.sources.checkpoint import Checkpoint

    data, index = case
    with _scratch() as d:
        f = d / ("model.safetensors" if index is None else _SHARD)
        f.write_bytes(data)
        if index is not None:
            (d / "model.safetensors.index.json").write_text(json.dumps(index))
        ours(stored_tensors_of_file, f)
        ours(stored_tensors, d)
        ours(stored_module_bits, d, ["a", "b", "c", "d"])
        ours(_load_safetensors, f)
        ckpt = ours(Checkpoint, d)
        if ckpt is not None:
            for k in ckpt.keys():
                ours(ckpt.get, k)


# -- a saved model's config.json ----------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _saved_model() -> Path:
    """A tiny saved bitmosaic folder (RTN w4 g32), made once per process."""
    from bitmosaic.testing import quantized_dir

    root = Path(tempfile.mkdtemp(prefix="bitmosaic-fuzz-saved-"))
    atexit.register(shutil.rmtree, root, True)  # once per process: it is reused by every case
    return quantized_dir(root / "m", tokenizer=False)


def saved_config_strategy():
    cfg = json.loads((_saved_model() / "config.json").read_text())
    # the quantization_config and its per-layer table, and the model keys a skeleton is built from
    return st.one_of(
        mutated_json(cfg, ("quantization_config",)),
        mutated_json(cfg, ("quantization_config", "modules")),
        mutated_json({k: cfg[k] for k in cfg}, ()).filter(lambda c: isinstance(c, dict)),
        st.binary(max_size=64).map(lambda b: {"__raw__": b.hex()}),
    )


def check_saved_config(cfg) -> None:
    from bitmosaic.io.saved.load import read_quant_config, verify_saved

    src = _saved_model()
    with _scratch() as d:
        if isinstance(cfg, dict) and set(cfg) == {"__raw__"}:
            (d / "config.json").write_bytes(bytes.fromhex(cfg["__raw__"]))
        else:
            (d / "config.json").write_text(json.dumps(cfg))
        os.symlink(src / "model.safetensors", d / "model.safetensors")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours(read_quant_config, d)
            ours(verify_saved, d)


# -- GGUF files ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _gguf_bytes() -> tuple[bytes, int]:
    """A tiny Llama GGUF (one layer, mixed tensor types, a whole tokenizer, so the unmutated file loads
    in both loaders) and where its tensor data starts."""
    from gguf import GGUFReader

    from bitmosaic.testing import tiny_gguf

    with _scratch() as d:
        path = tiny_gguf(d / "tiny.gguf", "llama", layers=1, vocab="llama")
        start = min(int(t.data_offset) for t in GGUFReader(os.fspath(path)).tensors)
        return path.read_bytes(), start


def gguf_strategy():
    data, start = _gguf_bytes()
    return mutated_bytes(data, start)


def check_gguf(data: bytes) -> None:
    """The tensor-by-tensor reader (streaming), every tensor read."""
    from bitmosaic.io.sources.gguf_checkpoint import GGUFCheckpoint

    with _scratch() as d:
        f = d / "model.gguf"
        f.write_bytes(data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt = ours(GGUFCheckpoint, f)
            if ckpt is not None:
                for k in ckpt.keys():
                    ours(ckpt.get, k)


def check_gguf_load(data: bytes) -> None:
    """The whole-model loader (transformers' GGUF conversion, no converted copy kept)."""
    from bitmosaic.io import load_model

    with _scratch() as d, _env(BITMOSAIC_GGUF_CACHE="0"):
        f = d / "model.gguf"
        f.write_bytes(data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours(load_model, f"gguf:{f}")


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- the registry -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Property:
    strategy: Callable  # () -> a hypothesis strategy
    check: Callable  # one input -> None (raises on a defect)
    examples: int  # the test suite's number of cases
    what: str


PROPERTIES: dict[str, Property] = {
    "grammars": Property(
        grammar_strategy,
        check_grammar,
        1500,
        "--sq/--block/--scheme/--group-size/--alpha/--alpha-grid/--max-memory/--bits",
    ),
    "recipe": Property(recipe_strategy, check_recipe, 1000, "recipe mappings (Recipe.from_dict)"),
    "recipe_file": Property(recipe_file_strategy, check_recipe_file, 100, "recipe files (YAML/JSON bytes)"),
    "safetensors": Property(safetensors_strategy, check_safetensors, 200, "safetensors headers and reads"),
    "saved_config": Property(
        saved_config_strategy,
        check_saved_config,
        30,
        "a saved model's config.json (read_quant_config, verify_saved)",
    ),
    "gguf": Property(gguf_strategy, check_gguf, 50, "GGUF files read tensor by tensor (streaming)"),
    "gguf_load": Property(gguf_strategy, check_gguf_load, 8, "GGUF files loaded whole (transformers)"),
}


def run(name: str, examples: int | None = None, seed: int | None = None) -> None:
    """Run property ``name`` for ``examples`` cases (default: the test suite's); derandomized unless a
    ``seed`` is given.  Raises the first defect found (shrunk by hypothesis)."""
    prop = PROPERTIES[name]
    cfg = settings(
        max_examples=examples or prop.examples,
        deadline=None,
        derandomize=seed is None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    test = cfg(given(prop.strategy())(prop.check))
    if seed is not None:
        from hypothesis import seed as hseed

        test = hseed(seed)(test)
    test()
