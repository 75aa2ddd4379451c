"""``quantize --help`` is short (the common flags and the default method's); every other flag still
parses and ``--help-all`` shows it; ``bitmosaic methods NAME`` (= ``quantize --help-method NAME``) lists
one method's every option with its help, default and range; a bad NAME is one line and exit code 2
(issue 70, item 5)."""

from __future__ import annotations

import re

import pytest

from bitmosaic.cli import build_parser, main
from bitmosaic.cli.method_flags import method_help
from bitmosaic.methods import DEFAULT_METHOD, get_method, list_methods
from bitmosaic.methods.options import config_options, flag_of, option_spec, used_options

SHORT_HELP_MAX = 150


def _quantize_parser():
    p = build_parser()
    return next(a for a in p._actions if a.dest == "command").choices["quantize"]


def _run(capsys, argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.mark.parametrize("columns", ["80", "100"])
def test_quantize_help_is_short_and_help_all_is_complete(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", columns)
    rc, short, _ = _run(capsys, ["quantize", "--help"])
    assert rc == 0 and len(short.splitlines()) <= SHORT_HELP_MAX, len(short.splitlines())
    rc, full, _ = _run(capsys, ["quantize", "--help-all"])
    assert rc == 0 and len(full.splitlines()) > len(short.splitlines())
    for word in ("--model", "--method", "--out", "--eval", "--bits", "--group-size", "--abits",
                 "--help-all", "--help-method"):  # fmt: skip
        assert word in short, word
    q = _quantize_parser()
    for a in q._actions:
        if not a.option_strings or a.help == "==SUPPRESS==":
            continue
        assert a.option_strings[0] in full, a.option_strings
        if getattr(a, "rare", False):
            shown = re.search(rf"^  {re.escape(a.option_strings[0])}(?![\w-])", short, re.MULTILINE)
            assert not shown, f"{a.option_strings[0]} is rare but shown"


def test_the_short_help_holds_every_flag_of_the_default_method(capsys):
    _, short, _ = _run(capsys, ["quantize", "--help"])
    for f in used_options(get_method(DEFAULT_METHOD).config_cls).values():
        if not option_spec(f).shared:
            assert f"  {flag_of(f)}" in short, flag_of(f)


def test_every_hidden_flag_still_parses():
    q = _quantize_parser()
    hidden = [a for a in q._actions if getattr(a, "rare", False)]
    assert len(hidden) > 40  # the method-specific flags and the rare general ones
    for a in hidden:
        for s in a.option_strings:
            value = [] if a.nargs == 0 else [str(a.choices[0]) if a.choices else "1"]
            args = build_parser().parse_args(["quantize", s, *value])
            assert getattr(args, a.dest) is not None, s


@pytest.mark.parametrize("name", list_methods())
def test_methods_name_lists_every_option_of_the_method(capsys, name):
    assert main(["methods", name]) == 0
    out = capsys.readouterr().out
    assert out.rstrip("\n") == method_help(name)
    cls = get_method(name).config_cls
    taken, _, refused = out.partition("\ndoes not take:\n")
    assert taken.startswith(f"{name}: {get_method(name).description}")
    for f in used_options(cls).values():
        spec = option_spec(f)
        flag = "--scheme" if spec.shared else flag_of(f)
        assert f"  {flag}" in taken, f"{name}: {flag} ({f.name}) missing"
        if not spec.shared:
            assert spec.help.split()[0] in taken
            if spec.range or spec.choices:
                assert ("range: [" if spec.range and not spec.choices else "choices: ") in taken
    flags = {flag_of(f) for f in used_options(cls).values() if not option_spec(f).shared}
    assert " ".join(taken.split()).count("default: ") >= len(flags)
    for n in getattr(cls, "unused", {}):
        f = config_options(cls)[n]
        assert ("--scheme/" if option_spec(f).shared else flag_of(f) + ":") in refused, n
    # --help-method is the same text
    rc, same, _ = _run(capsys, ["quantize", "--help-method", name])
    assert rc == 0 and same.rstrip("\n") == method_help(name)


def test_a_bad_method_name_is_one_line_and_exit_2(capsys):
    assert main(["methods", "no-such-method"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown method 'no-such-method'" in err and "gptq" in err
    rc, _, err = _run(capsys, ["quantize", "--help-method", "no-such-method"])
    assert rc == 2 and err.count("\n") == 1 and "unknown method 'no-such-method'" in err
