"""One registry of quantization methods, by name: ``@register`` on a :class:`~.base.Method` subclass.

Every config carries ``act``: the activation quantizer applied at the input of each quantized
linear (``None`` = 16-bit activations), so every weight method composes with every activation
format.
"""

from __future__ import annotations

from ..errors import OptionError
from .base import LayerStats, Method, MethodContext, WeightQuantConfig

__all__ = [
    "DEFAULT_METHOD", "LayerStats", "Method", "MethodContext", "WeightQuantConfig", "get_method",
    "grid_fallback", "list_methods", "register",
]  # fmt: skip

_REGISTRY: dict[str, Method] = {}
DEFAULT_METHOD = "gptq"  # what `bitmosaic quantize` runs without --method


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: register one instance of ``cls`` under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY:
        raise ValueError(f"method {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls()
    return cls


def get_method(name: str) -> Method:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(_REGISTRY))}") from None


def list_methods() -> list[str]:
    return sorted(_REGISTRY)


_GRID_FIELDS = ("bits", "group_size", "sym")  # the integer grid a plainly packed config quantizes to


def grid_fallback(method: Method, config) -> tuple[Method, WeightQuantConfig]:
    """The ``(method, config)`` that quantizes a linear of ``(method, config)`` without calibration
    statistics on the same integer grid: the registered method whose ``grid_fallback`` is set
    (round-to-nearest) with MSE-searched group scales and ``config``'s bits, group size, symmetry,
    clipping and activation quantizer.  What the pipeline uses for a linear whose own statistics are
    too thin (an expert routed too few calibration tokens, issue 71).  Refused in one line for a method
    whose results are not that grid's plain format (it packs its own kind, or ignores the grid fields)."""
    unused = [f for f in _GRID_FIELDS if f in getattr(method.config_cls, "unused", {})]
    if not method.packs_plain(config) or unused:
        why = f"it does not use {'/'.join(unused)}" if unused else "it packs its own kind"
        raise OptionError(
            f"method {method.name!r} stores its own format ({why}), so a linear without statistics of its "
            "own cannot be rounded to its grid instead; use the pooled fallback (--moe-fallback pooled)"
        )
    fallback = next((m for m in _REGISTRY.values() if m.grid_fallback), None)
    if fallback is None:
        raise RuntimeError("internal: no registered method is marked grid_fallback")
    options = {f: getattr(config, f) for f in (*_GRID_FIELDS, "clip", "act")}
    options.update({f: getattr(config, f) for f in ("wfmt", "mx_rule") if hasattr(config, f)})
    return fallback, fallback.make_config(**options, scale="mse")
