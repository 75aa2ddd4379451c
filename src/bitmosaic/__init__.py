"""bitmosaic: post-training quantization of LLMs (GPTQ/Babai, RTN, packed formats, one pipeline).

The top-level names are loaded lazily, so ``import bitmosaic.formats`` (or any other subpackage)
loads only what that subpackage needs.  ``import bitmosaic`` also lets transformers load saved
bitmosaic folders (``AutoModelForCausalLM.from_pretrained(dir)``; see ``io/saved/hf_integration.py``),
registering with transformers only once transformers' quantizer registry is imported.
"""

from . import _hf_hook
from ._version import __version__

__all__ = ["__version__", "RunSettings", "get_method", "list_methods", "load", "quantize_"]

_hf_hook.install()


def __getattr__(name: str):
    if name == "quantize_":
        from .api import quantize_

        return quantize_
    if name == "RunSettings":
        from .pipeline.settings import RunSettings

        return RunSettings
    if name == "load":
        from .io.saved.hf_integration import load

        return load
    if name in ("get_method", "list_methods"):
        from . import methods

        return getattr(methods, name)
    raise AttributeError(f"module 'bitmosaic' has no attribute {name!r}")
