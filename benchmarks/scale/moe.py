"""Mixture-of-experts shapes for ``real_shapes.py`` (issue 71): their configs, the hub's per-expert
tensor names the writer uses, and the FLOP bound of one MoE decoder layer's GPTQ run.

Shapes (``shapes.py``): ``qwen3-30b-a3b`` (Qwen/Qwen3-30B-A3B's config.json: 48 layers, 128 experts,
top-8, hidden 2048, expert width 768, 32 heads, 4 kv heads, head_dim 128, vocab 151936) and
``deepseek-v3-layer`` (one MoE layer of deepseek-ai/DeepSeek-V3: hidden 7168, 256 routed experts + 1
shared, top-8, expert width 2048, MLA with q_lora 1536, kv_lora 512, qk 128+64, v 128, 128 heads).

The FLOP bound of a MoE layer (:func:`moe_layer_flops`) counts, with ``T`` calibration tokens and ``R =
T k`` routed rows (top-``k`` experts per token):

* forwards: the pipeline's passes, each up to the inputs of one true-sequential group (the q/k/v
  group's pass is free), plus the final one that makes the next layer's inputs -- as ``layer_flops``
  counts a dense layer -- with the experts' work routed: ``2 R`` rows through an expert projection, not
  ``2 T E``; the attention core ``4 T seqlen (heads x head_dim)`` per pass that reaches it;
* Hessians: ``rows x d^2`` per input (upper triangle), the experts' summing to ``R H^2`` (gate/up) and
  ``R I^2`` (down);
* GPTQ per Hessian: Cholesky and triangular inverse ``2 d^3 / 3`` and the column updates ``2 rows d^2``,
  per expert for the experts (``E`` solves of each size);
* the report's error metrics ``w^T H w``: ``2 rows d^2`` per solve.
"""

from __future__ import annotations

_QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
)  # fmt: skip
_DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
    routed_scaling_factor=2.5, first_k_dense_replace=0, num_attention_heads=128, num_key_value_heads=128,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    vocab_size=129280, max_position_embeddings=163840, rms_norm_eps=1e-6,
)  # fmt: skip

MOE_SHAPES: dict[str, dict] = {
    "qwen3-30b-a3b": dict(_QWEN3_30B_A3B, num_hidden_layers=48),
    "deepseek-v3-layer": dict(_DEEPSEEK_V3, num_hidden_layers=1),
    # for a quick end-to-end check of the writer, the run and the check
    "qwen3-moe-tiny": dict(_QWEN3_30B_A3B, hidden_size=128, moe_intermediate_size=64, num_experts=8,
                           num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           vocab_size=1024, num_hidden_layers=3),
}


def moe_config(shape: str, layers: int | None = None):
    """The transformers config of ``shape`` (``layers``: a truncated checkpoint of that many layers)."""
    from transformers import AutoConfig

    fields = dict(MOE_SHAPES[shape])
    if layers:
        fields["num_hidden_layers"] = layers
    mt = fields.pop("model_type")
    return AutoConfig.for_model(mt, **fields, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                                torch_dtype="bfloat16")  # fmt: skip


def hub_names(names: dict[str, tuple]) -> dict[str, tuple]:
    """transformers 5's parameter names and shapes -> the hub's: each fused ``mlp.experts.gate_up_proj``
    ``[E, 2I, H]`` as ``mlp.experts.<e>.gate_proj.weight`` / ``up_proj.weight`` ``[I, H]``, and
    ``mlp.experts.down_proj`` ``[E, H, I]`` as ``mlp.experts.<e>.down_proj.weight``."""
    out = {}
    for n, shape in names.items():
        if n.endswith(".experts.gate_up_proj") and len(shape) == 3:
            base = n[: -len("gate_up_proj")]
            for e in range(shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = (shape[1] // 2, shape[2])
                out[f"{base}{e}.up_proj.weight"] = (shape[1] // 2, shape[2])
        elif n.endswith(".experts.down_proj") and len(shape) == 3:
            base = n[: -len("down_proj")]
            for e in range(shape[0]):
                out[f"{base}{e}.down_proj.weight"] = tuple(shape[1:])
        else:
            out[n] = shape
    return out


def _attention(s: dict) -> tuple[list[list[tuple]], int]:
    """The attention's groups ``[(out rows, in, copies, rows seen / T)]`` (q/k/v-like, o) and the width
    of its core (heads x the q.k and v head dims)."""
    h, nh = s["hidden_size"], s["num_attention_heads"]
    if "kv_lora_rank" in s:  # MLA: q_a/kv_a read the norm; q_b, kv_b read their own norms; o
        qk = s["qk_nope_head_dim"] + s["qk_rope_head_dim"]
        first = [(s["q_lora_rank"] + s["kv_lora_rank"] + s["qk_rope_head_dim"], h, 1, 1.0)]
        second = [(nh * qk, s["q_lora_rank"], 1, 1.0),
                  (nh * (s["qk_nope_head_dim"] + s["v_head_dim"]), s["kv_lora_rank"], 1, 1.0)]  # fmt: skip
        return [first, second, [(h, nh * s["v_head_dim"], 1, 1.0)]], nh * (qk + s["v_head_dim"]) // 2
    hd = s.get("head_dim") or h // nh
    kv = s["num_key_value_heads"] * hd
    return [[(nh * hd + 2 * kv, h, 1, 1.0)], [(h, nh * hd, 1, 1.0)]], nh * hd


def moe_layer_flops(shape: str, tokens: int, seqlen: int = 512) -> dict:
    """FLOPs of one MoE decoder layer's GPTQ run (module doc)."""
    s = MOE_SHAPES[shape]
    h, inter = s["hidden_size"], s["moe_intermediate_size"]
    E = s.get("num_experts") or s["n_routed_experts"]
    k = s["num_experts_per_tok"]
    attn, core = _attention(s)
    share = k / E  # rows an expert sees per token, on average
    shared = s.get("n_shared_experts") or 0
    gu = [(2 * inter, h, E, share)] + ([(2 * inter * shared, h, 1, 1.0)] if shared else [])
    down = [(h, inter, E, share)] + ([(h, inter * shared, 1, 1.0)] if shared else [])
    groups = [*attn, gu, down]
    n_attn = len(attn)

    def pass_cost(upto: int) -> float:  # a pass through groups[:upto]
        lin = sum(2 * tokens * r * o * d * c for g in groups[:upto] for o, d, c, r in g)
        return lin + (4 * tokens * seqlen * core if upto >= n_attn else 0)

    forward = sum(pass_cost(g) for g in range(1, len(groups))) + pass_cost(len(groups))
    hess = solve = metrics = 0.0
    for g in groups:
        d_seen = {}
        for o, d, c, r in g:  # linears of a group that read one input share its Hessian
            d_seen.setdefault((d, c, r), 0)
            d_seen[(d, c, r)] += o
        for (d, c, r), rows in d_seen.items():
            hess += c * tokens * r * d * d
            solve += c * (2 * d**3 / 3 + 2 * rows * d * d)
            metrics += c * 2 * rows * d * d
    return {"forward": forward, "hessian": hess, "gptq": solve, "metrics": metrics,
            "total": forward + hess + solve + metrics}  # fmt: skip
