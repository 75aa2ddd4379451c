"""GGUF k-quants refitted from bitmosaic's integers (``bitmosaic export --format gguf --gguf-type Q4_K``
on a model not calibrated for that type): our integers kept where the type's codes hold them and the
sub-block scales refitted (:mod:`.gguf_kquants`), exact or refused in one line naming the weight error a
refit would add (``--lossy`` writes it).  Layers calibrated on the type's own grid
(``quantize --gguf-type``) do not come here: they hold their GGUF blocks already."""

from __future__ import annotations

import numpy as np
import torch

from ...modules.actquant import input_quant_spec
from . import gguf_kquants as kq
from .layers import Refusal, regroup

__all__ = ["kquant_layer", "kquant_refusal"]

_ALL_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


def kquant_layer(gguf_type: str, lossy: bool, fallback: list[str], rerounded: dict[str, int], legacy):
    """``fn(name, module, changes)`` -> ``(bytes, type)``: the layer as the k-quant ``gguf_type``, our
    integers kept and the sub-block scales refitted (:mod:`.gguf_kquants`).  A refit that is not exact
    appends its change even without ``lossy`` (the caller refuses then, naming the error it adds).  A
    layer whose input width is not a multiple of 256 (llama.cpp falls back to a legacy type there too)
    is written in its legacy default type (appended to ``fallback``); ``rerounded``: per layer, the
    sub-blocks whose integers the type cannot hold; ``legacy``: the ``fn`` writing a layer in its
    legacy default type."""
    from gguf import quants

    t = kq.K_TYPES[gguf_type]

    def fn(name, m, changes):
        if m.in_features % kq.QK_K:
            fallback.append(name)
            return legacy(name, m, changes)
        why: list[str] = []
        spec = input_quant_spec(m)
        if spec is not None:
            why.append(f"activation quantization ({spec.label}): GGUF holds weights only")
        try:
            form = m.int_form(_ALL_BITS, False, [])
        except Refusal as r:
            form = None
            why.extend(r.reasons)
        if form is not None and not form.contiguous:
            why.append(f"act-order groups (g_idx): a {t.name} sub-block is {t.sub} consecutive columns")
        if why and not lossy:
            raise Refusal(why[-1], also=tuple(why[:-1]))
        w = m.dequantize_reference(torch.float32)
        if why:
            if spec is not None:
                changes.append(f"activation quantizer {spec.label} dropped")
            changes.append(f"re-rounded to {t.name} from the bitmosaic weights")
            f = kq.fit_weights(w, t)
        elif form.group_size % t.sub:
            changes.append(f"groups of {form.group_size} columns re-rounded to {t.name} sub-blocks")
            f = kq.fit_weights(w, t)
        else:
            split = regroup(form, t.sub)
            f = kq.fit(split.values(), split.scales, w, t)
        data = kq.pack(f, t)
        mine = kq.dequantize(f, t)
        got = np.asarray(quants.dequantize(data, t.qtype)).reshape(mine.shape)
        if not np.array_equal(got, mine.numpy()):
            raise RuntimeError(f"internal error: the {t.name} blocks of {name} do not read back as fitted")
        if f.rerounded:
            rerounded[name] = f.rerounded
        if not changes and not torch.equal(mine, w):
            changes.append(t.refitted())
            if f.rerounded:
                changes.append(
                    f"{t.name}: {f.rerounded} of {f.subblocks} sub-blocks re-rounded (integers outside "
                    f"{t.code_range})"
                )
        return data, t.name

    return fn


def kquant_refusal(t: kq.KType, records: list, rerounded: int, exact: str) -> str:
    """The one line refusing an inexact k-quant: the weight error it would add, and the fixes (``exact``:
    the exact types of the refused layers)."""
    bad = [r for r in records if r.changes]
    rel = [r.rel_err for r in bad]
    extra = f", {rerounded} sub-blocks re-rounded (integers outside {t.code_range})" if rerounded else ""
    return (
        f"cannot export as gguf: {t.name} stores {t.what()} per 256 weights, which holds {len(bad)} of "
        f"{len(records)} layer(s) only approximately (e.g. {bad[0].name}): refitted to our integers they "
        f"would add a weight error of {sum(rel) / len(rel):.1e} mean, {max(rel):.1e} max (relative "
        f"Frobenius, per layer){extra}; pass --lossy to write it, or leave out --gguf-type for an exact "
        f"type ({exact} for these layers)"
    )
