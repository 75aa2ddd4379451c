"""bitmosaic: post-training quantization of LLMs (GPTQ/Babai, RTN, packed formats, one pipeline).

The top-level names are loaded lazily, so ``import bitmosaic.formats`` (or any other subpackage)
loads only what that subpackage needs.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "get_method", "list_methods", "quantize_"]


def __getattr__(name: str):
    if name == "quantize_":
        from .api import quantize_

        return quantize_
    if name in ("get_method", "list_methods"):
        from . import methods

        return getattr(methods, name)
    raise AttributeError(f"module 'bitmosaic' has no attribute {name!r}")
