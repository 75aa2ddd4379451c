"""The two weight forms an ecosystem checkpoint can hold, and how each bitmosaic module kind maps onto them.

- :class:`IntLayer` (:class:`~bitmosaic.formats.intform.IntForm`): an affine INT grid,
  ``W[o, j] = (codes[o, j] - zeros[o, g]) * scales[o, g]`` with ``g = g_idx[j]`` -- exactly our
  packed layout (``formats/grid.py``), and what GPTQ and compressed-tensors'
  ``pack-quantized`` / ``int-quantized`` store.
- :class:`FP8Layer` (:class:`~bitmosaic.formats.intform.FP8Form`): E4M3 values times a float32 scale
  per channel or tensor (``float-quantized``).

:func:`int_layer` converts a module exactly, or -- with ``lossy`` -- to the nearest form a target can
hold, recording what it changed; without ``lossy`` a change raises :class:`Refusal` naming why no exact
form exists.  The caller measures the error a change adds (:func:`weight_error`) against the module's
own reference dequantization.
"""

from __future__ import annotations

import torch

from ...algorithms.rtn import rtn_quantize
from ...errors import BitmosaicError
from ...formats.grid import IntGrid
from ...formats.intform import FP8Form, IntForm, embed
from ...modules.base import NoIntForm

__all__ = [
    "ExportError",
    "Refusal",
    "IntLayer",
    "FP8Layer",
    "int_layer",
    "fp8_layer",
    "embed",
    "regroup",
    "requantize_contiguous",
    "weight_error",
]

IntLayer, FP8Layer = IntForm, FP8Form  # the forms, under the names the writers use
Refusal = NoIntForm  # why a layer has no exact form (``fixable``: ``--lossy`` has a nearest form)


class ExportError(BitmosaicError):
    """A bitmosaic result that the requested format cannot hold (or a bad export request)."""


def int_layer(m, allowed_bits: tuple[int, ...], lossy: bool, changes: list[str]) -> IntLayer:
    """``m`` as an INT grid whose width is in ``allowed_bits``; appends what a lossy form changed.  What
    that grid is -- or why there is none -- is the module kind's own answer (``int_form``)."""
    return m.int_form(allowed_bits, lossy, changes)


def requantize_contiguous(m, layer: IntLayer) -> IntLayer:
    """RTN of the module's weight on ``layer``'s grid with contiguous groups (the lossy form of act-order)."""
    W = m.dequantize_reference(torch.float32)
    res = rtn_quantize(W, IntGrid(layer.bits, layer.symmetric), layer.group_size)
    return IntLayer(
        res.codes,
        res.scales.to(torch.float16),
        res.zeros.round().to(torch.int32),
        res.g_idx.to(torch.int32),
        layer.bits,
        layer.group_size,
        layer.symmetric,
    )


def regroup(layer: IntLayer, g2: int) -> IntLayer:
    """The same weights with groups of ``g2`` columns (``g2`` divides the group size and ``in``).

    A group size that does not divide ``in`` (SmolLM2's 576 columns at g128) leaves a partial last
    group, which vLLM and compressed-tensors refuse, and a checkpoint has one group size for all layers.
    Splitting each group into pieces of ``g2`` columns that repeat its scale and zero keeps every weight
    bit-identical (act-order groups are split in column order, so every new group still has exactly
    ``g2`` columns)."""
    n = layer.codes.shape[1]
    g = layer.group_size
    if g2 == g:
        return layer
    if g % g2 or n % g2:
        raise ValueError(f"cannot split groups of {g} columns of a {n}-column layer into groups of {g2}")
    old = layer.g_idx.long()
    order = torch.argsort(old * n + torch.arange(n))  # columns grouped, in column order (keys unique)
    sizes = torch.bincount(old, minlength=layer.scales.shape[1])
    if bool((sizes % g2).any()):
        raise ValueError(
            f"the layer's groups have sizes {sorted(set(sizes.tolist()))}, not multiples of {g2}"
        )
    starts = torch.cumsum(sizes, 0) - sizes  # first position of each old group in ``order``
    rank = torch.empty(n, dtype=torch.long)
    rank[order] = torch.arange(n)
    new = (starts[old] // g2) + (rank - starts[old]) // g2
    src = torch.zeros(n // g2, dtype=torch.long).scatter_(0, new, old)  # old group of each new group
    return IntLayer(
        layer.codes,
        layer.scales[:, src].contiguous(),
        layer.zeros[:, src].contiguous(),
        new.to(torch.int32),
        layer.bits,
        g2,
        layer.symmetric,
    )


def fp8_layer(m, lossy: bool, changes: list[str]) -> FP8Layer:
    """An FP8 (e4m3) weight module as E4M3 values and its scale (the kind's ``fp8_form``)."""
    return m.fp8_form(lossy, changes)


def weight_error(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """Relative Frobenius error and max |diff| that an exported form adds to the module's weight."""
    d = got.double() - ref.double()
    norm = float(ref.double().norm())
    return {"rel_err": float(d.norm()) / norm if norm else float(d.norm()), "max_abs": float(d.abs().max())}
