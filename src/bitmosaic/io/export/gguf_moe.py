"""GGUF export of a mixture-of-experts model (issue 71, item 5): llama.cpp's layout and metadata.

bitmosaic quantizes a MoE model one linear per expert projection (``model.layers.N.mlp.experts.E.
{gate,up,down}_proj``, :mod:`bitmosaic.modules.experts`); llama.cpp keeps a layer's experts of one
projection in one 3-D tensor, ``blk.N.ffn_{gate,up,down}_exps.weight`` of ggml shape ``{in, out, E}``
(numpy ``[E, out, in]``), whose experts therefore share one GGML type.  :func:`stack_experts` stacks the
experts' GGUF blocks (each expert written exactly as the dense path writes a linear) along a new first
axis; :func:`unify_expert_types` first makes the experts of one tensor agree on a type (the narrowest
that holds all of them exactly).  The router ``mlp.gate`` is ``blk.N.ffn_gate_inp.weight`` (float),
Qwen2-MoE's shared expert ``ffn_{gate,up,down}_shexp`` and its gate ``ffn_gate_inp_shexp`` (1-D):
the names of gguf-py's tensor map for the architecture.

The architecture metadata comes from the Hugging Face config (:func:`hf_metadata`): ``qwen3_moe`` ->
``qwen3moe``, ``qwen2_moe`` -> ``qwen2moe``, ``olmoe`` -> ``olmoe`` and ``mixtral`` -> ``llama`` with
experts (q/k rows permuted to llama.cpp's rope order, :func:`llama_rows`), with ``{arch}.expert_count``,
``expert_used_count``, ``expert_feed_forward_length`` (``expert_shared_feed_forward_length``).
llama.cpp fixes per architecture whether the top-k routing weights are renormalised (qwen3moe and
llama: yes; qwen2moe and olmoe: no), so a config whose ``norm_topk_prob`` says otherwise is refused
(the file would compute another function), as are rope scaling, sliding windows, dense layers between
the MoE layers, q/k/v clipping and activations other than SiLU.  The tokenizer: the ``tokenizer.*``
keys of a GGUF of the same model (``--source-gguf``, e.g. ``convert_hf_to_gguf.py --vocab-only``); a
folder without a tokenizer gets llama.cpp's ``tokenizer.ggml.model = "none"`` (token ids only) and
``{arch}.vocab_size``; converting a Hugging Face tokenizer is not implemented (refused, naming the fix).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .layers import ExportError

__all__ = ["MOE_ARCHS", "expert_base", "gguf_name", "hf_metadata", "llama_rows", "stack_experts",
           "tokenizer_metadata", "unify_expert_types"]  # fmt: skip

# model_type -> (GGUF architecture, whether llama.cpp renormalises the top-k routing weights)
MOE_ARCHS = {"qwen3_moe": ("qwen3moe", True), "qwen2_moe": ("qwen2moe", False),
             "olmoe": ("olmoe", False), "mixtral": ("llama", True)}  # fmt: skip
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.([^.]+)$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def expert_base(name: str) -> tuple[str, int] | None:
    """``("model.layers.N.mlp.experts.gate_proj", E)`` for an expert projection ``...experts.E.gate_proj``."""
    m = _EXPERT.match(name)
    return (f"{m.group(1)}.{m.group(3)}", int(m.group(2))) if m else None


def _arch(config: dict) -> tuple[str, bool]:
    mt = config.get("model_type")
    if mt not in MOE_ARCHS:
        raise ExportError(
            f"cannot export as gguf: no llama.cpp layout for the mixture-of-experts model_type {mt!r} "
            f"(exported: {', '.join(MOE_ARCHS)}); use --format compressed-tensors or gptq"
        )
    return MOE_ARCHS[mt]


def gguf_name(name: str, config: dict) -> str:
    """The GGUF tensor name of the model's tensor ``name`` (an expert's: its stacked tensor's)."""
    import gguf

    arch, _ = _arch(config)
    base, suffix = name.rsplit(".", 1)
    e = expert_base(base)
    if e is not None:
        base = e[0]
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    g = gguf.get_tensor_name_map(arch_id, int(config["num_hidden_layers"])).get_name(base)
    if g is None:
        raise ExportError(f"cannot export as gguf: tensor {name} has no GGUF name for {arch!r}")
    return f"{g}.{suffix}"


