"""CLI behaviour that needs no model download."""

import pytest

from bitmosaic.cli import build_parser, main


def test_cli_rejects_bad_model(capsys):
    assert main(["eval", "/no/such/model"]) == 2
    assert "cannot load model" in capsys.readouterr().err


def test_cli_inspect_rejects_non_model_dir(tmp_path):
    with pytest.raises(SystemExit, match="no config.json"):
        main(["inspect", str(tmp_path)])


def test_cli_methods_lists_registry(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "gptq" in out and "babai" in out and "rtn" in out


def test_cli_group_size_and_flags_parse():
    a = build_parser().parse_args(
        [
            "quantize",
            "--method",
            "gptq",
            "--wbits",
            "3",
            "--group-size",
            "-1",
            "--sym",
            "--order",
            "min-pivot",
            "--direction",
            "back",
            "--no-clip",
            "--scale",
            "mse",
        ]
    )
    assert a.bits == 3 and a.group_size == -1 and a.symmetric and a.no_clip and a.scale_method == "mse"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["quantize", "--order", "random"])


def test_cli_unknown_method_is_a_clear_error(capsys):
    assert main(["quantize", "--method", "nope"]) == 2
    assert "unknown method" in capsys.readouterr().err
