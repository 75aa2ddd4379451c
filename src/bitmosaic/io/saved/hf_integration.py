"""transformers integration: ``AutoModelForCausalLM.from_pretrained(dir)`` loads bitmosaic folders.

A saved folder's ``config.json`` carries ``quantization_config.quant_method = "bitmosaic"`` (every
format version, from the first one on).  :func:`register` adds to transformers' quantizer registry
(``register_quantization_config`` / ``register_quantizer``):

- :class:`BitmosaicConfig`, a ``QuantizationConfigMixin`` that keeps the saved table as it is
  (``modules``: per layer its module kind and settings; the method, recipe and provenance), so
  ``model.save_pretrained`` writes it back unchanged;
- :class:`BitmosaicHfQuantizer`, an ``HfQuantizer`` for pre-quantized folders only: before the
  weights are read it swaps every listed ``nn.Linear`` (still on the meta device) for an empty
  module of the saved kind (each with its activation quantizer), so transformers' own loader fills
  their buffers from the safetensors shards; afterwards it runs the same
  :func:`~bitmosaic.io.saved.finish.finish_load` as :func:`~bitmosaic.io.saved.load.load_quantized`, so
  both loaders return the same modules, bit for bit.

``import bitmosaic`` arranges the registration (``bitmosaic/_hf_hook.py``): at once when
transformers' quantizer registry is already imported, else the moment it is, so a plain
``import bitmosaic`` does not pay transformers' import time.  Registration is idempotent.
:func:`load` is the short form (``bitmosaic.load(dir)``).
"""

from __future__ import annotations

import contextvars
import os
from pathlib import Path

import torch
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ...errors import CorruptModelError, OptionError, check_finite
from ...modules.base import QuantModule
from ...modules.decode import default_compiled_decode
from ...modules.experts import unfuse_experts
from .finish import finish_load, model_arch
from .load import (
    check_quant_config,
    check_saved_tensors,
    install_quantized_modules,
    read_quant_config,
    stored_tensors,
    stored_tensors_of_file,
)

__all__ = ["QUANT_METHOD", "BitmosaicConfig", "BitmosaicHfQuantizer", "register", "load"]

QUANT_METHOD = "bitmosaic"

# load()'s ``compile`` for the quantizer it runs through (from_pretrained takes no keyword of ours)
_COMPILE: contextvars.ContextVar[bool] = contextvars.ContextVar("bitmosaic_compile", default=True)


class BitmosaicConfig(QuantizationConfigMixin):
    """A bitmosaic ``quantization_config``: every saved key is kept as an attribute, unchanged."""

    def __init__(self, modules: dict | None = None, **fields) -> None:
        fields.pop("quant_method", None)
        self.quant_method = QUANT_METHOD
        self.modules = modules
        for k, v in fields.items():
            setattr(self, k, v)


