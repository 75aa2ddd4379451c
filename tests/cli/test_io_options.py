"""Options a method would silently ignore are errors, in the config classes (Python API) and in the CLI,
which checks only the flags the user gave."""

from __future__ import annotations

import pytest
import torch

from bitmosaic import quantize_
from bitmosaic.cli import build_parser, main, method_options
from bitmosaic.errors import BitmosaicError, OptionError
from bitmosaic.methods import get_method
from bitmosaic.methods.awq import AWQConfig
from bitmosaic.methods.hptq import EntropyConfig
from bitmosaic.methods.ssqr import SSQRConfig
from tests.helpers import tiny_llama


def _config(argv: list[str]):
    args = build_parser().parse_args(["quantize", *argv])
    spec = get_method(args.method)
    return spec.make_config(**method_options(args, spec))


def _cli_error(capsys, argv: list[str]) -> str:
    assert main(["quantize", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


# --- config classes ---------------------------------------------------------------------------------


def test_ssqr_refuses_minmax_scales():
    with pytest.raises(OptionError, match="ssqr.*scale='minmax'.*MSE"):
        SSQRConfig(scale="minmax")
    assert SSQRConfig(scale="mse").scale == "mse"
    with pytest.raises(OptionError, match="minmax"):
        get_method("ssqr").make_config(scale="minmax")


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"bits": 3}, "bits=3"),
        ({"group_size": 64}, "group_size=64"),
        ({"sym": True}, "sym=True"),
        ({"scale": "mse"}, "scale='mse'"),
        ({"symmetric": True}, "sym=True"),  # the old names still load (with a warning)
    ],
)
def test_entropy_methods_refuse_unused_options(kwargs, needle):
    with pytest.raises(OptionError, match=needle):
        EntropyConfig(**kwargs)
    for m in ("hptq", "hrtn"):
        with pytest.raises(OptionError, match="target_bits|scale"):
            get_method(m).make_config(**kwargs)


def test_entropy_config_validates_early():
    with pytest.raises(OptionError, match="scale_per"):
        EntropyConfig(scale_per="column")
    with pytest.raises(OptionError, match="target_bits"):
        EntropyConfig(target_bits=0)
    with pytest.raises(OptionError, match="outlier_rate"):
        SSQRConfig(outlier_rate=0.7)


def test_awq_refuses_no_clip_with_its_clip_search():
    with pytest.raises(OptionError, match="awq.*clip"):
        AWQConfig(clip=False)
    assert AWQConfig(clip=False, clip_search=False).clip is False  # RTN without clipping: used


def test_python_api_refuses_before_any_work():
    m = tiny_llama()
    calib = torch.randint(4, 128, (2, 16))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(OptionError):
        quantize_(m, "hrtn", calib, bits=2, progress=False)
    with pytest.raises(OptionError):
        quantize_(m, "awq", calib, clip=False, progress=False)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())


# --- CLI: only flags the user gave are checked -----------------------------------------------------


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--method", "ssqr", "--scale", "minmax"], "MSE"),
        (["--method", "hptq", "--bits", "4"], "--bits"),
        (["--method", "hptq", "--group-size", "-1"], "--group-size"),
        (["--method", "hrtn", "--group-size", "64"], "--group-size"),
        (["--method", "hrtn", "--sym"], "--sym"),
        (["--method", "hptq", "--asym"], "--asym"),
        (["--method", "hptq", "--scale", "minmax"], "--scale"),
        (["--method", "awq", "--no-clip"], "clip"),
    ],
)
def test_cli_refuses_ignored_flags(capsys, argv, needle):
    err = _cli_error(capsys, argv)
    assert needle in err and argv[1] in err


def test_cli_defaults_are_not_flags():
    cfg = _config(["--method", "hptq", "--target-bits", "3.5"])
    assert cfg.target_bits == 3.5 and cfg.group_size is None
    cfg = _config(["--method", "awq"])
    assert cfg.clip and cfg.bits == 4
    cfg = _config(["--method", "ssqr", "--scale", "mse", "--bits", "3"])
    assert cfg.scale_method == "mse" and cfg.bits == 3
    cfg = _config(["--method", "rtn", "--no-clip", "--bits", "3"])
    assert not cfg.clip and cfg.bits == 3


def test_cli_fp8_keeps_its_own_bit_width():
    """The CLI used to pass bits=4 to every method: ``--method fp8`` without ``--bits 8`` failed."""
    cfg = _config(["--method", "fp8"])
    assert cfg.bits == 8


def test_option_errors_are_value_errors():
    assert issubclass(OptionError, BitmosaicError) and issubclass(OptionError, ValueError)
