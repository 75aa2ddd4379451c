"""llama.cpp's per-tensor type mix of a GGUF preset, so ``--method gptq --gguf-type Q4_K_M`` calibrates every
linear for the type llama.cpp's ``llama-quantize`` would give it (issue 72).

Transcribed from ``llama_tensor_get_type_impl`` and ``tensor_type_fallback`` in ``src/llama-quant.cpp`` of
the llama.cpp that llama-cpp-python 0.3.36 vendors, for dense (non-expert, non-Falcon) models, with an
importance matrix (the IQ4 presets' imatrix-less rule, Q5_K for the first eighth of ``ffn_down``, is
left out, and the Q4_0 preset's imatrix rule, Q4_1 for the first eighth of ``ffn_down``, is in: bitmosaic
always calibrates).  ``attn_v`` of the IQ4_NL / IQ4_XS presets is Q5_K where ``n_gqa >= 4``; on a model
llama.cpp calls 70B (:func:`mix_context`: 80 layers of a Llama with grouped queries, Qwen2 or OLMo) an
``attn_v`` of Q3_K or Q4_K becomes Q5_K (every preset but IQ2_XS / IQ2_XXS, whose ``attn_v`` rule comes
first).  ``use_more_bits(i, n)``: the first and last eighth of the layers
and every third in between.  Token embedding and output head are not quantized linears here (the export
writes them in the source file's type).

Fallbacks for an input width that is not a multiple of the type's block (256 for the k-quants and
IQ4_XS): Q2_K, Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL, as llama.cpp's
``tensor_type_fallback`` (Q4_1 / Q5_1 are solved on their own grid, fp16 ``d`` and ``m`` fixed first:
:mod:`bitmosaic.algorithms.gguf_legacy`), so each file has llama.cpp's size.
"""

from __future__ import annotations

import re

from ..errors import OptionError

__all__ = ["PRESETS", "LEGACY_BITS", "L_TYPES", "BLOCK_OF", "mix_context", "tensor_type"]

K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
IQ_TYPES = ("IQ4_NL", "IQ4_XS")
L_TYPES = ("Q4_1", "Q5_1")  # asymmetric legacy types, on their own grid (fp16 mins)
# preset -> the default type of its tensors
PRESETS = {"Q2_K": "Q2_K", "Q3_K_M": "Q3_K", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K",
           "IQ4_XS": "IQ4_XS", "IQ4_NL": "IQ4_NL", "Q3_K": "Q3_K", "Q4_K": "Q4_K", "Q5_K": "Q5_K",
           "Q4_0": "Q4_0"}  # fmt: skip