def llama_rows(gname: str, data: np.ndarray, config: dict) -> np.ndarray:
    """llama.cpp's ``llama`` architecture stores q/k rows in its rope order: Hugging Face's rows
    ``(head, half, i)`` go to ``(head, i, half)`` (per head of q, per kv head of k); other archs as is.
    Block rows move whole, so a quantized tensor's bytes permute exactly."""
    if _arch(config)[0] != "llama":
        return data
    heads = config["num_attention_heads"]
    n = heads if ".attn_q." in gname else config.get("num_key_value_heads") or heads
    if ".attn_q." not in gname and ".attn_k." not in gname:
        return data
    rows = data.shape[0]
    return data.reshape(n, 2, rows // n // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)


def _rope_theta(config: dict) -> float:
    rp = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = rp.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind not in (None, "default"):
        raise ExportError(
            f"cannot export as gguf: rope scaling {kind!r} is not written by the MoE GGUF export (llama.cpp "
            "would run plain rope); use --format compressed-tensors or gptq"
        )
    return float(rp.get("rope_theta", config.get("rope_theta", 10000.0)))


def _check_routing(config: dict, arch: str, renorm: bool) -> None:
    mt, heads = config["model_type"], config["num_attention_heads"]
    norm = True if mt == "mixtral" else bool(config.get("norm_topk_prob", False))
    why = None
    if norm != renorm:
        why = (f"norm_topk_prob={norm} while llama.cpp's {arch} always "
               f"{'renormalises' if renorm else 'keeps'} the top-k routing weights")  # fmt: skip
    elif config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
        why = f"dense MLP layers between the MoE layers, which llama.cpp's {arch} does not have"
    elif config.get("use_sliding_window") or (mt == "mixtral" and config.get("sliding_window")):
        why = f"a sliding attention window, which llama.cpp's {arch} does not apply"
    elif arch == "olmoe" and (config.get("num_key_value_heads") or heads) != heads:
        why = "grouped kv heads, while llama.cpp's olmoe norms k over all hidden_size channels"
    elif config.get("clip_qkv") is not None:
        why = f"clip_qkv={config['clip_qkv']} (llama.cpp's {arch} does not clip q/k/v)"
    elif config.get("hidden_act", "silu") != "silu":
        why = f"the activation {config.get('hidden_act')!r} (llama.cpp's {arch} runs SiLU)"
    if why:
        raise ExportError(
            f"cannot export as gguf: the config has {why}; use --format compressed-tensors or gptq"
        )


def hf_metadata(config: dict, experts: int) -> tuple[str, list[tuple]]:
    """``(GGUF architecture, [(key, value, GGUF value type, None)])`` of the model from its Hugging Face
    ``config`` (type ``None``: a string); refuses in one line what llama.cpp would compute differently."""
    arch, renorm = _arch(config)
    _check_routing(config, arch, renorm)
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    moe_ff = config.get("moe_intermediate_size") or config["intermediate_size"]
    u32 = {
        "context_length": config.get("max_position_embeddings", 4096),
        "embedding_length": hidden,
        "block_count": config["num_hidden_layers"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": heads,
        "attention.head_count_kv": config.get("num_key_value_heads") or heads,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "rope.dimension_count": head_dim,
        "expert_count": experts,
        "expert_used_count": config["num_experts_per_tok"],
        "expert_feed_forward_length": moe_ff,
        "vocab_size": config["vocab_size"],
    }
    if config.get("shared_expert_intermediate_size"):
        u32["expert_shared_feed_forward_length"] = config["shared_expert_intermediate_size"]
    from gguf import GGUFValueType as V

    kv = [(f"{arch}.{k}", int(v), V.UINT32, None) for k, v in u32.items()]
    eps = float(config.get("rms_norm_eps", 1e-6))
    kv.append((f"{arch}.attention.layer_norm_rms_epsilon", eps, V.FLOAT32, None))
    kv.append((f"{arch}.rope.freq_base", _rope_theta(config), V.FLOAT32, None))
    if config.get("_name_or_path"):
        kv.append(("general.name", Path(str(config["_name_or_path"])).name, None, None))
    return arch, kv


def tokenizer_metadata(src: Path, source_gguf: Path | None) -> list:
    """The tokenizer keys: the ``tokenizer.*`` fields of ``source_gguf`` (``(key, value, type, sub)``),
    llama.cpp's no-vocabulary mode for a folder without a tokenizer, else a one-line refusal."""
    if source_gguf is not None:
        import gguf

        reader = gguf.GGUFReader(str(source_gguf))
        out = []
        for key, f in reader.fields.items():
            if key.startswith("tokenizer."):
                sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
                out.append((key, f.contents(), f.types[0], sub))
        if not out:
            raise ExportError(
                f"--source-gguf {source_gguf} holds no tokenizer.* keys; give a GGUF with the vocabulary"
            )
        return out
    has = [n for n in _TOKENIZER_FILES if (src / n).is_file()]
    if has:
        raise ExportError(
            f"cannot export as gguf: converting the Hugging Face tokenizer ({has[0]}) is not implemented; "
            "pass --source-gguf FILE with a GGUF of the same model (e.g. llama.cpp's convert_hf_to_gguf.py "
            "--vocab-only), whose tokenizer is copied"
        )
    return [("tokenizer.ggml.model", "none", None, None)]


def unify_expert_types(blocks: dict, changes: dict, redo) -> list[str]:
    """Make the experts of one stacked tensor share one GGML type (llama.cpp's 3-D tensor has one):
    where a layer's experts came out in different types (e.g. Q4_1 and, where the fp16 offsets cannot
    hold an expert's, Q5_0), every expert of it is rewritten by ``redo(type, names)`` -- ``{name:
    (bytes, type)}`` or ``None`` when some expert has no exact form -- in the first of its types (in
    ``order`` of size) that holds all of them exactly.  Returns notes; refuses in one line when no
    type holds them all."""
    from .gguf_blocks import BLOCK_TYPES

    order = [*BLOCK_TYPES, "F16", "BF16", "F32"]
    groups: dict[str, list[str]] = {}
    for name in blocks:
        e = expert_base(name)
        if e is not None:
            groups.setdefault(e[0], []).append(name)
    notes = []
    for base, names in groups.items():
        types = {blocks[n][1] for n in names}
        if len(types) == 1:
            continue
        tried = sorted(types, key=lambda t: order.index(t) if t in order else len(order))
        for typ in tried:
            got = redo(typ, names)
            if got is not None:
                blocks.update(got)
                notes.append(f"the experts of {base} written in one type, {typ} (llama.cpp stacks them)")
                break
        else:
            raise ExportError(
                f"cannot export as gguf: the experts of {base} need one GGML type (llama.cpp stacks them "
                f"into one tensor) and none of {', '.join(tried)} holds all of them exactly; "
                "pass --gguf-type F32 (exact) or a wider type that holds them all (e.g. Q8_0)"
            )
        for n in names:
            changes.setdefault(n, [])
    return notes


def stack_experts(tensors: dict, config: dict) -> dict[str, tuple[np.ndarray, str]]:
    """``{GGUF name: (data, type)}`` of ``tensors`` (``{model name: (data, type)}``): each layer's
    experts of one projection stacked in expert order into ``[E, out, ...]`` (all experts present, one
    type); every other tensor under its own GGUF name (q/k rows in llama.cpp's order for ``llama``;
    the shared-expert gate ``[1, hidden]`` as the 1-D tensor llama.cpp reads)."""
    out: dict[str, tuple[np.ndarray, str]] = {}
    stacks: dict[str, dict[int, tuple[np.ndarray, str]]] = {}
    for name, (data, typ) in tensors.items():
        e = expert_base(name.rsplit(".", 1)[0])
        g = gguf_name(name, config)
        if e is not None:
            stacks.setdefault(g, {})[e[1]] = (data, typ)
            continue
        if g.endswith("ffn_gate_inp_shexp.weight") and data.ndim == 2 and data.shape[0] == 1:
            data = data.reshape(-1)
        out[g] = (llama_rows(g, data, config), typ)
    for g, parts in stacks.items():
        types = {t for _, t in parts.values()}
        if sorted(parts) != list(range(len(parts))) or len(types) != 1:
            raise RuntimeError(
                f"internal error: the experts of {g} are incomplete or of several types {types}"
            )
        out[g] = (np.stack([parts[i][0] for i in range(len(parts))]), types.pop())
    return out
