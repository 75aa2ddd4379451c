"""The methods, registered by name: ``get_method("gptq")``.  A new method is one file here (its
config and :class:`~.base.Method` subclass with ``@register``) and one line below."""

# registration: one line per method file (hptq.py registers hptq and its RTN variant hrtn)
from . import (  # noqa: F401
    awq,
    babai,
    dpq,
    fp8,
    gptq,
    hptq,
    mosaic,
    rtn,
    sfmp,
    smoothquant,
    sq_acts,
    sq_weights,
    ssqr,
)
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