class BitmosaicHfQuantizer(HfQuantizer):
    """Loads pre-quantized bitmosaic folders (quantizing on load is what ``bitmosaic quantize`` does)."""

    requires_calibration = True  # transformers then refuses to "quantize" a float model with it

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        qc = self.quantization_config.to_dict()
        path = _folder(model, checkpoint_files)
        check_quant_config(qc, path)
        unfuse_experts(model)  # a mixture of experts is saved one linear per expert projection
        with torch.device("meta"):  # transformers fills the buffers from the shards
            install_quantized_modules(model, qc["modules"], path)
        files = [Path(f) for f in checkpoint_files or () if str(f).endswith(".safetensors")]
        if files:  # before transformers reads them: what it would leave uninitialised or random
            stored = {}
            for f in files:
                stored.update(stored_tensors_of_file(f))
            tied = bool(getattr(model.config, "tie_word_embeddings", False))
            check_saved_tensors(path, model, stored, tied)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        path = _folder(model)
        for name, mod in model.named_modules():
            if not isinstance(mod, QuantModule):
                continue
            for key, t in [*mod.named_buffers(prefix=name), *mod.named_parameters(prefix=name)]:
                if t.is_meta:
                    raise CorruptModelError(
                        f"{path}: tensor {key} is missing from the saved weights; "
                        "the saved model is damaged: save or download it again"
                    )
                check_finite(t, f"tensor {key} of the saved model {path}")
        finish_load(model, self.quantization_config.to_dict(), model_arch(model))
        default_compiled_decode(model, _COMPILE.get())  # eager, with no error, where it does not apply
        return model

    def is_serializable(self, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        """The kernels are ``torch.library`` operators (kernels/ops.py): ``generate`` may compile the
        decode step (:func:`bitmosaic.modules.decode.enable_compiled_decode`)."""
        return True


def _folder(model, checkpoint_files=None) -> str:
    """The saved folder, named as the caller gave it (the same text as ``load_quantized``'s errors)."""
    name = getattr(model.config, "name_or_path", None)
    if name and Path(name).is_dir():
        return str(Path(name))
    if checkpoint_files:
        return str(Path(checkpoint_files[0]).parent)
    return name or "the model folder"


def register() -> None:
    """Add the bitmosaic config and quantizer to transformers' registry (a no-op the second time)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(BitmosaicConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(BitmosaicHfQuantizer)


def load(path: str | os.PathLike, *, compile: bool = True, **kwargs):
    """``from_pretrained(path, **kwargs)`` of a bitmosaic folder: ``AutoModelForCausalLM``, or the multimodal
    class its config names (Qwen2.5-VL, LLaVA: :mod:`bitmosaic.io.sources.model_class`).

    The folder is checked first (one-line :class:`~bitmosaic.errors.CorruptModelError` for a missing
    or damaged ``config.json`` or a folder that is not a bitmosaic model).  Returns the transformers
    model; its tokenizer is ``AutoTokenizer.from_pretrained(path)``.  ``device`` (``"cpu"``, ``"cuda"``,
    ``"auto"``): the model is moved there and its kernel weights are built at once -- on CUDA the Triton
    kernels of the kinds that declare them (:mod:`bitmosaic.kernels.triton`, issue 76).

    ``compile`` (default ``True``): ``model.generate`` decodes through a compiled step with a static KV
    cache (:func:`~bitmosaic.modules.decode.default_compiled_decode`, issue 74): the first ``generate``
    compiles (announced on stderr; cached under ``~/.cache/bitmosaic/inductor``, so a later process
    compiles nothing).  It falls back to eager decode, with no error, for a mixture of experts, a model
    not on the CPU, or a step that does not compile.  ``compile=False`` or ``$BITMOSAIC_NO_COMPILE=1``:
    eager decode.
    """
    from transformers import AutoConfig

    from ...devices import resolve_device
    from ...modules.base import prepare_kernels
    from ..sources.model_class import auto_model_class

    device = kwargs.pop("device", None)
    if not isinstance(compile, bool):
        raise OptionError(f"compile must be True or False, not {compile!r}")
    dev = None if device is None else resolve_device(device)  # one-line DeviceError without CUDA
    register()
    read_quant_config(Path(path))
    if Path(path).is_dir():
        stored_tensors(path)  # the weight files first, as load_quantized does
    # a multimodal model (LLaVA, Qwen-VL): the class its config names, not AutoModelForCausalLM
    token = _COMPILE.set(compile and (dev is None or dev.type == "cpu"))  # moved after: no CPU step
    try:
        model = auto_model_class(AutoConfig.from_pretrained(path)).from_pretrained(path, **kwargs)
    finally:
        _COMPILE.reset(token)
    if dev is not None:
        model.to(dev)
        prepare_kernels(model)  # on CUDA: the Triton kernels of the kinds that declare them (issue 76)
    return model


register()  # importing this module is asking for the integration (see also bitmosaic/_hf_hook.py)
