"""SFMP at model level: the Fisher salience + global allocation step run before calibration, and
the exact folding of permutations between neighbouring SFMP linears (gate/up -> down_proj)."""

from __future__ import annotations

import torch
from torch import nn

from ..modules.sfmp import SFMPLinear, fold_permutations
from .arch import ArchSpec, get_arch
from .fisher import fisher_salience, salience_linear_names

__all__ = ["allocate_with_salience", "fold_model_permutations"]


def allocate_with_salience(model, calib, method, config, arch: ArchSpec, *, salience=None,
                           salience_tokens=None, progress=True, calib_cache=None) -> dict:  # fmt: skip
    """Fisher salience of every decoder linear on the *float* model (before any AWQ scaling; from
    ``salience`` when given, else from ``salience_tokens`` or ``calib``, the first
    ``config.fisher_samples`` samples), then the method's global ``allocate``.  Returns the summary
    (with ``fisher``: cost in seconds, samples, cache key).  The salience is cached where
    ``config.fisher_cache`` says; when that is ``"auto"`` and ``calib_cache``
    (:class:`~bitmosaic.models.calib_cache.CalibCache`) is given, in that cache (or nowhere when it
    is off)."""
    names = salience_linear_names(model, arch)
    info: dict = {"given": True}
    if salience is None:
        tokens = calib if salience_tokens is None else salience_tokens
        n = getattr(config, "fisher_samples", None)
        if n is not None:
            if n > tokens.shape[0]:
                raise ValueError(
                    f"fisher_samples={n} but only {tokens.shape[0]} calibration samples were given; "
                    "pass more samples (--nsamples) or salience_tokens"
                )
            tokens = tokens[:n]
        where = getattr(config, "fisher_cache", "auto")
        if where == "auto" and calib_cache is not None:
            where = calib_cache
        salience, info = fisher_salience(model, tokens, names, cache_dir=where, progress=progress)
    missing = [n for n in names if n not in salience]
    if missing:
        raise ValueError(f"the salience lacks {len(missing)} linears, e.g. {missing[0]}")
    summary = method.allocate({n: salience[n] for n in names}, config)
    summary["fisher"] = info
    return summary


def fold_model_permutations(model: nn.Module, arch: ArchSpec | None = None) -> int:
    """Fold gate/up's output un-permutation and down_proj's input gather into one gather per
    producer, in every decoder layer where all three are SFMP linears (exact).  Returns how many
    layers were folded.  Only the MLP: q/k/v must be un-permuted before RoPE and the heads, and the
    attention output mixes v's channels per head."""
    arch = arch or get_arch(model)
    if arch.smooth_prev is None or len(arch.sequential) < 2:
        return 0
    producers, consumer = arch.sequential[-2], arch.sequential[-1]
    if len(consumer) != 1 or arch.smooth_prev[-1] not in producers:
        return 0
    folded = 0
    for layer in arch.layers(model):
        mods = [layer.get_submodule(n) for n in (*producers, consumer[0])]
        if all(isinstance(m, SFMPLinear) for m in mods):
            folded += fold_permutations(mods[:-1], mods[-1])
    return folded


@torch.no_grad()
def permutation_report(model: nn.Module) -> dict[str, dict]:
    """Per SFMP linear: average code bits and the bits-per-weight breakdown."""
    return {
        n: {"code_bits": m.code_bits(), **m.bits_breakdown()}
        for n, m in model.named_modules()
        if isinstance(m, SFMPLinear)
    }
