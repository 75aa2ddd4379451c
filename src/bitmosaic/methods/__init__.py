"""The methods, registered by name: ``get_method("gptq")``.  A new method is one file here (its
config and :class:`~.base.Method` subclass with ``@register``) and one line below."""

from . import dpq, fp8, gptq, hptq, mosaic, rtn, sfmp, smoothquant, sq_acts  # noqa: F401  (registration)
from .registry import (
    DEFAULT_METHOD,
    LayerStats,
    Method,
    MethodContext,
    WeightQuantConfig,
    get_method,
    list_methods,
    register,
)

__all__ = [
    "DEFAULT_METHOD", "LayerStats", "Method", "MethodContext", "WeightQuantConfig", "get_method",
    "list_methods", "register",
]  # fmt: skip
