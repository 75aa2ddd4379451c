"""Declarative per-architecture layer maps (GPTQModel-style: data, not code).

Each :class:`ArchSpec` names where the decoder layers live and the linear sub-modules of one
layer in *true-sequential* groups: modules of a group read the same input, and a group is
quantized only after the groups before it, so its Hessian sees their quantized outputs.
Anything not listed (embeddings, norms, ``lm_head``) is left in float.
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
)

PHI3 = ArchSpec(
    layers_path="model.layers",
    sequential=(("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)),
)

ARCHS: dict[str, ArchSpec] = {
    "llama": LLAMA_LIKE,
    "mistral": LLAMA_LIKE,
    "qwen2": LLAMA_LIKE,
    "qwen3": LLAMA_LIKE,  # q_norm/k_norm are norms, not linears
    "gemma": LLAMA_LIKE,
    "gemma2": LLAMA_LIKE,
    "gemma3_text": LLAMA_LIKE,
    "gemma3": dataclasses.replace(LLAMA_LIKE, layers_path="model.language_model.layers"),
    "smollm3": LLAMA_LIKE,
    "olmo2": LLAMA_LIKE,
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