MIXES = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M")  # the presets with a per-tensor mix (the rest: pure)
BLOCK_OF = {**dict.fromkeys((*K_TYPES, "IQ4_XS"), 256),
            **dict.fromkeys(("IQ4_NL", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"), 32)}  # fmt: skip
FALLBACK = {
    "Q2_K": "Q4_0",
    "Q3_K": "Q4_0",
    "Q4_K": "Q5_0",
    "Q5_K": "Q5_1",
    "Q6_K": "Q8_0",
    "IQ4_XS": "IQ4_NL",
}
LEGACY_BITS = {"Q4_0": 4, "Q5_0": 5, "Q8_0": 8}  # symmetric integer grids, groups of 32
CATEGORY = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
            "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}  # fmt: skip


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def mix_context(config) -> dict:
    """The model facts llama.cpp's mix reads, from a transformers ``config``: ``n_layers``, ``n_gqa``
    (query heads per kv head) and ``llm_70b``, llama.cpp's ``LLM_TYPE_70B`` (``load_hparams``: 80 layers of
    a Llama whose kv heads are fewer than its query heads -- Mistral-named checkpoints convert to that
    architecture --, of Qwen2 or of OLMo)."""
    heads = getattr(config, "num_attention_heads", 1) or 1
    n_layers = getattr(config, "num_hidden_layers", 1) or 1
    n_gqa = heads / (getattr(config, "num_key_value_heads", None) or heads)
    kind = getattr(config, "model_type", None)
    big = n_layers == 80 and (kind in ("qwen2", "olmo") or (kind in ("llama", "mistral") and n_gqa != 1))
    return {"n_layers": n_layers, "n_gqa": n_gqa, "llm_70b": big}


def _mixed(preset: str, category: str | None, i: int, n: int, n_gqa: float) -> str:
    new = PRESETS[preset]
    if preset in ("IQ4_XS", "IQ4_NL") and category == "attn_v" and n_gqa >= 4:
        return "Q5_K"
    if preset == "Q4_0" and category == "ffn_down" and i < n // 8:
        return "Q4_1"  # llama.cpp's guard for the first ffn_down layers, with an imatrix
    if preset not in MIXES or category is None:
        return new
    if category == "attn_v":
        if preset == "Q2_K":
            return "Q4_K" if n_gqa >= 4 else "Q3_K"
        if preset == "Q3_K_M":
            return "Q5_K" if i < 2 else "Q4_K"
        return "Q6_K" if use_more_bits(i, n) else new  # Q4_K_M, Q5_K_M
    if category == "ffn_down":
        if preset == "Q2_K":
            return "Q3_K"
        if preset == "Q3_K_M":
            return "Q5_K" if i < n // 16 else "Q4_K"
        return "Q6_K" if use_more_bits(i, n) else new
    if category == "attn_output":
        return {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K"}.get(preset, new)
    return new


# llama.cpp's 2-bit presets: their attn_v rule comes before (and instead of) the 70B rule
TWO_BIT_PRESETS = ("IQ2_XS", "IQ2_XXS", "IQ2_S", "IQ2_M")


def tensor_type(preset: str, name: str | None, in_features: int, n_layers: int, n_gqa: float,
                llm_70b: bool = False) -> str:  # fmt: skip
    """The GGUF type llama.cpp gives the linear ``name`` (``model.layers.3.self_attn.v_proj``) of
    ``in_features`` inputs under ``preset``, its width fallback applied (module doc; ``llm_70b``:
    :func:`mix_context`)."""
    m = re.search(r"layers\.(\d+)\.(?:[^.]+\.)*?(\w+_proj)$", name or "")
    category = CATEGORY.get(m[2]) if m else None
    if (preset in MIXES or preset in LATTICE_PRESETS) and category is None:
        raise OptionError(
            f"--gguf-type {preset}: cannot tell the role of layer {name or '(unnamed)'} (llama.cpp's mix is "
            "by q/k/v/o/gate/up/down projection); use the plain type (e.g. Q4_K) or a recipe"
        )
    i = int(m[1]) if m else 0
    mix = _lattice_mixed if preset in LATTICE_PRESETS else _mixed
    typ = mix(preset, category, i, n_layers, n_gqa)
    if llm_70b and category == "attn_v" and typ in ("Q3_K", "Q4_K") and preset not in TWO_BIT_PRESETS:
        typ = "Q5_K"  # llama.cpp: 8 heads share attn_v in the 70B models, a few more bits for it
    if in_features % BLOCK_OF[typ]:
        typ = FALLBACK.get(typ, typ)
    if in_features % BLOCK_OF[typ]:
        raise OptionError(
            f"--gguf-type {preset}: layer {name or ''} has {in_features} input columns, not a multiple of "
            f"{BLOCK_OF[typ]} ({typ}; llama.cpp writes such tensors as F16); quantize it with another method "
            "through a recipe override"
        )
    return typ


# -- the lattice presets IQ3_S, IQ2_XS, IQ3_XXS, IQ2_XXS, IQ2_S and IQ2_M (issue 72) ----------------------
# llama_tensor_get_type_impl for LLAMA_FTYPE_MOSTLY_IQ3_S / IQ2_XS / IQ3_XXS / IQ2_XXS / IQ2_S / IQ2_M, dense
# models (n_expert 0), with an importance matrix: IQ3_S gives attn_v Q4_K at n_gqa >= 4 and everything else
# IQ3_S; IQ2_XS and IQ2_XXS give attn_v Q4_K at n_gqa >= 4 else Q2_K, and the first eighth of ffn_down (by
# its count, as llama.cpp's i_ffn_down) Q2_K; IQ3_XXS gives attn_v Q4_K at n_gqa >= 4, attn_output IQ3_S and
# attn_q / attn_k the IQ2_S type.  The presets IQ2_S and IQ2_M (llama_ftype_get_default_type: IQ2_S's
# default type is IQ2_XS, IQ2_M's the IQ2_S type) give attn_v Q4_K at n_gqa >= 4 else IQ3_S, and IQ3_S to
# attn_output and the first eighth of ffn_down.  All fall back to IQ4_NL for input widths that are not a
# multiple of 256 (tensor_type_fallback).
LATTICE = ("IQ3_S", "IQ2_S", "IQ2_XS", "IQ3_XXS", "IQ2_XXS")  # the lattice types gptq solves on
PRESETS.update({t: t for t in LATTICE})
PRESETS.update({"IQ2_S": "IQ2_XS", "IQ2_M": "IQ2_S"})  # llama.cpp's preset -> its default type
LATTICE_PRESETS = ("IQ3_S", "IQ2_XS", "IQ3_XXS", "IQ2_XXS", "IQ2_S", "IQ2_M")
BLOCK_OF.update(dict.fromkeys(LATTICE, 256))
FALLBACK.update(dict.fromkeys(LATTICE, "IQ4_NL"))


def _lattice_mixed(preset: str, category: str | None, i: int, n: int, n_gqa: float) -> str:
    two_bit = preset in ("IQ2_XS", "IQ2_XXS")
    wide = preset in ("IQ2_S", "IQ2_M")  # their attn_v / attn_output / first ffn_down: IQ3_S
    if category == "attn_v":
        if n_gqa >= 4:
            return "Q4_K"
        return "Q2_K" if two_bit else "IQ3_S" if wide else preset
    if (two_bit or wide) and category == "ffn_down" and i < n // 8:
        return "IQ3_S" if wide else "Q2_K"
    if wide and category == "attn_output":
        return "IQ3_S"
    if preset == "IQ3_XXS":
        return {"attn_output": "IQ3_S", "attn_q": "IQ2_S", "attn_k": "IQ2_S"}.get(category, preset)
    return PRESETS[preset]
