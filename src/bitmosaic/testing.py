"""Tiny random models and a word-level tokenizer, made offline: for tests, benchmarks and examples
that must run without downloads (``bitmosaic.testing.save_hf_dir(path)`` writes a model folder any
``bitmosaic`` command takes as ``--model``; :func:`quantized_dir` a saved quantized one,
:func:`tiny_gguf` a GGUF file).  Random weights: their quality means nothing."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = [
    "NWORDS", "SPECIALS", "VOCAB", "quantized_dir", "save_hf_dir", "tiny_gemma", "tiny_gguf", "tiny_llama",
    "tiny_moe", "tiny_qwen3_moe", "word_tokenizer", "words",
]  # fmt: skip

VOCAB = 128
SPECIALS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "[UNK]": 3}
NWORDS = VOCAB - len(SPECIALS)


def word_tokenizer(bos: bool = False):
    """Whitespace word-level tokenizer, ``w{i}`` -> id ``i + 4``; ``bos=True`` prepends ``<bos>`` (id 2)
    by default, as the Gemma tokenizers do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {**SPECIALS, **{f"w{i}": i + len(SPECIALS) for i in range(NWORDS)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        t.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=t, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="[UNK]"
    )


def words(n: int, per_line: int = 10) -> str:
    """``n`` words cycling through the vocabulary, ``per_line`` a line."""
    toks = [f"w{i % NWORDS}" for i in range(n)]
    return "".join(" ".join(toks[i : i + per_line]) + " \n" for i in range(0, n, per_line))


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_gemma(seed: int = 0):
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(seed)
    cfg = GemmaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    return GemmaForCausalLM(cfg).eval()


def tiny_qwen3_moe(seed: int = 0, experts: int = 4, top_k: int = 2, hidden: int = 64, layers: int = 2):
    """A tiny random Qwen3-MoE (transformers' own config and model; its experts fused as transformers 5
    stores them), weights ~ N(0, 0.1) so that the routing and the experts' outputs are not negligible."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=128, bos_token_id=2,
        eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.1)
    return model


# per model type: the expert settings of a tiny mixture of experts (4 experts, 2 routed per token)
_MOE = {
    "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 96, "head_dim": 16, "norm_topk_prob": True},
    "mixtral": {"num_local_experts": 4},
    "qwen2_moe": {"num_experts": 4, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
                  "norm_topk_prob": False},  # fmt: skip
    "olmoe": {"num_experts": 4, "num_key_value_heads": 4},  # llama.cpp's olmoe has no grouped kv heads
    # multi-head latent attention (4 heads of 16 + 8 rotary), layer 0 dense, a shared expert of 64
    "deepseek_v3": {"n_routed_experts": 4, "moe_intermediate_size": 64, "first_k_dense_replace": 1,
                    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                    "v_head_dim": 16, "n_group": 1, "topk_group": 1, "num_key_value_heads": 4},  # fmt: skip
    # attention sinks, biased q/k/v/o, router and experts (transposed, gate/up interleaved)
    "gpt_oss": {"num_local_experts": 4, "head_dim": 16, "sliding_window": 8},
}


def tiny_moe(model_type: str = "qwen3_moe", seed: int = 0, **overrides):
    """A random tiny mixture-of-experts model of ``model_type`` from transformers' own config class (2
    layers, hidden 64, 4 heads of 16 with 2 kv heads (OLMoE, DeepSeek-V3: 4), 4 experts of width 96
    (Mixtral, OLMoE, Qwen2-MoE, DeepSeek-V3, gpt-oss: 64; Qwen2-MoE and DeepSeek-V3 also a shared expert
    of 64; DeepSeek-V3's layer 0 a dense MLP), 2 per token, vocabulary 128; every size a
    multiple of 32, as GPTQ and GGUF blocks need); weights and biases drawn from N(0, 0.1), norms left
    at 1.  ``overrides``: other config values."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    opts = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "vocab_size": VOCAB,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 2,
            "max_position_embeddings": 64, **_MOE[model_type], **overrides}  # fmt: skip
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **opts)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim >= 2 or "bias" in n:
                p.normal_(0, 0.1)
    return model


def save_hf_dir(path: Path, model=None, bos: bool = False) -> Path:
    """A Hugging Face model folder (config, safetensors, tokenizer) of a tiny random model."""
    model = model if model is not None else tiny_llama()
    model.save_pretrained(path)
    word_tokenizer(bos=bos).save_pretrained(path)
    return path


