"""One end for every load path: :func:`finish_load` runs after a saved model's buffers are filled, by
:func:`~bitmosaic.io.saved.load.load_quantized` and by the transformers quantizer
(``AutoModelForCausalLM.from_pretrained(dir)`` and ``bitmosaic.load(dir)``), so all three give the
same modules, bit for bit.  What a kind needs at load it declares itself (``QuantModule.after_load``,
``QuantModule.finish_model``); nothing here names a method or a kind."""

from __future__ import annotations

import torch
from torch import nn

from ...errors import CorruptModelError
from ...modules.base import QuantModule
from ...modules.head import default_runtime_head
from ...modules.intact import default_runtime_activations
from ...modules.rotation import apply_saved_rotations

__all__ = ["finish_load", "model_arch", "quant_modules_by_kind"]


def model_arch(model: nn.Module):
    """The architecture map of ``model``, or ``None`` when bitmosaic has none for it (loading still works;
    kinds that need it skip their model-level step)."""
    from ...models.arch import UnknownArchitectureError, get_arch

    try:
        return get_arch(model)
    except UnknownArchitectureError:
        return None


def quant_modules_by_kind(model: nn.Module) -> dict[type[QuantModule], dict[str, QuantModule]]:
    """The quantized modules of ``model``, grouped by their kind's class (in model order)."""
    out: dict[type[QuantModule], dict[str, QuantModule]] = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantModule):
            out.setdefault(type(m), {})[name] = m
    return out


def _cast_unquantized(model: nn.Module, qnames, dtype: torch.dtype) -> None:
    """Cast the float parameters outside the quantized modules (embeddings, norms, head) to ``dtype``."""
    for mname, mod in model.named_modules():
        if any(mname == q or mname.startswith(q + ".") for q in qnames):
            continue
        for p in mod.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def finish_load(
    model: nn.Module, quant_config: dict, arch=None, dtype: torch.dtype | None = None
) -> nn.Module:
    """Finish a loaded bitmosaic model in place and return it: cast the parameters outside the quantized
    modules to ``dtype`` (when given; stored formats never follow it), then each module's ``after_load``
    and each kind's ``finish_model`` (``arch``: the architecture map, e.g. for exact permutation folds
    between layers), record ``quant_config`` as ``model.quantization_info`` and switch to eval mode.
    A rotated model (``quant_config["rotation"]``, ``--rotate``) first gets its online rotations back
    at the inputs they were folded for (before any input quantizer), and keeps the record as
    ``model.bitmosaic_rotation`` (so a re-save keeps it).  The weight-only layers get run-time activations
    (:func:`~bitmosaic.modules.intact.default_runtime_activations`: ``$BITMOSAIC_RUNTIME_ACT``, else 16-bit
    ones where the integer kernel runs AVX-512 VNNI; a bad value raises ``OptionError`` naming the
    choices), ``$BITMOSAIC_RUNTIME_HEAD=int8`` the output head its 8-bit copy
    (:func:`~bitmosaic.modules.head.set_runtime_head`; unset: the 8-bit copy only where it holds the
    same weights, :func:`~bitmosaic.modules.head.default_runtime_head`)."""
    rotation = quant_config.get("rotation")
    try:
        apply_saved_rotations(model, rotation)
    except (ValueError, TypeError, AttributeError) as e:
        raise CorruptModelError(
            f"the saved model's quantization_config 'rotation' entry is unusable ({e}); re-save the model"
        ) from None
    if rotation:
        model.bitmosaic_rotation = rotation
    kinds = quant_modules_by_kind(model)
    if dtype is not None:
        _cast_unquantized(model, {n for mods in kinds.values() for n in mods}, dtype)
    for mods in kinds.values():
        for m in mods.values():
            m.after_load(dtype)
    for cls, mods in kinds.items():
        cls.finish_model(model, mods, arch)
    model.quantization_info = quant_config
    default_runtime_activations(model)  # $BITMOSAIC_RUNTIME_ACT, else int16 where the kernel runs VNNI
    default_runtime_head(model)  # $BITMOSAIC_RUNTIME_HEAD, else int8 where it holds the same weights
    model.eval()
    return model
