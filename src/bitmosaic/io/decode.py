"""Faster decode: a static KV cache and a ``torch.compile``-d decode step behind plain ``model.generate``.

Eager decoding of a small model on the CPU spends most of each token in Python: transformers' forward
issues thousands of tiny aten calls per token.  :func:`enable_compiled_decode` sets the model's
``generation_config`` so that transformers' own ``generate`` (5.x, ``GenerationMixin``) does the rest:

* ``cache_implementation="static"``: a preallocated KV cache (``StaticCache``) of the prompt plus the new
  tokens, so every decode step has the same shapes;
* ``compile_config=CompileConfig(fullgraph=True, dynamic=False, options={"size_asserts": False})`` with
  ``_compile_all_devices=True`` (without it ``_valid_auto_compile_criteria`` compiles on accelerators
  only): ``generate`` then runs the prefill eagerly and every later step through
  ``model.get_compiled_call`` -- one inductor graph, compiled on the first ``generate`` and reused.

The graph is whole (``fullgraph=True``: a graph break is an error, not a silent slowdown) because every
bitmosaic kernel is a ``torch.library`` operator with a fake implementation
(:mod:`bitmosaic.kernels.ops`); the kernel weights are built first (:func:`prepare_kernels`, and the
integer-activation kernels of layers that have an activation quantizer), so the trace never builds one.

Cost and scope: the first ``generate`` compiles (inductor's C++ codegen; about a minute for SmolLM2-135M
on this CPU, ``benchmarks/decode.py`` reports it apart from the decode rate); later calls with the same
``max_new_tokens``, prompt length bucket and batch size reuse the graph, and another cache length
compiles again.  It helps where Python overhead dominates a token (small models, batch 1); it changes no
number beyond float32 reassociation by inductor's fused element-wise kernels (tested against eager:
``tests/io/test_compiled_decode.py``).  Call it after
:func:`~bitmosaic.modules.intact.set_runtime_activations` (a later change of the activation path needs
:func:`disable_compiled_decode` and a new call).
"""

from __future__ import annotations

import torch
from torch import nn

from ..modules.base import QuantModule, prepare_kernels

__all__ = ["enable_compiled_decode", "disable_compiled_decode", "compile_config"]


def compile_config(options: dict | None = None):
    """The ``transformers.CompileConfig`` :func:`enable_compiled_decode` installs (``options``: inductor
    options, e.g. ``{"cpp_wrapper": True}``)."""
    from transformers import CompileConfig

    # no size/stride assertion on every graph input per step (the packed weights are ~1500 inputs in
    # SmolLM2: about 1 ms a token measured, cProfile); torch.compile takes options or a mode, not both
    opts = {"size_asserts": False, **(options or {})}
    cfg = CompileConfig(fullgraph=True, dynamic=False, mode=None, options=opts)
    cfg._compile_all_devices = True  # not a dataclass field: set on the instance (compile on the CPU too)
    return cfg


def _prepare(model: nn.Module) -> None:
    """Build every kernel weight now, outside the trace."""
    prepare_kernels(model)
    for m in model.modules():
        if isinstance(m, QuantModule) and m.act_quantizer() is not None:
            with torch.no_grad():
                m.runs_int_act(torch.empty(0, m.in_features))  # builds the integer kernel where it runs


def enable_compiled_decode(model: nn.Module, options: dict | None = None) -> nn.Module:
    """Make ``model.generate(...)`` decode with a static KV cache and a compiled step (module doc);
    returns ``model``.  ``options``: inductor options for the compile (default none).  Raises
    ``ValueError`` for a model without a ``generation_config`` (not a transformers generative model)."""
    gc = getattr(model, "generation_config", None)
    if gc is None or not hasattr(model, "generate"):
        raise ValueError(
            f"{type(model).__name__} has no generation_config/generate: compiled decode needs a "
            "transformers causal LM (load it with bitmosaic.io.load_quantized or load_model)"
        )
    _prepare(model)
    gc.cache_implementation = "static"
    gc.compile_config = compile_config(options)
    gc.disable_compile = False
    return model


def disable_compiled_decode(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_compiled_decode`: the dynamic cache and eager decode again."""
    gc = model.generation_config
    gc.cache_implementation = None
    gc.compile_config = None
    for attr in ("_compiled_call", "_last_compile_config"):
        if hasattr(model, attr):
            delattr(model, attr)
    return model
