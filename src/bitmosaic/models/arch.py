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

``rotation`` (a :class:`RotationMap`) says where QuaRot's rotations go (``--rotate``;
:mod:`bitmosaic.pipeline.rotate`): the embeddings, the final norm and the head, each pre-norm and
the linears reading it, the linears writing the residual stream, the value/output pair of the
attention heads and the linears that get an online Hadamard at their input.  ``refuse`` names why an
architecture cannot be rotated exactly (post-norms between a block's output and the residual add).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

__all__ = ["ArchSpec", "ARCHS", "RotationMap", "register_arch", "get_arch", "UnknownArchitectureError"]


class UnknownArchitectureError(ValueError):
    pass


@dataclass(frozen=True)
class RotationMap:
    """Where a residual-stream rotation R1, the per-head value/output rotation R2 and the online
    Hadamards go (names relative to the model, or to a decoder layer for ``norms`` ... ``online``)."""

    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    head: str = "lm_head"
    # (pre-norm, the linears reading its output): its scale is folded into them, then R1 on their inputs
    norms: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    )
    writers: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")  # R1ᵀ on their outputs
    value: str | None = "self_attn.v_proj"  # R2 per head on its output rows ...
    value_tail: bool = False  # ... only its last kv_heads·head_dim rows (a fused q|k|v projection)
    attn_out: str | None = "self_attn.o_proj"  # ... and on these input columns
    # an online Hadamard at the input: QuaRot's down_proj and, across the heads, o_proj (Sec. 4, step 1c)
    online: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")
    refuse: str | None = None  # why this architecture cannot be rotated (None: it can)


LLAMA_ROTATION = RotationMap()


@dataclass(frozen=True)
class ArchSpec:
    layers_path: str
    sequential: tuple[tuple[str, ...], ...]
    skipped: tuple[str, ...] = ("lm_head", "embed_tokens")
    smooth_prev: tuple[str | None, ...] | None = None
    norm_offset: float = 0.0
    rotation: RotationMap | None = LLAMA_ROTATION

    # names a layer may lack (e.g. a dense MLP in a mixture-of-experts model's first layers)
    optional: tuple[str, ...] = ()

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.layers_path)

    def linear_names(self) -> list[str]:
        """The map's names (an experts wildcard ``mlp.experts.*.down_proj`` unexpanded)."""
        return [name for group in self.sequential for name in group]

    def groups(self, layer: nn.Module) -> tuple[tuple[str, ...], ...]:
        """``sequential`` for one decoder layer: a ``*`` stands for each index of the module list
        before it (the experts of a :class:`~bitmosaic.modules.experts.RoutedExperts`), and names the
        layer lacks are dropped when they are ``optional`` or expert wildcards (a group may then be
        empty; the indices stay those of ``sequential``)."""
        return tuple(tuple(n for name in group for n in _expand(layer, name, name in self.optional))
                     for group in self.sequential)  # fmt: skip

    def expert_group(self, index: int) -> bool:
        """Whether group ``index`` holds expert projections (a ``*`` name)."""
        return any("*" in name for name in self.sequential[index])

    def layer_linear_names(self, layer: nn.Module) -> list[str]:
        return [name for group in self.groups(layer) for name in group]


def _expand(layer: nn.Module, name: str, optional: bool) -> list[str]:
    if "*" not in name:
        if optional and not _has(layer, name):
            return []
        return [name]
    head, tail = name.split(".*.", 1)
    if not _has(layer, head):
        return []
    container = layer.get_submodule(head)
    if not isinstance(container, nn.ModuleList):
        raise UnknownArchitectureError(
            f"{head} is not a list of experts ({type(container).__name__}); unfuse the experts first "
            "(bitmosaic.modules.experts.unfuse_experts(model))"
        )
    return [f"{head}.{i}.{tail}" for i in range(len(container))]


def _has(layer: nn.Module, name: str) -> bool:
    try:
        layer.get_submodule(name)
    except AttributeError:
        return False
    return True


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
    rotation=RotationMap(
        refuse="it normalises the attention and MLP outputs (post-norms with their own scales) before the "
        "residual add, which a residual-stream rotation cannot pass through"
    ),
)

PHI3 = ArchSpec(
    layers_path="model.layers",
    sequential=(("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)),
    # o_proj and down_proj read slices of fused projections: not foldable per channel here
    smooth_prev=("input_layernorm", None, "post_attention_layernorm", None),
    rotation=RotationMap(
        norms=(
            ("input_layernorm", ("self_attn.qkv_proj",)),
            ("post_attention_layernorm", ("mlp.gate_up_proj",)),
        ),
        value="self_attn.qkv_proj",
        value_tail=True,
    ),
)

# Mixture of experts (transformers 5: the experts fused into 3-D parameters, unfused into one linear per
# expert projection by bitmosaic.modules.experts before a run).  Each expert's gate/up read its routed
# rows of the post-attention norm's output; the router (``mlp.gate``) stays float.  A routed expert's
# factors cannot be folded into the norm (every expert reads it), so the experts' groups are unsmoothed.
QWEN3_MOE = ArchSpec(
    layers_path="model.layers",
    sequential=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj"),
        ("mlp.experts.*.down_proj",),
    ),
    smooth_prev=("input_layernorm", "self_attn.v_proj", None, None),
    rotation=RotationMap(refuse="its experts are not rotated yet (the router and every expert read the "
                         "rotated stream)"),  # fmt: skip
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
    "olmo2": dataclasses.replace(
        LLAMA_LIKE,
        smooth_prev=(None, "self_attn.v_proj", None, "mlp.up_proj"),
        rotation=RotationMap(
            refuse="it normalises after attention and MLP (post-norm blocks), which a "
            "residual-stream rotation cannot pass through"
        ),
    ),
    "granite": LLAMA_LIKE,
    "phi3": PHI3,
    "qwen3_moe": QWEN3_MOE,
    "mixtral": QWEN3_MOE,
    "olmoe": QWEN3_MOE,
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
