"""One registry of quantization methods, by name: ``@register`` on a :class:`~.base.Method` subclass.

Every config carries ``act``: the activation quantizer applied at the input of each quantized
linear (``None`` = 16-bit activations), so every weight method composes with every activation
format.
"""

from __future__ import annotations

from .base import LayerStats, Method, MethodContext, WeightQuantConfig

__all__ = [
    "DEFAULT_METHOD", "LayerStats", "Method", "MethodContext", "WeightQuantConfig", "get_method",
    "list_methods", "register",
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
