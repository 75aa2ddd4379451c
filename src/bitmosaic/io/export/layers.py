"""The two weight forms an ecosystem checkpoint can hold, and how each bitmosaic module kind maps onto them.

- :class:`IntLayer`: an affine INT grid, ``W[o, j] = (codes[o, j] - zeros[o, g]) * scales[o, g]`` with
  ``g = g_idx[j]`` -- exactly our packed layout (``formats/grid.py``), and what GPTQ and
  compressed-tensors' ``pack-quantized`` / ``int-quantized`` store.
- :class:`FP8Layer`: E4M3 values times a float32 scale per channel or tensor (``float-quantized``).

:func:`int_layer` converts a module exactly, or -- with ``lossy`` -- to the nearest form a target can
hold, recording what it changed; without ``lossy`` a change raises :class:`Refusal` naming why no exact
form exists.  The caller measures the error a change adds (:func:`weight_error`) against the module's
own reference dequantization.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...algorithms.rtn import rtn_quantize
from ...errors import BitmosaicError
from ...formats.fp import fp_round
from ...formats.grid import IntGrid
from ...formats.layout import default_g_idx, dequantize
from ...modules import (
    FP8ComputeQuantLinear,
    FP8Linear,
    HuffmanQuantLinear,
    QuantLinear,
    SparseOutlierQuantLinear,
)

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


class ExportError(BitmosaicError):
    """A bitmosaic result that the requested format cannot hold (or a bad export request)."""


class Refusal(Exception):
    """Why one layer has no exact form in the target (``fixable``: ``--lossy`` has a nearest form)."""

    def __init__(self, reason: str, fixable: bool = True, also: tuple[str, ...] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fixable = fixable
        self.reasons = (*also, reason)  # every reason this layer is refused for

    def adding(self, earlier: str | None) -> Refusal:
        """This refusal with an ``earlier`` reason (found before it) listed too."""
        if earlier is None or earlier in self.reasons:
            return self
        return Refusal(self.reason, self.fixable, (*self.reasons[:-1], earlier))


@dataclass
class IntLayer:
    codes: torch.Tensor  # int32 [out, in], 0 .. 2**bits - 1
    scales: torch.Tensor  # fp16 [out, G]
    zeros: torch.Tensor  # int32 [out, G], 0 .. 2**bits - 1 (symmetric: all 2**(bits-1))
    g_idx: torch.Tensor  # int32 [in]
    bits: int
    group_size: int  # columns per group (in_features = per-channel)
    symmetric: bool

    @property
    def contiguous(self) -> bool:
        return bool(torch.equal(self.g_idx.long(), default_g_idx(self.codes.shape[1], self.group_size)))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.codes, self.scales, self.zeros, self.g_idx, dtype=dtype)


@dataclass
class FP8Layer:
    values: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor  # float32 [out, 1] or [1, 1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.values.float() * self.scale).to(dtype)


def _bit_len(span: int) -> int:
    return max(1, math.ceil(math.log2(span + 1)))


def _widest_fit(need: int, allowed: tuple[int, ...]) -> int:
    fits = [b for b in allowed if b >= need]
    return fits[0] if fits else max(allowed)


def embed(values: torch.Tensor, scales, g_idx, group_size: int, bits: int, symmetric: bool) -> IntLayer:
    """Signed integers ``values = code - zero`` (``[out, in]``) on a ``bits``-bit grid with the same scales:
    exact when every group's range fits (a wider grid holds a narrower one exactly), clamped otherwise.
    Asymmetric groups get the zero nearest the grid's middle that keeps their range on the grid."""
    maxq = (1 << bits) - 1
    v = values.to(torch.int64)
    gi = g_idx.long().expand_as(v)
    G = scales.shape[1]
    if symmetric:
        z = torch.full((v.shape[0], G), 1 << (bits - 1), dtype=torch.int64)
    else:
        lo = torch.full((v.shape[0], G), 1 << 40, dtype=torch.int64).scatter_reduce(1, gi, v, "amin")
        hi = torch.full((v.shape[0], G), -(1 << 40), dtype=torch.int64).scatter_reduce(1, gi, v, "amax")
        z = torch.maximum(torch.minimum(torch.full_like(lo, 1 << (bits - 1)), maxq - hi), -lo).clamp(0, maxq)
    codes = (v + z.gather(1, gi)).clamp(0, maxq)
    return IntLayer(
        codes.to(torch.int32),
        scales.to(torch.float16),
        z.to(torch.int32),
        g_idx.to(torch.int32),
        bits,
        group_size,
        symmetric,
    )


def _packed_layer(m: QuantLinear) -> tuple[IntLayer, torch.Tensor]:
    """The packed buffers as an :class:`IntLayer` at ``storage_bits`` (plus the signed values)."""
    codes = m.codes().to(torch.int64)
    G = m.scales.shape[1]
    if m.symmetric:
        zeros = torch.full((m.out_features, G), 1 << (m.bits - 1), dtype=torch.int64)
    else:
        zf = m.zeros.float()
        if not torch.equal(zf, zf.round()):
            raise Refusal("fractional zero-points (GPTQ and compressed-tensors store integer zeros)")
        zeros = zf.long()
    g_idx = m._g_idx_arg().to(torch.int32)
    values = codes - zeros.gather(1, g_idx.long().expand_as(codes))
    layer = IntLayer(
        codes.to(torch.int32),
        m.scales.clone(),
        zeros.to(torch.int32),
        g_idx,
        m.bits,
        m.group_size,
        m.symmetric,
    )
    return layer, values


