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
- rotation (``--rotate``, :mod:`bitmosaic.pipeline.rotate`): the post-attention norm's readers are the
  router (a module with a float ``weight [E, H]``, not an ``nn.Linear``; gpt-oss's bias stays as it
  is), every routed expert's gate/up, a shared expert's gate/up and Qwen2-MoE's one-row
  ``shared_expert_gate``, or a dense layer's gate/up: each gets the norm's scale and R1 (``W Q``);
  every expert's (and shared expert's) ``down_proj`` writes the stream (``Qᵀ W``, bias ``b Q``) and
  gets the online Hadamard of its own (expert) width at its input.  The router and gates still stay
  float, rotated.  Names a layer lacks are ``optional`` in the rotation map too, so each layer
  rotates what it has (Qwen-MoE ``mlp_only_layers``, DeepSeek's first dense layers).
"""

from __future__ import annotations

import dataclasses

from .spec import ArchSpec, RotationMap

__all__ = ["MOE_ARCHS", "QWEN3_MOE", "OLMOE", "QWEN2_MOE", "DEEPSEEK_V3", "GPT_OSS"]

_ATTN = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",))
_ATTN_PREV = ("input_layernorm", "self_attn.v_proj")
_DENSE = (("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
_DENSE_PREV = ("post_attention_layernorm", "mlp.up_proj")
_EXPERTS = (("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj"), ("mlp.experts.*.down_proj",))
_QKV = _ATTN[0]
_Q_A = ("self_attn.q_a_proj", "self_attn.q_proj")  # DeepSeek: q_proj only where q_lora_rank is None


def _shared(prefix: str) -> tuple[tuple[str, ...], ...]:
    return (f"{prefix}.gate_proj", f"{prefix}.up_proj"), (f"{prefix}.down_proj",)


def _names(*groups) -> tuple[str, ...]:
    return tuple(n for g in groups for n in g)


def _rotation(
    router: str,
    shared: str | None = None,
    gates: tuple[str, ...] = (),
    attn: tuple[str, ...] = _QKV,
    attn_optional: tuple[str, ...] = (),
    **kw,
) -> RotationMap:
    """The rotation map of an MoE decoder: ``attn`` read the input norm; the post-attention norm is read
    by the router, the routed experts' gate/up, the shared expert ``shared`` and one-row ``gates``
    (MoE layers) or by a dense MLP (dense layers); each ``down_proj`` writes the stream and gets the
    online Hadamard.  The MLP's names are optional (each layer has a dense MLP or experts; a wildcard a
    layer lacks expands to nothing), of the attention's only ``attn_optional``."""
    extra = _shared(shared) if shared else ((), ())
    mlp_in = (*_DENSE[0], router, *_EXPERTS[0], *extra[0], *gates)
    mlp_out = (*_DENSE[1], *_EXPERTS[1], *extra[1])
    return RotationMap(
        norms=(("input_layernorm", attn), ("post_attention_layernorm", mlp_in)),
        writers=("self_attn.o_proj", *mlp_out),
        online=("self_attn.o_proj", *mlp_out),
        optional=(*_names(*_DENSE), router, *extra[0], *extra[1], *gates, *attn_optional),
        **kw,
    )


# Qwen3-MoE, Mixtral, OLMoE (OLMoE's q_norm/k_norm are norms, not linears): attention, a dense MLP in
# the layers ``mlp_only_layers`` names (Qwen3-MoE), routed experts elsewhere.
QWEN3_MOE = ArchSpec(
    layers_path="model.layers",
    sequential=(*_ATTN, *_DENSE, *_EXPERTS),
    smooth_prev=(*_ATTN_PREV, *_DENSE_PREV, None, None),
    rotation=_rotation("mlp.gate"),
    optional=_names(*_DENSE),
)

# OLMoE with ``clip_qkv``: the value states are clamped, and a clamp does not commute with R2
OLMOE = dataclasses.replace(
    QWEN3_MOE,
    rotation=_rotation(
        "mlp.gate",
        refuse_when=(
            (
                "clip_qkv",
                "it clamps the value states (clip_qkv), which R2 on each head's values would change",
            ),
        ),
    ),  # fmt: skip
)

# Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): routed experts plus one shared expert, scaled per token by
# sigmoid(shared_expert_gate(x)) (the gate stays float).
QWEN2_MOE = ArchSpec(
    layers_path="model.layers",
    sequential=(*_ATTN, *_DENSE, *_shared("mlp.shared_expert"), *_EXPERTS),
    smooth_prev=(*_ATTN_PREV, *_DENSE_PREV, None, "mlp.shared_expert.up_proj", None, None),
    rotation=_rotation("mlp.gate", "mlp.shared_expert", ("mlp.shared_expert_gate",)),
    optional=_names(*_DENSE, *_shared("mlp.shared_expert")),
)

# DeepSeek-V3 / R1 (multi-head latent attention): q_a_proj (q_proj when q_lora_rank is None) and
# kv_a_proj_with_mqa read the input norm, q_b_proj reads q_a_layernorm's output, kv_b_proj
# kv_a_layernorm's (the rotary part of kv_a's output bypasses that norm); the first
# ``first_k_dense_replace`` layers have a dense MLP, the others routed experts plus ``mlp.shared_experts``.
# The router ``mlp.gate`` (with its score-correction bias) stays float.  Rotation: q_a_proj (q_proj)
# and kv_a_proj_with_mqa read the input norm, o_proj writes the stream and gets the online Hadamard
# across its heads; q_a_layernorm and kv_a_layernorm normalise latents, not the residual stream, and are
# untouched.  No R2: MLA caches the latent c_KV, not per-head values, so there is no value cache for R2
# to even out, and kv_b_proj's rows interleave each head's key (nope) and value parts, which the
# ``value``/``value_tail`` convention does not describe.
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
    rotation=_rotation(
        "mlp.gate",
        "mlp.shared_experts",
        attn=(*_Q_A, "self_attn.kv_a_proj_with_mqa"),
        attn_optional=_Q_A,
        value=None,
        attn_out=None,
    ),  # fmt: skip
    optional=(
        "self_attn.q_a_proj",
        "self_attn.q_proj",
        "self_attn.q_b_proj",
        *_names(*_DENSE, *_shared("mlp.shared_experts")),
    ),  # fmt: skip
)

# gpt-oss: q/k/v/o with biases and per-head attention sinks (a parameter of the attention, float), the
# experts stored transposed with gate/up interleaved and biased (unfused by modules/experts.py), the
# router ``mlp.router`` (biased) float.  Rotation: the sinks are one logit per head added to the
# attention scores, untouched by R1 (on the projections' inputs) and by R2 (within each head's values);
# the router's bias and the gate/up biases and clamps act on outputs R1 does not change; o_proj's and
# the experts' down_proj biases are rotated with their writers.
GPT_OSS = ArchSpec(
    layers_path="model.layers",
    sequential=(*_ATTN, *_EXPERTS),
    smooth_prev=(*_ATTN_PREV, None, None),
    rotation=_rotation("mlp.router"),
)

MOE_ARCHS: dict[str, ArchSpec] = {
    "qwen2_moe": QWEN2_MOE,
    "qwen3_moe": QWEN3_MOE,
    "mixtral": QWEN3_MOE,
    "olmoe": OLMOE,
    "deepseek_v3": DEEPSEEK_V3,
    "gpt_oss": GPT_OSS,
}
