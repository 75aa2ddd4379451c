"""Fuzzed parsers of untrusted input (issue 26, section 3): the grammars of ``--sq``/``--block``/
``--scheme``/``--group-size``/``--alpha``/``--max-memory``, recipe mappings and files, safetensors headers
and indexes, a saved model's ``config.json``, and GGUF files (streamed and loaded whole).  Each property
(``benchmarks/fuzz/properties.py``) runs a fixed, derandomized set of cases: any exception other than a
one-line :class:`~bitmosaic.errors.BitmosaicError` fails.  ``python -m benchmarks.fuzz.fuzz_long
--examples N`` runs the same properties much longer."""

import pytest

from benchmarks.fuzz.properties import PROPERTIES, ours, run
from bitmosaic.errors import BitmosaicError


@pytest.mark.parametrize("name", sorted(PROPERTIES))
def test_parser_raises_only_our_one_line_error(name):
    run(name)


def test_the_harness_catches_a_foreign_exception():
    """The checker itself: a parser raising ``KeyError`` (or a two-line message) fails the property."""

    def bad(_):
        raise KeyError("tokens")

    with pytest.raises(KeyError):
        ours(bad, b"")

    def two_lines(_):
        raise BitmosaicError("first\nsecond")

    with pytest.raises(AssertionError, match="not one line"):
        ours(two_lines, b"")


def test_fixed_crashes_stay_fixed(tmp_path):
    """The inputs the fuzzing found, each once a crash with another exception (now one line)."""
    from bitmosaic.formats.sq import parse_sq
    from bitmosaic.io.sources.checkpoint import Checkpoint
    from bitmosaic.methods.options import parse_group_size
    from bitmosaic.pipeline.recipe import load_recipe

    for fn, arg in [(parse_sq, "16-(8/4)-0.5.5"), (parse_group_size, "")]:
        with pytest.raises(BitmosaicError):
            fn(arg)
    (tmp_path / "model.safetensors").write_bytes(b"\x01")  # was safetensors' own "header too small"
    with pytest.raises(BitmosaicError, match="truncated or not a safetensors file"):
        Checkpoint(tmp_path)
    (tmp_path / "r.yaml").write_bytes(b"\x80method: gptq\n")  # was UnicodeDecodeError
    with pytest.raises(BitmosaicError, match="not UTF-8"):
        load_recipe(tmp_path / "r.yaml")
    (tmp_path / "r.yaml").write_bytes(b"[" * 400)  # was RecursionError
    with pytest.raises(BitmosaicError, match="not valid YAML"):
        load_recipe(tmp_path / "r.yaml")