def int_layer(m, allowed_bits: tuple[int, ...], lossy: bool, changes: list[str]) -> IntLayer:
    """``m`` as an INT grid whose width is in ``allowed_bits``; appends what a lossy form changed."""

    def refuse_or_note(reason: str) -> None:
        if not lossy:
            raise Refusal(reason)
        changes.append(reason)

    if isinstance(m, HuffmanQuantLinear):
        q = m.codes()
        lo, hi = int(q.min()), int(q.max())
        refuse_or_note("Huffman-coded integers (HPTQ/HRTN): neither format has entropy coding")
        bits = _widest_fit(_bit_len(hi - lo), allowed_bits)
        changes.append(f"integers stored on a {bits}-bit grid, one scale per row")
        s = m.scales.expand(m.out_features, 1)
        return embed(q, s, torch.zeros(m.in_features, dtype=torch.int32), m.in_features, bits, False)
    if isinstance(m, FP8Linear):
        refuse_or_note(f"{m.fmt} floating-point weights are not an INT grid (re-rounded to INT8 per channel)")
        res = rtn_quantize(m.dequantize_reference(torch.float32), IntGrid(8, True), None)
        return IntLayer(
            res.codes,
            res.scales.to(torch.float16),
            res.zeros.to(torch.int32),
            res.g_idx.to(torch.int32),
            8,
            m.in_features,
            True,
        )
    if not isinstance(m, QuantLinear):
        raise Refusal(f"module kind {getattr(m, 'kind', type(m).__name__)!r} has no INT form", fixable=False)
    layer, values = _packed_layer(m)
    if isinstance(m, SparseOutlierQuantLinear) and m.outlier_vals.numel():
        refuse_or_note("SSQR's CSR outliers are a sparse residual no format holds (dropped)")
    if isinstance(m, FP8ComputeQuantLinear):
        refuse_or_note(
            "DPQ's weights are nearest_FP8((q - z) s) * s_w: FP8-domain group scales and an FP8 rounding are "
            "not an affine INT grid"
        )
        changes.append("DPQ exported as its INT codes with scales s * s_w (the FP8 rounding is lost)")
        s = (m.scales.float() * m.fp8_scale.float()).to(torch.float16)
        layer.scales = s.expand(m.out_features, -1).contiguous()
    if m.storage_bits != m.bits or m.code_offset:
        lo, hi = int(values.min()), int(values.max())
        refuse_or_note(
            "no-clip integers outside the layer's bit grid (re-gridded at a wider width, clamped at 8 bits)"
        )
        bits = _widest_fit(_bit_len(hi - lo), allowed_bits)
        changes.append(f"integers stored on a {bits}-bit grid")
        return embed(values, layer.scales, layer.g_idx, layer.group_size, bits, False)
    if layer.bits not in allowed_bits:
        bits = _widest_fit(layer.bits, allowed_bits)
        refuse_or_note(
            f"{layer.bits}-bit codes: the format stores {'/'.join(map(str, allowed_bits))} bits (widened)"
        )
        return embed(values, layer.scales, layer.g_idx, layer.group_size, bits, layer.symmetric)
    return layer


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
    """An FP8 (e4m3) weight module as E4M3 values and its scale; other kinds have none."""
    if isinstance(m, FP8ComputeQuantLinear) and m.fmt in ("e4m3", "e4m3-240"):
        if not lossy:
            raise Refusal(
                "DPQ's weights are nearest_FP8((q - z) s) * s_w: FP8-domain group scales and an FP8 "
                "rounding are not an affine INT grid"
            )
        changes.append(
            "DPQ stored as its FP8 weight operand nearest_FP8((q - z) s) with scale s_w "
            "(values exact, 8 bits/weight)"
        )
        return FP8Layer(m.fp8_weight().to(torch.float8_e4m3fn), m.fp8_scale.float().clone())
    if not isinstance(m, FP8Linear):
        raise Refusal(f"a {m.kind} layer is not FP8 (use an INT format for it)", fixable=False)
    W8 = m.weight_fp8.view(m._dtype).float()
    scale = m.weight_scale.float()
    if m.fmt in ("e4m3", "e4m3-240"):  # e4m3-240 is e4m3 clamped to +-240: a subset of the E4M3 grid
        return FP8Layer(W8.to(torch.float8_e4m3fn), scale)
    if not lossy:
        raise Refusal(f"{m.fmt} weights (compressed-tensors' FP8 is E4M3)")
    changes.append(f"{m.fmt} weights rounded to E4M3")
    row = W8.abs().amax(dim=1, keepdim=True) if scale.shape[0] > 1 else W8.abs().amax().reshape(1, 1)
    up = (row / 448.0).clamp(min=1.0)
    return FP8Layer(fp_round(W8 / up, "e4m3").to(torch.float8_e4m3fn), scale * up)


def weight_error(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """Relative Frobenius error and max |diff| that an exported form adds to the module's weight."""
    d = got.double() - ref.double()
    norm = float(ref.double().norm())
    return {"rel_err": float(d.norm()) / norm if norm else float(d.norm()), "max_abs": float(d.abs().max())}
