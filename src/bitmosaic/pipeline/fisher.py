"""Fisher-diagonal weight salience, a statistic of the float model a method's ``prepare`` hook asks for.

``S = (1/|D|) Σ_samples (∂L/∂W)²`` with ``L`` the causal-LM cross-entropy of one calibration
sample with labels = inputs (the model's own next-token loss).  Each sample is its own forward +
backward, so the squares are *per-sample* squared gradients (the empirical Fisher diagonal).  Only
the quantizable decoder linears' weights require gradients; each one's gradient is squared into a float32
accumulator by a post-accumulate-grad hook and then dropped, so no optimizer state and no
gradient of any other parameter (embeddings, norms, ``lm_head``) is ever kept.

The calibration text is the calibration source (``wikitext2`` = WikiText-2 *valid* split), disjoint
from the evaluation split (``test``).  Results are cached on disk
(:mod:`bitmosaic.pipeline.calib_cache`, kind ``fisher``), keyed by its one scheme: a hash of the model
(config + a checksum of every salience-bearing weight), the exact calibration tokens (which fixes
data, number of samples, sequence length and seed) and this estimator's version.
Runs where the model is (the whole model takes part in the backward pass).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..models.arch import ArchSpec, get_arch
from .calib_cache import CalibCache, cache_key

__all__ = [
    "fisher_service","fisher_salience", "salience_linear_names"]

_VERSION = 1


def salience_linear_names(model: nn.Module, arch: ArchSpec | None = None) -> list[str]:
    """Qualified names of the quantizable decoder linears (``lm_head`` is not one of them)."""
    arch = arch or get_arch(model)
    layers = arch.layers(model)
    return [f"{arch.layers_path}.{i}.{name}" for i, layer in enumerate(layers)
            for name in arch.layer_linear_names(layer)]  # fmt: skip


def _cache(cache_dir) -> CalibCache:
    if isinstance(cache_dir, CalibCache):
        return cache_dir
    if cache_dir is None or cache_dir == "auto":
        return CalibCache(None if cache_dir is None else "auto")
    return CalibCache(None, dirs={"fisher": Path(cache_dir)})


def fisher_salience(
    model: nn.Module,
    tokens: torch.Tensor,
    names: list[str] | None = None,
    *,
    cache_dir: str | os.PathLike | CalibCache | None = "auto",
    progress: bool = True,
    dist=None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """``({name: S [out, in] float32}, info)`` for the decoder linears ``names`` (default: all).

    ``tokens``: ``[n, seqlen]`` calibration ids, one sample per backward.  ``cache_dir``: the
    folder of the entries, ``"auto"`` (``fisher/`` under
    :func:`~bitmosaic.pipeline.calib_cache.default_cache_root`), a
    :class:`~bitmosaic.pipeline.calib_cache.CalibCache` (its ``fisher/``) or ``None`` (no cache).
    ``info`` has ``seconds`` (the estimation's wall time; ~0 and ``cached: True`` when loaded),
    ``samples``, ``seqlen``, ``key``.  ``dist`` (a :class:`~bitmosaic.pipeline.distributed.Dist`):
    each rank sums the samples ``rank, rank + world, ...``, the sums are added in rank order; a
    cached entry is used only when every rank finds it, and rank 0 stores a new one.
    """
    many = dist is not None and dist.world > 1
    names = names or salience_linear_names(model)
    if tokens.dim() != 2 or tokens.shape[0] < 1:
        raise ValueError(f"Fisher tokens must be [samples >= 1, seqlen], got {tuple(tokens.shape)}")
    weights = [(n, model.get_submodule(n).weight) for n in names]
    key = cache_key(model, tokens, weights, _VERSION)
    info = {"samples": int(tokens.shape[0]), "seqlen": int(tokens.shape[1]), "key": key, "cached": False}
    cache = _cache(cache_dir)
    path = cache.path("fisher", key)
    t0 = time.perf_counter()
    sal = cache.load("fisher", key, lambda v: isinstance(v, dict) and set(v) == set(names))
    if many and not dist.all_true(sal is not None):
        sal = None
    if sal is not None:
        return sal, {**info, "cached": True, "seconds": 0.0, "load_seconds": time.perf_counter() - t0,
                     "path": str(path)}  # fmt: skip
    t0 = time.perf_counter()
    if many:
        sums = _estimate(model, dist.fisher_share(tokens), names, progress, mean=False)
        sal = {n: dist.sum(sums[n]) / tokens.shape[0] for n in names}
    else:
        sal = _estimate(model, tokens, names, progress)
    info["seconds"] = time.perf_counter() - t0
    if (not many or dist.is_main) and cache.store("fisher", key, {n: s.contiguous() for n, s in sal.items()}):
        info["path"] = str(path)
    return sal, info


def fisher_service(model: nn.Module, calib: torch.Tensor, progress: bool = True, calib_cache=None,
                   more_calib=None, dist=None):  # fmt: skip
    """The Fisher-salience service a method's ``prepare`` hook calls (``ctx.fisher``):
    ``fisher(names, given=None, tokens=None, samples=None, cache="auto") -> (salience, info)``.

    ``given``: a precomputed ``{name: [out, in]}`` (checked, not recomputed); else estimated on the
    *float* model from ``tokens`` (default: the calibration tokens), their first ``samples``
    (``more_calib(samples)`` when the calibration tokens are fewer and the caller can draw more).
    ``cache``: a folder, ``None`` (off) or ``"auto"`` (the run's calibration cache when it has one,
    else ``~/.cache/bitmosaic/fisher``).  ``dist``: a data-parallel run's rank (the samples are
    split over the ranks)."""

    def fisher(names, given=None, tokens=None, samples=None, cache="auto"):
        info: dict = {"given": True}
        if given is None:
            if tokens is None:
                tokens = calib
                if samples is not None and samples > calib.shape[0] and more_calib is not None:
                    tokens = more_calib(samples)
            if samples is not None:
                if samples > tokens.shape[0]:
                    raise ValueError(
                        f"fisher_samples={samples} but only {tokens.shape[0]} calibration samples were "
                        "given; pass more samples (--nsamples) or salience_tokens"
                    )
                tokens = tokens[:samples]
            where = calib_cache if cache == "auto" and calib_cache is not None else cache
            given, info = fisher_salience(model, tokens, names, cache_dir=where, progress=progress, dist=dist)
        missing = [n for n in names if n not in given]
        if missing:
            raise ValueError(f"the salience lacks {len(missing)} linears, e.g. {missing[0]}")
        for n in names:
            want = tuple(model.get_submodule(n).weight.shape)
            if tuple(given[n].shape) != want:
                raise ValueError(
                    f"the salience of {n} is {tuple(given[n].shape)}, its weight {want}: pass one "
                    "[out, in] tensor per linear (e.g. from bitmosaic.pipeline.fisher.fisher_salience)"
                )
        return {n: given[n] for n in names}, info

    return fisher


def _estimate(
    model: nn.Module, tokens: torch.Tensor, names: list[str], progress: bool, mean: bool = True
) -> dict[str, torch.Tensor]:
    """The mean of the squared per-sample gradients over ``tokens`` (``mean=False``: their sum)."""
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
    if not mean:
        return {n: a.cpu() for n, a in acc.items()}
    return {n: (a / tokens.shape[0]).cpu() for n, a in acc.items()}
