"""``RunSettings`` is declared once: the CLI flags, the API keywords and the provenance record all come
from its fields (the run-path issue), so none of the three can drift from the others."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bitmosaic import quantize_
from bitmosaic.cli import build_parser
from bitmosaic.cli.settings_flags import settings_from_args
from bitmosaic.errors import OptionError
from bitmosaic.methods import get_method, list_methods
from bitmosaic.pipeline.settings import RunSettings, settings_fields
from tests.helpers import tiny_llama


def _calib() -> torch.Tensor:
    return torch.randint(4, 128, (4, 16), generator=torch.Generator().manual_seed(0))


def test_settings_and_method_options_never_share_a_name():
    """``quantize_`` routes each keyword by name: a config field named like a setting would be lost."""
    settings = set(settings_fields())
    for name in list_methods():
        spec = get_method(name)
        fields = {f.name for f in dataclasses.fields(spec.config_cls)}
        assert not (fields | set(spec.prepare_inputs)) & settings, name


def test_every_flagged_setting_is_a_quantize_flag_with_its_help():
    q = build_parser()._subparsers._group_actions[0].choices["quantize"]
    by_flag = {s: a for a in q._actions for s in a.option_strings}
    for f in settings_fields().values():
        flag = f.metadata["flag"]
        if flag is None:
            continue
        assert flag in by_flag, flag
        assert f.metadata["help"] in by_flag[flag].help, flag


def test_command_line_settings_reach_the_settings_object():
    argv = ["quantize", "--batch-size", "8", "--hessian-dtype", "float64", "--seed", "3", "--bound-orders",
            "natural,act", "--no-progress", "--max-memory", "2GB", "--out", "x/y"]  # fmt: skip
    args = build_parser().parse_args(argv)
    s = settings_from_args(args, torch.device("cpu"))
    assert (s.batch_size, s.hessian_dtype, s.seed, s.analyze_orders, s.progress) == (
        8, torch.float64, 3, ("natural", "act"), False
    )
    assert s.device == torch.device("cpu") and s.max_memory == "2GB" and s.spill_dir.name == "x"
    default = settings_from_args(build_parser().parse_args(["quantize"]), None)
    plain = RunSettings()
    names = ("batch_size", "hessian_dtype", "seed", "analyze_orders", "progress")
    assert [getattr(default, n) for n in names] == [getattr(plain, n) for n in names]


def test_the_record_round_trips():
    s = RunSettings(batch_size=2, hessian_dtype="float64", analyze_orders="natural,min-pivot")
    rec = s.record()
    assert rec == {"batch_size": 2, "hessian_dtype": "float64", "bound_orders": "natural,min-pivot"}
    back = RunSettings.from_record(rec)
    got = (back.batch_size, back.hessian_dtype, back.analyze_orders)
    assert got == (2, torch.float64, ("natural", "min-pivot"))


def test_keywords_and_a_settings_object_are_one_run():
    a, b = tiny_llama(), tiny_llama()
    ra = quantize_(a, "gptq", _calib(), bits=4, group_size=16, batch_size=2, progress=False)
    settings = RunSettings(batch_size=2, progress=False)
    rb = quantize_(b, "gptq", _calib(), bits=4, group_size=16, settings=settings)
    assert a.bitmosaic_run["provenance"]["pipeline"] == b.bitmosaic_run["provenance"]["pipeline"]
    assert a.bitmosaic_run["provenance"]["pipeline"]["batch_size"] == 2
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa) and ra.bits_per_weight == rb.bits_per_weight
    c = tiny_llama()  # a keyword overrides the settings object
    quantize_(c, "rtn", _calib(), settings=RunSettings(batch_size=2, progress=False), batch_size=1)
    assert c.bitmosaic_run["provenance"]["pipeline"]["batch_size"] == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_a_bad_batch_size_is_one_line(bad):
    with pytest.raises(OptionError, match="batch_size must be an integer >= 1") as e:
        RunSettings(batch_size=bad)
    assert "\n" not in str(e.value)


def test_a_bad_hessian_dtype_is_one_line():
    with pytest.raises(OptionError, match="hessian_dtype must be one of"):
        RunSettings(hessian_dtype="float16")
