"""Input and output: loading models (HF folders, hub ids, GGUF), saving and loading quantized models,
the transformers integration, provenance, export to other checkpoint formats, and compiled decode
(:mod:`.decode`)."""

from .decode import disable_compiled_decode, enable_compiled_decode
from .loading import ModelSpecError, load_model, resolve_model_spec
from .serialization import load_quantized, quantized_modules, save_quantized

__all__ = [
    "ModelSpecError",
    "disable_compiled_decode",
    "enable_compiled_decode",
    "load_model",
    "load_quantized",
    "quantized_modules",
    "resolve_model_spec",
    "save_quantized",
]
