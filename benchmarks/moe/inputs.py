"""Real WikiText-2 token embeddings for the MoE benchmarks' random-weight layers.

No trained MoE fits this machine, so the benchmarks feed random MoE layers the *real* token
distribution: WikiText-2 calibration windows (``wikitext-2/valid.txt``, drawn as ``bitmosaic quantize``
draws them), tokenized by SmolLM2-135M's tokenizer and embedded by its trained embedding table (576
wide), lifted to the layers' width by a fixed random orthonormal map (scaled so a channel's RMS is 1).
Token frequencies, repetitions and the embedding's anisotropy are real; the routing of a random
router on them is not that of a trained model (simulated).
"""

from __future__ import annotations

import torch

from bitmosaic.data import calibration_samples

__all__ = ["wikitext_embeddings", "wikitext_hidden", "wikitext_ids", "lifted_embeddings", "SIMULATED"]

SIMULATED = (
    "simulated: random layer weights (router included) fed real WikiText-2 token embeddings (SmolLM2-135M's "
    "tokenizer and embedding table, lifted to the layer width by a fixed random orthonormal map); a trained "
    "router routes differently (typically more skewed), so these counts are not those of a trained model"
)


def _smollm():
    from bitmosaic.io import load_model

    return load_model("smollm2-135m")


def wikitext_ids(nsamples: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """``[nsamples, seqlen]`` WikiText-2 calibration windows in SmolLM2's tokens (as ``quantize`` draws
    them)."""
    _, tok = _smollm()
    return calibration_samples(tok, "wikitext2", nsamples, seqlen, seed=seed)


def lifted_embeddings(width: int, seed: int = 0) -> torch.Tensor:
    """SmolLM2's trained embedding table ``[vocab, 576]`` lifted to ``[vocab, width]`` (module doc)."""
    model, _ = _smollm()
    emb = model.get_input_embeddings().weight.detach().float()
    x = _lift(emb, width, seed)
    return x / x.pow(2).mean().sqrt()


def wikitext_embeddings(nsamples: int, seqlen: int, width: int, seed: int = 0) -> torch.Tensor:
    """``[nsamples, seqlen, width]`` float32 (module doc); ``seed`` draws the windows and the lift."""
    model, tok = _smollm()
    ids = calibration_samples(tok, "wikitext2", nsamples, seqlen, seed=seed)
    with torch.no_grad():
        emb = model.get_input_embeddings()(ids).float()  # [n, seqlen, 576]
    del model
    x = _lift(emb, width, seed)
    return x / x.pow(2).mean().sqrt()


@torch.no_grad()
def wikitext_hidden(nsamples: int, seqlen: int, width: int, layer: int = 8, seed: int = 0) -> torch.Tensor:
    """Like :func:`wikitext_embeddings`, but SmolLM2's residual stream after decoder layer ``layer``
    (contextual: a repeated token gets a different vector in each context), lifted the same way."""
    model, tok = _smollm()
    ids = calibration_samples(tok, "wikitext2", nsamples, seqlen, seed=seed)
    model.model.layers = model.model.layers[:layer]
    out = [model.model(ids[b : b + 8], output_hidden_states=True).hidden_states[layer].float()
           for b in range(0, nsamples, 8)]  # fmt: skip
    del model
    x = _lift(torch.cat(out), width, seed)
    return x / x.pow(2).mean().sqrt()


def _lift(emb: torch.Tensor, width: int, seed: int) -> torch.Tensor:
    """``emb @ lift.T`` with a fixed random ``[width, d]`` map with orthonormal columns (rows when
    narrowing)."""
    g = torch.Generator().manual_seed(seed + 1)
    d = emb.shape[-1]
    q, _ = torch.linalg.qr(torch.randn(max(width, d), min(width, d), generator=g))
    lift = q if width >= d else q.T  # [width, d]: orthonormal columns (or rows, narrowing)
    return emb @ lift.T
