"""``--gguf-target-bpw B``: a GGUF type per linear from {Q2_K .. Q6_K, IQ4_XS, Q8_0} (llama.cpp's fallbacks
where a width is not a multiple of 256) so that the linears' stored bits per weight are at most ``B``,
chosen by the Fisher salience of each tensor (:mod:`bitmosaic.algorithms.gguf_bpw`; issue 72, item 4).

``B`` counts the quantized linears' tensor data exactly (``8 * bytes / weights``; the embedding and head are
written in the source file's type either way), so a preset's own value (:func:`preset_bpw`, e.g. Q4_K_M's on
SmolLM2) gives a file of at most that preset's size.
"""

from __future__ import annotations

from ..algorithms.gguf_bpw import allocate, type_bits, type_errors
from ..errors import OptionError
from .gguf_mix import BLOCK_OF, FALLBACK, mix_context, tensor_type

__all__ = ["BPW_TYPES", "BPW_RANGE", "candidates", "choose_types", "preset_bpw", "range_error"]

BPW_TYPES = ("Q2_K", "Q3_K", "IQ4_XS", "Q4_K", "Q5_K", "Q6_K", "Q8_0")
BPW_RANGE = (type_bits("Q2_K"), type_bits("Q8_0"))  # 2.625 .. 8.5


def candidates(in_features: int) -> list[str]:
    """The types a linear of ``in_features`` inputs can take: each of :data:`BPW_TYPES`, or llama.cpp's
    fallback where its block does not divide the width (Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, ...)."""
    out: list[str] = []
    for t in BPW_TYPES:
        t = t if in_features % BLOCK_OF[t] == 0 else FALLBACK.get(t, t)
        if in_features % BLOCK_OF[t] == 0 and t not in out:
            out.append(t)
    return out


def range_error(bpw: float, lo: float, hi: float, why: str) -> OptionError:
    return OptionError(
        f"--gguf-target-bpw {bpw:g}: {why}; give a value in [{lo:.4g}, {hi:.4g}] (all Q8_0 is the top; "
        "for more, quantize in F16 or use --gguf-type)"
    )


def choose_types(model, names: list[str], salience: dict, bpw: float) -> tuple[dict[str, str], dict]:
    """``({name: type}, summary)`` for the linears ``names`` of ``model`` under ``bpw`` (module doc)."""
    costs, weights = {}, 0
    for n in names:
        W = model.get_submodule(n).weight
        cands = candidates(W.shape[1])
        if not cands:
            raise OptionError(
                f"--gguf-target-bpw: layer {n} has {W.shape[1]} input columns, not a multiple of 32 (no "
                "GGUF block fits; llama.cpp writes such tensors as F16); quantize it with another method "
                "through a recipe override"
            )
        errs = type_errors(W, salience[n], cands)
        costs[n] = {t: (type_bits(t) * W.numel(), errs[t]) for t in cands}
        weights += W.numel()
    lo = sum(min(b for b, _ in c.values()) for c in costs.values()) / weights
    hi = sum(max(b for b, _ in c.values()) for c in costs.values()) / weights
    if not lo <= bpw:
        raise range_error(bpw, lo, hi, "below the cheapest types this model's linears can take")
    types = allocate(costs, bpw * weights)
    bits = sum(costs[n][t][0] for n, t in types.items())
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t] = counts.get(t, 0) + 1
    summary = {"target_bpw": bpw, "bpw": bits / weights, "types": dict(sorted(counts.items())),
               "range": [lo, hi], "salience": "fisher"}  # fmt: skip
    return types, summary


def preset_bpw(model, names: list[str], preset: str) -> float:
    """The linears' exact bits per weight under llama.cpp's mix of ``preset`` (its file's size, in bpw)."""
    ctx = mix_context(model.config)
    bits = weights = 0
    for n in names:
        W = model.get_submodule(n).weight
        bits += type_bits(tensor_type(preset, n, W.shape[1], **ctx)) * W.numel()
        weights += W.numel()
    return bits / weights
