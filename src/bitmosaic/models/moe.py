"""Layer maps of mixture-of-experts models (registered in :data:`bitmosaic.models.arch.ARCHS`).

transformers 5 fuses a layer's routed experts into 3-D parameters; a run first unfuses them into one
linear per expert projection (:func:`bitmosaic.modules.experts.unfuse_experts`), named
``mlp.experts.<e>.{gate,up,down}_proj`` as the hub checkpoints of Qwen-MoE, DeepSeek and OLMoE name them,
and the maps name them with a ``*`` wildcard.  Conventions (the :mod:`bitmosaic.models.arch` docstring
has the general ones):

- the router (``mlp.gate``, gpt-oss ``mlp.router``) and Qwen2-MoE's one-row ``mlp.shared_expert_gate``
  are not in the maps: they stay float (a routing decision flipped by rounding moves a whole token);
- routed experts, a shared expert and a dense MLP are groups of their own (a group is either all
  expert projections or none): the experts' Hessians come from their routed rows, weighted by the
  routing weight (:mod:`bitmosaic.pipeline.experts`), the others' from every token;
- layers whose MLP is dense (Qwen-MoE ``mlp_only_layers`` / ``decoder_sparse_step``, DeepSeek's first
  ``first_k_dense_replace`` layers) have ``mlp.gate_proj``/``up_proj``/``down_proj`` and no experts: those
  names and the shared expert's are ``optional``, and an expert wildcard a layer lacks expands to nothing;
- ``smooth_prev``: the post-attention norm feeds the router and every expert too, so no factor can be
  folded into it for a routed or shared expert (``None``); a dense layer's gate/up may use it (only
  they read it there), and a shared expert's down_proj folds into its own up_proj;
- rotation (``--rotate``) is refused: the router and every expert read the rotated stream, and that
  fold is not implemented yet.
"""

from __future__ import annotations

from .spec import ArchSpec, RotationMap

__all__ = ["MOE_ARCHS", "QWEN3_MOE", "QWEN2_MOE", "DEEPSEEK_V3", "GPT_OSS"]

_ATTN = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",))
_ATTN_PREV = ("input_layernorm", "self_attn.v_proj")
_DENSE = (("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
_DENSE_PREV = ("post_attention_layernorm", "mlp.up_proj")
_EXPERTS = (("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj"), ("mlp.experts.*.down_proj",))
_REFUSE = RotationMap(
    refuse="its experts are not rotated yet (the router and every expert read the rotated stream)"
)


def _shared(prefix: str) -> tuple[tuple[str, ...], ...]:
    return (f"{prefix}.gate_proj", f"{prefix}.up_proj"), (f"{prefix}.down_proj",)


def _names(*groups) -> tuple[str, ...]:
    return tuple(n for g in groups for n in g)


# Qwen3-MoE, Mixtral, OLMoE (OLMoE's q_norm/k_norm are norms, not linears): attention, a dense MLP in
# the layers ``mlp_only_layers`` names (Qwen3-MoE), routed experts elsewhere.
QWEN3_MOE = ArchSpec(
    layers_path="model.layers",
    sequential=(*_ATTN, *_DENSE, *_EXPERTS),
    smooth_prev=(*_ATTN_PREV, *_DENSE_PREV, None, None),
    rotation=_REFUSE,
    optional=_names(*_DENSE),
)

# Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): routed experts plus one shared expert, scaled per token by
# sigmoid(shared_expert_gate(x)) (the gate stays float).
QWEN2_MOE = ArchSpec(
    layers_path="model.layers",
    sequential=(*_ATTN, *_DENSE, *_shared("mlp.shared_expert"), *_EXPERTS),
    smooth_prev=(*_ATTN_PREV, *_DENSE_PREV, None, "mlp.shared_expert.up_proj", None, None),
    rotation=_REFUSE,
    optional=_names(*_DENSE, *_shared("mlp.shared_expert")),
)

# DeepSeek-V3 / R1 (multi-head latent attention): q_a_proj (q_proj when q_lora_rank is None) and
# kv_a_proj_with_mqa read the input norm, q_b_proj reads q_a_layernorm's output, kv_b_proj
# kv_a_layernorm's (the rotary part of kv_a's output bypasses that norm); the first
# ``first_k_dense_replace`` layers have a dense MLP, the others routed experts plus ``mlp.shared_experts``.
# The router ``mlp.gate`` (with its score-correction bias) stays float.
DEEPSEEK_V3 = ArchSpec(
    layers_path="model.layers",
    sequential=(
        ("self_attn.q_a_proj", "self_attn.q_proj", "self_attn.kv_a_proj_with_mqa"),
        ("self_attn.q_b_proj",),
        ("self_attn.kv_b_proj",),
        ("self_attn.o_proj",),
        *_DENSE,
        *_shared("mlp.shared_experts"),
        *_EXPERTS,
    ),
    smooth_prev=(
        "input_layernorm",
        "self_attn.q_a_layernorm",
        "self_attn.kv_a_layernorm",
        None,
        *_DENSE_PREV,
        None,
        "mlp.shared_experts.up_proj",
        None,
        None,
    ),  # fmt: skip
    rotation=_REFUSE,
    optional=(
        "self_attn.q_a_proj",
        "self_attn.q_proj",
        "self_attn.q_b_proj",
        *_names(*_DENSE, *_shared("mlp.shared_experts")),
    ),  # fmt: skip
)

# gpt-oss: q/k/v/o with biases and per-head attention sinks (a parameter of the attention, float), the
# experts stored transposed with gate/up interleaved and biased (unfused by modules/experts.py), the
# router ``mlp.router`` (biased) float.
GPT_OSS = ArchSpec(
    layers_path="model.layers",
    sequential=(*_ATTN, *_EXPERTS),
    smooth_prev=(*_ATTN_PREV, None, None),
    rotation=_REFUSE,
)

MOE_ARCHS: dict[str, ArchSpec] = {
    "qwen2_moe": QWEN2_MOE,
    "qwen3_moe": QWEN3_MOE,
    "mixtral": QWEN3_MOE,
    "olmoe": QWEN3_MOE,
    "deepseek_v3": DEEPSEEK_V3,
    "gpt_oss": GPT_OSS,
}
