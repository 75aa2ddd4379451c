"""Models: loading, per-architecture layer maps, the calibration pipeline, quantized modules, I/O."""

from ..modules.qlinear import QuantLinear, UnpackableCodesError, set_weight_cache
from .arch import ARCHS, ArchSpec, UnknownArchitectureError, get_arch, register_arch
from .loading import ModelSpecError, load_model, resolve_model_spec
from .pipeline import RunReport, StopForward, quantize_model
from .serialization import load_quantized, quantized_modules, save_quantized

__all__ = [
    "ARCHS",
    "ArchSpec",
    "ModelSpecError",
    "QuantLinear",
    "RunReport",
    "StopForward",
    "UnknownArchitectureError",
    "UnpackableCodesError",
    "get_arch",
    "load_model",
    "load_quantized",
    "quantize_model",
    "quantized_modules",
    "register_arch",
    "resolve_model_spec",
    "save_quantized",
    "set_weight_cache",
]
