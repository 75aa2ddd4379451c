"""Every method option is declared once, on its config field, with :func:`option`.

A field's metadata carries its CLI flag (``--`` + the field name with ``-`` for ``_``, so the Python
keyword equals the flag), its help text, choices, range and parser, its old flag spellings
(deprecated aliases) and old Python names (still accepted, with a warning).  The ``quantize``
parser, the recipe loader, :func:`bitmosaic.quantize_`, the "flag not used by this method" error,
``bitmosaic methods`` and the README's method table are all generated from these fields.

A config class says which inherited fields it does not use in ``unused`` (field -> why); giving
one is an error naming the flag and the method.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

from ..errors import OptionError

__all__ = [
    "ConfigMeta", "OptionSpec", "option", "option_spec", "config_options", "used_options", "rename_old_keys",
    "parse_block", "parse_block_text", "parse_group_size", "parse_alpha", "parse_floats", "parse_none",
]  # fmt: skip

_KEY = "bitmosaic_option"


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """What a config field says about itself (its ``dataclasses.field`` metadata)."""

    help: str
    flag: str | None = None  # None: "--" + name with "-"
    choices: tuple | None = None
    range: tuple[float | None, float | None] | None = None
    parse: Callable[[str], Any] | None = None  # CLI text -> value (default: the default's type)
    type: type | None = None  # CLI value type when the default is None
    negative: str | None = None  # bool fields: the "off" flag (default --no-NAME)
    aliases: tuple[str, ...] = ()  # other accepted spellings (not deprecated)
    deprecated: tuple[str, ...] = ()  # old flag spellings: accepted with a warning for one release
    old_names: tuple[str, ...] = ()  # old Python/recipe keys: accepted with a warning
    sets: tuple[str, ...] = ()  # composite flag: the fields one value fills (sfmp --block)
    shared: bool = False  # declared by a shared CLI group (the activation flags)


def option(default=dataclasses.MISSING, *, help: str, default_factory=dataclasses.MISSING, **spec) -> Any:
    """A config field with its CLI/API description (see :class:`OptionSpec`)."""
    meta = {_KEY: OptionSpec(help=help, **spec)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def option_spec(f: dataclasses.Field) -> OptionSpec:
    spec = f.metadata.get(_KEY)
    if spec is None:
        raise TypeError(f"config field {f.name!r} is not declared with methods.options.option()")
    return spec


def flag_of(f: dataclasses.Field) -> str:
    return option_spec(f).flag or "--" + f.name.replace("_", "-")


def config_options(cls) -> dict[str, dataclasses.Field]:
    """Every field of a config class, by name."""
    return {f.name: f for f in dataclasses.fields(cls)}


def used_options(cls) -> dict[str, dataclasses.Field]:
    """The fields a config class uses (not in its ``unused``)."""
    unused = getattr(cls, "unused", {})
    return {n: f for n, f in config_options(cls).items() if n not in unused}


def default_of(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def rename_old_keys(cls, kwargs: dict, where: str = "") -> dict:
    """``kwargs`` with old option names (``percdamp``, ``scale_method``, ``symmetric``, ...) mapped to
    the current ones, with a :class:`FutureWarning` (saved models and recipes carry the old names)."""
    old = {o: f.name for f in dataclasses.fields(cls) for o in option_spec(f).old_names}
    if not any(k in old for k in kwargs):
        return kwargs
    out = {}
    for k, v in kwargs.items():
        if k in old:
            new = old[k]
            if new in kwargs:
                raise OptionError(f"{where}both {k!r} (old name) and {new!r} given; keep only {new!r}")
            warnings.warn(
                f"{where}option {k!r} is now called {new!r}; the old name goes away in the next release",
                FutureWarning,
                stacklevel=3,
            )
            k = new
        out[k] = v
    return out


class ConfigMeta(type):
    """Configs accept their fields' old names as keywords (mapped with a warning)."""

    def __call__(cls, *args, **kwargs):
        if dataclasses.is_dataclass(cls):
            kwargs = rename_old_keys(cls, kwargs)
        return super().__call__(*args, **kwargs)


def check_range(cls, name: str, value) -> None:
    """A value outside its field's declared choices or range is an :class:`~bitmosaic.errors.OptionError`."""
    spec = option_spec(config_options(cls)[name])
    if spec.choices and value is not None and not isinstance(value, bool) and value not in spec.choices:
        raise OptionError(f"{name}={value!r} is not one of {', '.join(map(str, spec.choices))}")
    if spec.range is None or value is None or isinstance(value, (str, bool)):
        return
    lo, hi = spec.range
    if (
        not isinstance(value, (int, float))
        or (lo is not None and value < lo)
        or (hi is not None and value > hi)
    ):
        span = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        raise OptionError(f"{name}={value!r} is out of range {span}")


# -- parsers of CLI text ---------------------------------------------------------------------------
def parse_block(text) -> tuple[int, int]:
    """``ROWSxCOLS`` (``64x64``, ``512x128``): the one block grammar of every method."""
    if isinstance(text, (tuple, list)) and len(text) == 2:
        r, c = (int(v) for v in text)
    else:
        try:
            r, c = (int(v) for v in str(text).lower().split("x"))
        except ValueError:
            raise OptionError("a block must look like ROWSxCOLS, e.g. 64x64 or 512x128") from None
    if r < 1 or c < 1:
        raise OptionError("block sizes must be positive, e.g. 64x64")
    return r, c


def parse_block_text(text) -> str:
    """``ROWSxCOLS`` checked, as text (``"64x64"``)."""
    return "x".join(map(str, parse_block(text)))


def parse_group_size(text) -> int | None:
    try:
        v = int(text)
    except ValueError:
        raise OptionError("group size must be a whole number: positive, or -1 for per-channel") from None
    if v < -1 or v == 0:
        raise OptionError("group size must be positive, or -1 for per-channel")
    return None if v == -1 else v


def parse_alpha(text) -> float | None:
    if text in ("search", None):
        return None
    try:
        v = float(text)
    except ValueError:
        raise OptionError("alpha must be a number in [0, 1] or 'search'") from None
    if not 0.0 <= v <= 1.0:
        raise OptionError("alpha must be in [0, 1] or 'search'")
    return v


def parse_floats(text) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise OptionError(f"{text!r} must be a comma list of numbers (0.3,0.5,0.7)") from None


def parse_none(text) -> str | None:
    return None if str(text).lower() == "none" else str(text)


def like(cls, name: str, default=dataclasses.MISSING, **changes) -> Any:
    """Field ``name`` of config ``cls`` again, with a new default (and spec changes): a subclass that
    changes a default keeps the field's flag and help."""
    f = config_options(cls)[name]
    spec = dataclasses.replace(option_spec(f), **changes)
    if default is dataclasses.MISSING:
        default = default_of(f)
    return dataclasses.field(default=default, metadata={_KEY: spec})
