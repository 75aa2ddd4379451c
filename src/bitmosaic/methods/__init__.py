"""Quantization recipes, registered by name: ``get_method("gptq")``."""

from . import dpq as _dpq  # noqa: F401  (registers dpq)
from . import fp8 as _fp8  # noqa: F401  (registers fp8)
from . import gptq as _gptq  # noqa: F401  (registers gptq, babai)
from . import lattice as _lattice  # noqa: F401  (registers ssqr, hptq, hrtn)
from . import mosaic as _mosaic  # noqa: F401  (registers mosaic)
from . import rtn as _rtn  # noqa: F401  (registers rtn)
from . import sfmp as _sfmp  # noqa: F401  (registers sfmp)
from . import smoothquant as _smoothquant  # noqa: F401  (registers smoothquant, awq)
from . import sq as _sq  # noqa: F401  (registers sq-weights, sq-acts)
from .registry import LayerStats, MethodSpec, WeightQuantConfig, get_method, list_methods, register_method

__all__ = ["LayerStats", "MethodSpec", "WeightQuantConfig", "get_method", "list_methods", "register_method"]
