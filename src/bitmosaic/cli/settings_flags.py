"""What a ``quantize`` command line asks for: its run-settings flags, generated from
:class:`~bitmosaic.pipeline.settings.RunSettings` (each field that names a ``flag`` gets one, with the
field's help and default), the :class:`RunSettings` they ask for, and the calibration samples of
``--calib``, ``--nsamples``, ``--seqlen``, ``--seed`` and ``--data-dir``.

The device, memory, cache and output flags are shared with other subcommands or say more than one
field (``--device`` also places the evaluation, ``--max-memory`` also decides ``--stream auto``,
``--out`` places the spill folder), so :func:`settings_from_args` reads them beside the generated ones.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_settings_flags", "settings_from_args", "calibration_from_args"]

# flag types the generated flags take, by field (the rest: the default's type)
_CHOICES = {"hessian_dtype": ("float32", "float64")}


def add_settings_flags(p: argparse.ArgumentParser) -> None:
    """One flag per :class:`RunSettings` field that names one (module doc)."""
    import torch

    from ..pipeline.settings import SETTING_CHOICES, RunSettings, settings_fields

    default = RunSettings()
    choices = {**_CHOICES, **SETTING_CHOICES}
    for name, f in settings_fields().items():
        flag, text = f.metadata.get("flag"), f.metadata["help"]
        if flag is None:
            continue
        value = getattr(default, name)
        if isinstance(value, bool):  # a switch that turns a default-on setting off (--no-progress)
            p.add_argument(flag, action="store_true", help=f"turn off: {text}")
        elif name in choices:
            shown = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
            p.add_argument(flag, choices=choices[name], default=shown, help=text)
        elif value is None:  # a comma list (--bound-orders)
            p.add_argument(flag, default=None, help=f"comma list: {text}")
        else:
            p.add_argument(flag, type=type(value), default=value, help=text)


def settings_from_args(args, device, **overrides):
    """The :class:`RunSettings` of a ``quantize`` command line: the generated flags, ``--device``
    (resolved: ``device``), ``--max-memory``, ``--cache-dir``/``--no-cache`` and the spill folder
    beside ``--out``; ``overrides`` win."""
    from ..pipeline.calib_cache import CalibCache
    from ..pipeline.settings import RunSettings, settings_fields

    given = {}
    for name, f in settings_fields().items():
        flag = f.metadata.get("flag")
        if flag is None:
            continue
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        given[name] = (not value) if isinstance(f.default, bool) else value  # an off switch: --no-progress
    cache = CalibCache(None) if getattr(args, "no_cache", False) else CalibCache(
        getattr(args, "cache_dir", None) or "auto")  # fmt: skip
    out = getattr(args, "out", None)
    given.update(device=device, max_memory=getattr(args, "max_memory", None), calib_cache=cache,
                 spill_dir=Path(out).resolve().parent if out else None)  # fmt: skip
    return RunSettings(**{**given, **overrides})


def calibration_from_args(args, tok):
    """The :class:`~bitmosaic.pipeline.settings.Calibration` of ``--calib``, ``--nsamples``,
    ``--seqlen``, ``--seed`` and ``--data-dir``, drawn with the model's tokenizer ``tok``."""
    from ..api import draw_calibration

    return draw_calibration(tok, args.calib, args.nsamples, args.seqlen, args.seed, args.data_dir)
