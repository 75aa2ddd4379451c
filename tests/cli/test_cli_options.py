"""Configs are the single source of options: every config field has exactly one flag, which
``quantize --help`` lists with its help and default (the README's method table: tests/test_readme.py);
old flag spellings and option names still work, with a warning; the CLI names no method."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from bitmosaic.cli import build_parser, main, method_options
from bitmosaic.cli.method_flags import method_flags
from bitmosaic.errors import OptionError
from bitmosaic.methods import get_method, list_methods
from bitmosaic.methods.options import flag_of, option_spec

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "bitmosaic"


def _help() -> str:
    p = build_parser()
    sub = next(a for a in p._actions if a.dest == "command")
    return sub.choices["quantize"].format_help(full=True)  # --help-all (--help: the common flags)


def _fields():
    for m in list_methods():
        for f in dataclasses.fields(get_method(m).config_cls):
            yield m, f


def test_every_config_field_has_one_flag_that_help_lists():
    text = _help()
    for m, f in _fields():
        spec = option_spec(f)  # raises when a field is not declared with option()
        assert spec.help, f"{m}.{f.name} has no help"
        flag = flag_of(f)
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), (
            f"{flag} ({m}.{f.name}) not in --help"
        )
        if not spec.flag:  # the Python keyword is the flag's name
            assert flag == "--" + f.name.replace("_", "-")


def test_every_quantize_flag_has_help_and_shows_its_default():
    p = build_parser()
    q = next(a for a in p._actions if a.dest == "command").choices["quantize"]
    for a in q._actions:
        if a.help == "==SUPPRESS==" or not a.option_strings or a.dest == "help":
            continue
        assert a.help, f"{a.option_strings} has no help"
    for d in method_flags().values():
        if d.users:
            assert "default" in _help_of(q, d.flag), d.flag


def _help_of(parser, flag: str) -> str:
    return next(a.help for a in parser._actions if flag in a.option_strings)


@pytest.mark.parametrize(
    "old, new, method, field, value",
    [
        (["--budget", "0.2"], ["--budget-frac", "0.2"], "mosaic", "budget_frac", 0.2),
        (["--mosaic-base", "gptq"], ["--solver", "gptq"], "mosaic", "solver", "gptq"),
        (
            ["--sfmp-solver", "gptq", "--bpw", "3"],
            ["--solver", "gptq", "--bpw", "3"],
            "sfmp",
            "solver",
            "gptq",
        ),
        (["--smooth-weights", "gptq"], ["--solver", "gptq"], "smoothquant", "solver", "gptq"),
        (["--pow2-scales"], ["--pow2"], "dpq", "pow2", True),
        (["--fp8-per-channel"], ["--per-channel"], "dpq", "per_channel", True),
        (["--fp8-margin", "1.5"], ["--margin", "1.5"], "dpq", "margin", 1.5),
        (["--ssqr-groups", "dynamic"], ["--groups", "dynamic"], "ssqr", "groups", "dynamic"),
        (["--sq-importance", "paper"], ["--importance", "paper"], "sq-weights", "importance", "paper"),
        (["--sq-act-scale", "bank"], ["--act-scale", "bank"], "sq-acts", "act_scale", "bank"),
    ],
)
def test_old_flags_are_deprecated_aliases(old, new, method, field, value, capsys):
    p = build_parser()
    spec = get_method(method)
    got = method_options(p.parse_args(["quantize", "--method", method, *old]), spec)
    assert "deprecated" in capsys.readouterr().err
    assert got == method_options(p.parse_args(["quantize", "--method", method, *new]), spec)
    assert getattr(spec.make_config(**got), field) == value


def test_one_block_grammar_and_unused_flags_are_one_line_errors(capsys):
    p = build_parser()
    sfmp, mosaic = get_method("sfmp"), get_method("mosaic")
    a = p.parse_args(["quantize", "--method", "sfmp", "--bpw", "3", "--block", "64x256"])
    assert method_options(a, sfmp)["block_rows"] == 64 and method_options(a, sfmp)["block_cols"] == 256
    a = p.parse_args(["quantize", "--method", "mosaic", "--block", "32x16"])
    assert mosaic.make_config(**method_options(a, mosaic)).block == "32x16"
    with pytest.raises(OptionError, match="ROWSxCOLS"):
        method_options(p.parse_args(["quantize", "--method", "mosaic", "--block", "32"]), mosaic)
    assert main(["quantize", "--method", "rtn", "--budget-frac", "0.1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--budget-frac does not apply to method 'rtn'" in err and "mosaic" in err
    assert main(["quantize", "--method", "sfmp", "--avg-bits", "3", "--asym"]) == 2
    assert "--asym does not apply to method 'sfmp'" in capsys.readouterr().err


def test_old_option_names_load_with_a_warning():
    with pytest.warns(FutureWarning, match="'symmetric' is now called 'sym'"):
        cfg = get_method("gptq").make_config(
            symmetric=True, percdamp=0.02, scale_method="minmax", dtype="float64"
        )
    assert (cfg.sym, cfg.damp, cfg.scale, cfg.solver_dtype) == (True, 0.02, "minmax", "float64")
    assert cfg.symmetric and cfg.percdamp == 0.02  # read-only old names for code that reads them
    with pytest.warns(FutureWarning):
        m = get_method("mosaic").make_config(budget=0.2, base="gptq", seed=3)
    assert (m.budget_frac, m.solver, m.selection_seed) == (0.2, "gptq", 3)
    with pytest.raises(OptionError, match="both 'percdamp'"):
        get_method("gptq").make_config(percdamp=0.1, damp=0.1)


def test_methods_command_lists_each_method_with_its_flags(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "--budget-frac" in out and "--avg-bits" in out and "gptq" in out


# the CLI and API files of this layer (cmd_inspect, export and the load path belong to the module kinds)
_NO_METHOD_NAMES = ["cli/__init__.py", "cli/args.py", "cli/method_flags.py", "cli/reproduce.py", "api.py",
                    "io/saved/provenance.py"]  # fmt: skip


@pytest.mark.parametrize("rel", _NO_METHOD_NAMES)
def test_cli_names_no_method(rel):
    names = set(list_methods())
    tree = ast.parse((SRC / rel).read_text())
    bad = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names]
    assert not bad, f"{rel} names methods {bad}"


@pytest.mark.parametrize(("method", "fix"), [("babai", "--method gptq --gguf-type TYPE --order"),
                                             ("awq", "--method gptq --gguf-type TYPE")])  # fmt: skip
def test_gguf_type_is_refused_by_babai_and_awq_in_one_line_with_the_fix(capsys, method, fix):
    assert main(["quantize", "--method", method, "--gguf-type", "Q4_K_M"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--gguf-type does not apply to method '{method}': " in err and fix in err
