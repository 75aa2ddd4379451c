"""Which transformers class a config builds: a causal LM, or a multimodal model whose language tower
bitmosaic quantizes (Gemma 3, LLaVA, Qwen2.5-VL, Qwen3-VL; :mod:`bitmosaic.models.arch`).

``AutoModelForCausalLM`` knows no LLaVA or Qwen-VL config, and for Gemma 3 it gives the multimodal class.
:func:`auto_model_class` returns the one of transformers' own text-generating auto classes
(``AutoModelForCausalLM``, ``AutoModelForImageTextToText``; never code from the model's folder) that
maps the config to the class ``config.architectures`` names, else the first that knows the config, so
that a saved model loads back as the class it was saved from, with the vision tower it was saved with."""

from __future__ import annotations

__all__ = ["auto_model_class"]


def _mapped(auto, config):
    """The class ``auto`` maps ``config`` to, or ``None``."""
    try:
        return auto._model_mapping[type(config)]
    except (KeyError, ValueError, AttributeError):
        return None


def auto_model_class(config):
    """The auto class to build ``config`` with (``from_config`` / ``from_pretrained``), module doc: the
    one that maps it to the class ``config.architectures`` names, else the first that maps it; a config
    neither knows gets ``AutoModelForCausalLM`` (which then raises its own error)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    autos = [a for a in (AutoModelForCausalLM, AutoModelForImageTextToText) if _mapped(a, config) is not None]
    named = list(getattr(config, "architectures", None) or [])
    for auto in autos:
        if named and _mapped(auto, config).__name__ == named[0]:
            return auto
    return autos[0] if autos else AutoModelForCausalLM