def quantized_dir(path: Path, *, tokenizer: bool = True) -> Path:
    """A bitmosaic folder: the tiny Llama quantized with RTN w4 g32."""
    from bitmosaic import quantize_
    from bitmosaic.io import save_quantized

    m = tiny_llama()
    calib = torch.randint(len(SPECIALS), VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    quantize_(m, "rtn", calib, bits=4, group_size=32, progress=False)
    tok = word_tokenizer() if tokenizer else None
    return save_quantized(m, path, {"method": "rtn", "bits": 4, "group_size": 32}, tokenizer=tok)


def tiny_gguf(path, arch: str, tied: bool = True, layers: int = 2, seed: int = 0, name: str = "tiny",
              hidden: int = 64, intermediate: int = 128, vocab: str | None = None,
              block_count: int | None | str = "layers", heads: tuple = (4, 2),
              sizes: dict | None = None):  # fmt: skip
    """A random tiny model of GGUF architecture ``arch`` written with the ``gguf`` package: the tensor
    names gguf-py gives the transformers model's parameters, 2-D weights cycling through Q8_0, Q4_1, F16,
    Q5_0, BF16 and F32, norms and biases F32; no output head when ``tied``.  4 heads (2 kv heads) of
    ``hidden / 4`` (Gemma: 16).  ``vocab``: a ``tokenizer.ggml.model`` (llama.cpp loads a file with
    ``"none"``: token ids only; ``"llama"`` also writes 128 tokens, so transformers loads the tokenizer).
    ``block_count``: the layer count written in the metadata (default
    ``layers``; ``None``: none written).  ``heads``: the head counts written in the metadata (the tensors
    always have 4 and 2); ``sizes``: other metadata sizes written in place of the tensors' own."""
    import gguf
    import numpy as np
    from transformers import AutoConfig, AutoModelForCausalLM

    gemma = arch.startswith("gemma")
    cfg = AutoConfig.for_model({"gemma3": "gemma3_text"}.get(arch, arch), vocab_size=128, hidden_size=hidden,
                               intermediate_size=intermediate, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                               **({"head_dim": 16} if gemma else {}))  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    meta = {"context_length": 64, "block_count": layers if block_count == "layers" else block_count,
             "feed_forward_length": intermediate, "embedding_length": hidden, "vocab_size": 128,
             "attention.head_count": heads[0], "attention.head_count_kv": heads[1]}  # fmt: skip
    for k, v in {**meta, **(sizes or {})}.items():
        if v is not None:
            w.add_uint32(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    if vocab is not None:
        w.add_tokenizer_model(vocab)
    if vocab == "llama":  # a whole SentencePiece-style vocabulary: <unk>, <s>, </s> and 125 byte tokens
        w.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(125)])
        w.add_token_scores([0.0] * 128)
        w.add_token_types([2, 3, 3] + [6] * 125)  # unknown, control, control, bytes
    for k, v in {"bos": 1, "eos": 2, "padding": 0}.items():
        w.add_uint32(f"tokenizer.ggml.{k}_token_id", v)
    if gemma:
        w.add_uint32(f"{arch}.attention.key_length", 16)
        w.add_uint32(f"{arch}.attention.sliding_window", 32)
    if arch == "llama":
        w.add_uint32(f"{arch}.rope.dimension_count", hidden // 4)
    Q = gguf.GGMLQuantizationType
    types = [Q.Q8_0, Q.Q4_1, Q.F16, Q.Q5_0, Q.BF16, Q.F32]
    g = torch.Generator().manual_seed(seed)
    i = 0
    for hf, p in model.state_dict().items():
        if tied and hf == "lm_head.weight":
            continue
        base, suffix = hf.rsplit(".", 1)
        gname = f"{names.get_name(base)}.{suffix}"
        x = (torch.randn(p.shape, generator=g) * 0.1 + (1.0 if "norm" in hf else 0.0)).numpy()
        qt = types[i % len(types)] if x.ndim == 2 else Q.F32
        i += x.ndim == 2
        if qt == Q.F32:
            w.add_tensor(gname, x)
        elif qt == Q.F16:
            w.add_tensor(gname, x.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(x, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
