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

Mixture of experts (:mod:`bitmosaic.models.moe`: qwen2_moe, qwen3_moe, mixtral, olmoe, deepseek_v3,
gpt_oss).  The fused 3-D experts of transformers 5 are unfused first, one linear per expert
projection (:func:`bitmosaic.modules.experts.unfuse_experts`), and a map names them with a wildcard,
``mlp.experts.*.gate_proj``: :meth:`ArchSpec.groups` expands ``*`` to the experts of each layer.  A
group holds expert projections only or none (shared experts and dense MLPs are groups of their own),
since an expert's Hessian comes from the rows routed to it.  Names a layer may lack (the dense MLP of
the first DeepSeek layers or of Qwen-MoE's ``mlp_only_layers``, a shared expert) are ``optional``; such
a group is empty in that layer and skipped.  Routers (``mlp.gate``, ``mlp.router``) and one-row gates
(``mlp.shared_expert_gate``) are never listed: they stay float.  ``--rotate`` folds R1 into them too
(they read the rotated stream), and the rotation map's names expand per layer the same way
(:meth:`RotationMap.layer_norms`, its own ``optional``).

Multimodal models (gemma3, llava, qwen2_5_vl, qwen3_vl; :data:`MULTIMODAL`): only the language tower
is mapped, at ``model.language_model.layers``, with the map of the text model's own ``model_type``
(``config.text_config``: a llava over a Mistral is mapped as mistral); the vision tower and the
projector are not in the map and stay float.  Saving and loading build the class
``config.architectures`` names (:func:`bitmosaic.io.sources.model_class.auto_model_class`), so a
quantized Qwen2.5-VL loads back as ``Qwen2_5_VLForConditionalGeneration``.  Rotation is refused: the
projector writes image features into the residual stream, which would need R1 too.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from .moe import MOE_ARCHS
from .spec import LLAMA_ROTATION, ArchSpec, RotationMap, UnknownArchitectureError

__all__ = [
    "ArchSpec",
    "ARCHS",
    "LLAMA_ROTATION",
    "MULTIMODAL",
    "RotationMap",
    "register_arch",
    "get_arch",
    "language_tower",
    "UnknownArchitectureError",
]

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

# Multimodal: model_type -> the model_type of its default language tower (config.text_config decides)
MULTIMODAL: dict[str, str] = {
    "gemma3": "gemma3_text",
    "llava": "llama",
    "qwen2_5_vl": "qwen2_5_vl_text",
    "qwen3_vl": "qwen3_vl_text",
}
_TOWER = "model.language_model"
_MM_REFUSE = (
    "it is multimodal: the vision projector writes image features into the residual stream, which "
    "would need the rotation too (not implemented)"
)


def language_tower(spec: ArchSpec) -> ArchSpec:
    """The map of a multimodal model's language tower whose text model has map ``spec``."""
    refuse = spec.rotation.refuse if spec.rotation is not None and spec.rotation.refuse else _MM_REFUSE
    return dataclasses.replace(spec, layers_path=f"{_TOWER}.layers", rotation=RotationMap(refuse=refuse))


ARCHS: dict[str, ArchSpec] = {
    "llama": LLAMA_LIKE,
    "mistral": LLAMA_LIKE,
    "qwen2": LLAMA_LIKE,
    "qwen3": LLAMA_LIKE,  # q_norm/k_norm are norms, not linears
    "gemma": dataclasses.replace(LLAMA_LIKE, norm_offset=1.0),
    "gemma2": GEMMA2_LIKE,
    "gemma3_text": GEMMA2_LIKE,
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
    # the language towers of multimodal models (registered as text models too, for their text_config)
    "qwen2_5_vl_text": LLAMA_LIKE,
    "qwen3_vl_text": LLAMA_LIKE,  # q_norm/k_norm are norms
    **MOE_ARCHS,
}
ARCHS.update({mt: language_tower(ARCHS[text]) for mt, text in MULTIMODAL.items()})


def register_arch(model_type: str, spec: ArchSpec) -> None:
    """Add (or replace) the layer map for a ``config.model_type``."""
    ARCHS[model_type] = spec


def get_arch(model: nn.Module) -> ArchSpec:
    """The map of ``model`` (its ``config.model_type``; a multimodal model: its language tower's, from
    ``config.text_config.model_type``)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    spec = ARCHS.get(model_type)
    if model_type in MULTIMODAL:
        text_type = getattr(getattr(config, "text_config", None), "model_type", None)
        if text_type is not None and text_type != MULTIMODAL[model_type]:
            if text_type not in ARCHS:
                raise UnknownArchitectureError(
                    f"{model_type} model whose language tower is {text_type!r}, which has no layer map; "
                    f"register one with bitmosaic.models.arch.register_arch({text_type!r}, ArchSpec(...)); "
                    f"known: {', '.join(sorted(ARCHS))}"
                )
            spec = language_tower(ARCHS[text_type])
    if spec is None:
        raise UnknownArchitectureError(
            f"architecture {model_type!r} has no layer map. Add one with "
            "bitmosaic.models.arch.register_arch(model_type, ArchSpec(layers_path='model.layers', "
            "sequential=((...q/k/v...), (...o...), (...gate/up...), (...down...)))); "
            f"known: {', '.join(sorted(ARCHS))}"
        )
    return spec
