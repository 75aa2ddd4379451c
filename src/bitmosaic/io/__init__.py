"""Input and output: loading models (HF folders, hub ids, GGUF), saving and loading quantized models,
the transformers integration, provenance and export to other checkpoint formats."""

from .loading import ModelSpecError, load_model, resolve_model_spec
from .serialization import load_quantized, quantized_modules, save_quantized

__all__ = ["ModelSpecError", "load_model", "load_quantized", "quantized_modules", "resolve_model_spec",
           "save_quantized"]
