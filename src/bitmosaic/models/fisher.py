"""Fisher-diagonal weight salience (SFMP §4.1 Eqs. 1-2, App. C, Alg. 1; SqueezeLLM's estimator).

``S = (1/|D|) Σ_samples (∂L/∂W)²`` with ``L`` the causal-LM cross-entropy of one calibration
sample with labels = inputs (the model's own next-token loss).  Each sample is its own forward +
backward, so the squares are *per-sample* squared gradients (Alg. 1).  Only the quantizable
decoder linears' weights require gradients; each one's gradient is squared into a float32
accumulator by a post-accumulate-grad hook and then dropped, so no optimizer state and no
gradient of any other parameter (embeddings, norms, ``lm_head``) is ever kept.

The calibration text is the calibration source (``wikitext2`` = WikiText-2 *valid* split), disjoint
from the evaluation split (``test``).  Results are cached on disk (safetensors), keyed by a hash of
the model (config + a checksum of every salience-bearing weight), the exact calibration tokens
(which fixes data, number of samples, sequence length and seed) and this estimator's version.
Runs where the model is (the whole model takes part in the backward pass).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from .arch import ArchSpec, get_arch

__all__ = ["fisher_salience", "salience_linear_names", "default_cache_dir"]

_VERSION = 1


def default_cache_dir() -> Path:
    root = os.environ.get("BITMOSAIC_CACHE") or Path.home() / ".cache" / "bitmosaic"
    return Path(root) / "fisher"


def salience_linear_names(model: nn.Module, arch: ArchSpec | None = None) -> list[str]:
    """Qualified names of the quantizable decoder linears (``lm_head`` is not one of them)."""
    arch = arch or get_arch(model)
    n = len(arch.layers(model))
    return [f"{arch.layers_path}.{i}.{name}" for i in range(n) for name in arch.linear_names()]


def _cache_key(model: nn.Module, names: list[str], tokens: torch.Tensor) -> str:
    h = hashlib.sha256()
    cfg = getattr(model, "config", None)
    h.update(json.dumps(cfg.to_dict() if cfg is not None else {}, sort_keys=True, default=str).encode())
    for n in names:
        w = model.get_submodule(n).weight.detach()
        h.update(
            f"{n}:{tuple(w.shape)}:{float(w.double().sum()):.17g}:{float(w.double().abs().sum()):.17g}".encode()
        )
    t = tokens.to(torch.int64).cpu().contiguous()
    h.update(str(tuple(t.shape)).encode())
    h.update(t.numpy().tobytes())
    h.update(f"v{_VERSION}".encode())
    return h.hexdigest()[:24]


def fisher_salience(
    model: nn.Module,
    tokens: torch.Tensor,
    names: list[str] | None = None,
    *,
    cache_dir: str | os.PathLike | None = "auto",
    progress: bool = True,
) -> tuple[dict[str, torch.Tensor], dict]:
    """``({name: S [out, in] float32}, info)`` for the decoder linears ``names`` (default: all).

    ``tokens``: ``[n, seqlen]`` calibration ids, one sample per backward.  ``cache_dir``: a folder,
    ``"auto"`` (:func:`default_cache_dir`) or ``None`` (no cache).  ``info`` has ``seconds`` (the
    estimation's wall time; ~0 and ``cached: True`` when loaded), ``samples``, ``seqlen``, ``key``.
    """
    from safetensors.torch import load_file, save_file

    names = names or salience_linear_names(model)
    if tokens.dim() != 2 or tokens.shape[0] < 1:
        raise ValueError(f"Fisher tokens must be [samples >= 1, seqlen], got {tuple(tokens.shape)}")
    key = _cache_key(model, names, tokens)
    info = {"samples": int(tokens.shape[0]), "seqlen": int(tokens.shape[1]), "key": key, "cached": False}
    path = None
    if cache_dir is not None:
        path = (default_cache_dir() if cache_dir == "auto" else Path(cache_dir)) / f"{key}.safetensors"
        if path.is_file():
            t0 = time.perf_counter()
            sal = load_file(str(path))
            if set(sal) == set(names):
                return sal, {**info, "cached": True, "seconds": 0.0, "load_seconds": time.perf_counter() - t0,
                             "path": str(path)}  # fmt: skip
    t0 = time.perf_counter()
    sal = _estimate(model, tokens, names, progress)
    info["seconds"] = time.perf_counter() - t0
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({n: s.contiguous() for n, s in sal.items()}, str(tmp))
        os.replace(tmp, path)
        info["path"] = str(path)
    return sal, info


def _estimate(
    model: nn.Module, tokens: torch.Tensor, names: list[str], progress: bool
) -> dict[str, torch.Tensor]:
    params = {n: model.get_submodule(n).weight for n in names}
    dev = next(iter(params.values())).device
    acc = {n: torch.zeros(p.shape, dtype=torch.float32, device=dev) for n, p in params.items()}
    saved = {id(p): p.requires_grad for p in model.parameters()}
    was_training = model.training
    handles = []

    def make_hook(n):
        def hook(p):
            acc[n].addcmul_(p.grad.float(), p.grad.float())
            p.grad = None  # keep no gradient: the square is all we need

        return hook

    try:
        model.eval()  # no dropout: the gradient of the model as it will be used
        for p in model.parameters():
            p.requires_grad_(False)
        for n, p in params.items():
            p.requires_grad_(True)
            handles.append(p.register_post_accumulate_grad_hook(make_hook(n)))
        for i in tqdm(range(tokens.shape[0]), desc="fisher", unit="sample", disable=not progress):
            ids = tokens[i : i + 1].to(dev)
            out = model(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
    finally:
        for h in handles:
            h.remove()
        for p in model.parameters():
            p.requires_grad_(saved[id(p)])
            p.grad = None
        model.train(was_training)
    return {n: (a / tokens.shape[0]).cpu() for n, a in acc.items()}
