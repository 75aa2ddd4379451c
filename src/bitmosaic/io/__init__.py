"""Input and output, by job: where a float model comes from (:mod:`.sources`: HF folders, hub ids, GGUF
files), bitmosaic's saved folders (:mod:`.saved`: save, load, verify, the transformers integration,
provenance) and export to other checkpoint formats (:mod:`.export`).

The names below are the public ones, importable from ``bitmosaic.io`` as before; compiled decode
(``enable_compiled_decode``) runs at inference and lives in :mod:`bitmosaic.modules.decode`, re-exported
here because the README documents ``bitmosaic.io.enable_compiled_decode``."""

from ..modules.decode import disable_compiled_decode, enable_compiled_decode
from .saved.load import load_quantized
from .saved.save import quantized_modules, save_quantized
from .sources.loading import ModelSpecError, load_model, resolve_model_spec

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
