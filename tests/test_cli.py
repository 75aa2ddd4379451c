"""CLI behaviour that needs no model download."""

import pytest

from bitmosaic.cli import build_parser, main


def test_cli_rejects_bad_model(capsys):
    assert main(["eval", "/no/such/model"]) == 2
    assert "cannot load model" in capsys.readouterr().err


def test_cli_inspect_rejects_non_model_dir(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no config.json" in err and err.count("\n") == 1


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
    assert a.bits == 3 and a.group_size == -1 and a.sym and a.clip is False and a.scale == "mse"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["quantize", "--order", "random"])


def test_cli_unknown_method_is_a_clear_error(capsys):
    assert main(["quantize", "--method", "nope"]) == 2
    assert "unknown method" in capsys.readouterr().err


def test_cli_lattice_options_reach_the_method_config():
    from bitmosaic.cli import method_options
    from bitmosaic.methods import get_method

    p = build_parser()
    a = p.parse_args(
        ["quantize", "--method", "ssqr", "--bits", "3", "--group-size", "128", "--outlier-rate", "0.02"]
    )
    cfg = get_method("ssqr").make_config(**method_options(a, get_method("ssqr")))
    assert cfg.outlier_rate == 0.02 and cfg.bits == 3 and cfg.group_size == 128 and cfg.order == "act"
    a = p.parse_args(["quantize", "--method", "hptq", "--target-bits", "3.125", "--scale-per", "row"])
    cfg = get_method("hptq").make_config(**method_options(a, get_method("hptq")))
    assert cfg.target_bits == 3.125 and cfg.scale_per == "row" and cfg.group_size is None
    a = p.parse_args(["quantize", "--method", "rtn", "--outlier-rate", "0.02"])
    with pytest.raises(ValueError, match="does not apply"):
        method_options(a, get_method("rtn"))
