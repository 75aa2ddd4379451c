"""Tiny random models and a word-level tokenizer, made offline: for tests, benchmarks and examples
that must run without downloads (``bitmosaic.testing.save_hf_dir(path)`` writes a model folder any
``bitmosaic`` command takes as ``--model``).  Random weights: their quality means nothing."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = [
    "NWORDS", "SPECIALS", "VOCAB", "save_hf_dir", "tiny_gemma", "tiny_llama", "word_tokenizer", "words",
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


def save_hf_dir(path: Path, model=None, bos: bool = False) -> Path:
    """A Hugging Face model folder (config, safetensors, tokenizer) of a tiny random model."""
    model = model if model is not None else tiny_llama()
    model.save_pretrained(path)
    word_tokenizer(bos=bos).save_pretrained(path)
    return path
