"""Declarative per-architecture layer maps (GPTQModel-style: data, not code).

Each :class:`ArchSpec` names where the decoder layers live and the linear sub-modules of one
layer in *true-sequential* groups: modules of a group read the same input, and a group is
quantized only after the groups before it, so its Hessian sees their quantized outputs.
Anything not listed (embeddings, norms, ``lm_head``) is left in float.

``smooth_prev`` names, per group, the op whose output *is* the group's input, so per-channel
smoothing factors (SmoothQuant, AWQ) can be folded into it: the pre-attention / pre-MLP norm for
q/k/v and gate/up, ``v_proj`` for ``o_proj`` and ``up_proj`` for ``down_proj`` (in a SwiGLU MLP
``down``'s input is ``act(gate) * up``, linear in ``up``'s output rows).  ``None`` means no such
op exists (post-norm blocks, fused projections), and the group is left unsmoothed.  ``v_proj ->
o_proj`` is used only when their widths match (no grouped-query attention); with GQA one ``v``
channel feeds several heads and per-channel factors cannot be folded exactly.  ``norm_offset``
is 1 for Gemma-style RMSNorms, which multiply by ``1 + weight``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

__all__ = ["ArchSpec", "ARCHS", "register_arch", "get_arch", "UnknownArchitectureError"]


class UnknownArchitectureError(ValueError):
    pass


@dataclass(frozen=True)
class ArchSpec:
    layers_path: str
    sequential: tuple[tuple[str, ...], ...]
    skipped: tuple[str, ...] = ("lm_head", "embed_tokens")
    smooth_prev: tuple[str | None, ...] | None = None
    norm_offset: float = 0.0

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.layers_path)

    def linear_names(self) -> list[str]:
        return [name for group in self.sequential for name in group]


LLAMA_LIKE = ArchSpec(
    layers_path="model.layers",
    sequential=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    ),
    smooth_prev=("input_layernorm", "self_attn.v_proj", "post_attention_layernorm", "mlp.up_proj"),
)

# Gemma 2/3: the MLP's input norm is pre_feedforward_layernorm (post_attention_layernorm acts on
# the attention output); RMSNorm weights are offsets from 1.
GEMMA2_LIKE = dataclasses.replace(
    LLAMA_LIKE,
    smooth_prev=("input_layernorm", "self_attn.v_proj", "pre_feedforward_layernorm", "mlp.up_proj"),
    norm_offset=1.0,
)

PHI3 = ArchSpec(
    layers_path="model.layers",
    sequential=(("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)),
    # o_proj and down_proj read slices of fused projections: not foldable per channel here
    smooth_prev=("input_layernorm", None, "post_attention_layernorm", None),
)

ARCHS: dict[str, ArchSpec] = {
    "llama": LLAMA_LIKE,
    "mistral": LLAMA_LIKE,
    "qwen2": LLAMA_LIKE,
    "qwen3": LLAMA_LIKE,  # q_norm/k_norm are norms, not linears
    "gemma": dataclasses.replace(LLAMA_LIKE, norm_offset=1.0),
    "gemma2": GEMMA2_LIKE,
    "gemma3_text": GEMMA2_LIKE,
    "gemma3": dataclasses.replace(GEMMA2_LIKE, layers_path="model.language_model.layers"),
    "smollm3": LLAMA_LIKE,
    # OLMo 2 normalises after attention/MLP: q/k/v and gate/up read the raw residual stream
    "olmo2": dataclasses.replace(LLAMA_LIKE, smooth_prev=(None, "self_attn.v_proj", None, "mlp.up_proj")),
    "granite": LLAMA_LIKE,
    "phi3": PHI3,
}


def register_arch(model_type: str, spec: ArchSpec) -> None:
    """Add (or replace) the layer map for a ``config.model_type``."""
    ARCHS[model_type] = spec


def get_arch(model: nn.Module) -> ArchSpec:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    spec = ARCHS.get(model_type)
    if spec is None:
        raise UnknownArchitectureError(
            f"architecture {model_type!r} has no layer map. Add one with "
            "bitmosaic.models.arch.register_arch(model_type, ArchSpec(layers_path='model.layers', "
            "sequential=((...q/k/v...), (...o...), (...gate/up...), (...down...)))); "
            f"known: {', '.join(sorted(ARCHS))}"
        )
    return spec
