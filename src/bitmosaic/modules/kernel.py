"""Inference paths of the quantized module kinds: the compiled low-bit matmul, never a float weight.

Each packed kind turns its saved buffers (the source of truth) into a *kernel weight* the first
time it runs a forward on the CPU (or at load, see :func:`prepare_kernels`):

* ``packed``: the codes go, at their storage width, into the kernel
  :func:`~bitmosaic.kernels.select.select_kernel` picks among the kind's ``KERNELS``: on CUDA the Triton
  dequant GEMM/GEMV (:class:`~bitmosaic.kernels.triton.intmm.TritonIntWeight`); on the CPU by default the
  bit-plane :class:`~bitmosaic.kernels.lut.BitPlaneWeight` at 1-3 bits (the LUT GEMV, faster there end
  to end), :class:`~bitmosaic.kernels.qmatmul.LowBitWeight` from 4 bits (``$BITMOSAIC_KERNEL``
  overrides it), the no-clip ``code_offset`` folded into the zero-point (``(c + o - z) s = (c - (z - o)) s``).
  An act-order ``g_idx`` is handled the ExLlama way: the weight's input columns are permuted once,
  here, so that every group is contiguous (``perm = argsort(g_idx)``), and each call gathers the
  activation once (``x[..., perm]``; the bit-plane kernel inside its call), never per group.
* ``packed+csr``: the dense part as above plus the CSR outliers as one sparse product.
* ``dpq``: tiles of the INT codes are dequantized into a small buffer, rounded onto the FP8 grid,
  scaled by the FP8 weight scale and multiplied (``W4A8`` with FP8 compute is *simulated* in float32,
  as everywhere in bitmosaic).
* ``huffman``: the stream is decoded once to integers; when their range fits 8 bits they become a
  low-bit weight (one group per row), otherwise int16 tiles are scaled and multiplied.

Every path is tested equal (within float rounding) to ``F.linear(x, dequantize_reference())``.

The kernel weight is lossless: :func:`lowbit_codes` reads the integer codes back out of a
:class:`LowBitKernel` (saved column order), which is how a module rebuilds its released saved
buffers (``modules/base.py``, resident weights).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from ..formats.fp import fp_round
from ..kernels.lut import BitPlaneWeight
from ..kernels.qmatmul import LowBitWeight
from ..kernels.select import offers_device, select_kernel
from ..kernels.tiles import TORCH_TILE_ELEMS

__all__ = [
    "KernelWeight",
    "LowBitKernel",
    "TiledKernel",
    "ScaledInputKernel",
    "SparseAddKernel",
    "lowbit_from_codes",
    "lowbit_codes",
]


class KernelWeight:
    """What a quantized module multiplies by: ``__call__(x [..., in]) -> [..., out]`` (no bias)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def nbytes(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError


class LowBitKernel(KernelWeight):
    """A :class:`LowBitWeight` (or, at 1-3 bits, a :class:`~bitmosaic.kernels.lut.BitPlaneWeight`:
    same interface) with an optional input-column
    permutation (act-order groups; the bit-plane kernel gathers inside its call)."""

    def __init__(self, weight: LowBitWeight | BitPlaneWeight, perm: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.perm = perm
        # it gathers x by perm inside its call (the bit-plane LUT, the Triton kernels)
        self._fused = isinstance(weight, BitPlaneWeight) or getattr(weight, "GATHERS_INPUT", False)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused:
            return self.weight.matmul(x, in_index=self.perm)
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return self.weight.matmul(x)

    def dequantize_rows(self, rows: slice) -> torch.Tensor:
        """Float32 rows of the weight in the *saved* column order."""
        w = self.weight.dequantize(rows)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def nbytes(self) -> int:
        perm = 0 if self.perm is None else self.perm.numel() * self.perm.element_size()
        return self.weight.nbytes() + perm


class ScaledInputKernel(LowBitKernel):
    """DPQ on the Triton kernel (issue 76): the packed weight multiplied with the layer's per-tensor FP8
    activation scale, read at each call (``act_scale()``: the input quantizer's buffer, or ``None``), so
    the kernel feeds FP8 operands to ``tl.dot`` where the device has an FP8 one
    (:meth:`~bitmosaic.kernels.triton.intmm.TritonIntWeight.fp8_operands`); ``.dense``: the INT part."""

    def __init__(self, weight, perm: torch.Tensor | None, act_scale: Callable[[], torch.Tensor | None]):
        super().__init__(weight, perm)
        self.act_scale = act_scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.matmul(x, in_index=self.perm, x_scale=self.act_scale())


class TiledKernel(KernelWeight):
    """``y = x Wᵀ`` with ``W`` produced a few rows at a time by ``tile(rows) -> float32 [r, in]``."""

    def __init__(self, tile: Callable[[slice], torch.Tensor], out_features: int, in_features: int, held: int):
        self.tile = tile
        self.out_features = out_features
        self.in_features = in_features
        self.rows = max(8, TORCH_TILE_ELEMS // max(in_features, 1))
        self._held = held

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.reshape(-1, self.in_features).float()
        y = torch.empty(xf.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        for r0 in range(0, self.out_features, self.rows):
            r1 = min(r0 + self.rows, self.out_features)
            torch.mm(xf, self.tile(slice(r0, r1)).T, out=y[:, r0:r1])
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def nbytes(self) -> int:
        return self._held


class SparseAddKernel(KernelWeight):
    """A dense kernel plus a sparse ``[out, in]`` matrix (SSQR's CSR outliers)."""

    def __init__(self, dense: KernelWeight, sparse: torch.Tensor) -> None:
        self.dense = dense
        self.sparse = sparse.to_sparse_csr() if sparse.layout != torch.sparse_csr else sparse

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dense(x)
        if self.sparse.values().numel() == 0:
            return y
        xf = x.reshape(-1, x.shape[-1]).float()
        extra = (self.sparse @ xf.T).T  # [tokens, out]
        return (y.float() + extra.reshape(y.shape)).to(y.dtype)

    def nbytes(self) -> int:
        s = self.sparse
        parts = (s.crow_indices(), s.col_indices(), s.values())
        return self.dense.nbytes() + sum(t.numel() * t.element_size() for t in parts)


def contiguous_group_perm(g_idx: torch.Tensor, group_size: int) -> torch.Tensor:
    """``perm`` with ``g_idx[perm]`` equal to ``arange(in) // group_size`` (act-order groups made
    contiguous).  Raises ValueError when the group map does not have that many columns per group."""
    perm = torch.argsort(g_idx.to(torch.int64), stable=True)
    expect = torch.arange(g_idx.numel(), device=g_idx.device) // group_size
    if not torch.equal(g_idx.to(torch.int64)[perm], expect):
        raise ValueError(
            f"g_idx does not assign {group_size} columns to each group, so its groups cannot be made "
            "contiguous; re-quantize, or load with the weight cache (set_weight_cache(model, True))"
        )
    return perm


def lowbit_from_codes(
    codes: torch.Tensor,
    bits: int,
    scales: torch.Tensor,
    zeros: torch.Tensor | float,
    group_size: int,
    g_idx: torch.Tensor | None,
    kernels: tuple[str, ...] = ("lowbit",),
) -> LowBitKernel:
    """A :class:`LowBitKernel` from ``[out, in]`` codes in ``[0, 2**bits)`` with a group map, its weight
    the kernel :func:`~bitmosaic.kernels.select.select_kernel` picks among ``kernels`` (a module kind's
    ``KERNELS``) for ``bits``."""
    perm = None
    if g_idx is not None:
        perm = contiguous_group_perm(g_idx, group_size).to(torch.int32)  # int32: half the bytes of int64
        codes = codes.index_select(1, perm)
    z = zeros.float() if torch.is_tensor(zeros) else float(zeros)
    # the codes' device when one of ``kernels`` runs there (CUDA: the Triton kernels), else the CPU's
    device = codes.device.type if offers_device(kernels, codes.device.type) else "cpu"
    kind = select_kernel(kernels, bits, group_size=group_size, device=device)
    return LowBitKernel(kind.from_codes(codes, bits, scales.float(), z, group_size), perm)


def dpq_tiles(dense: LowBitKernel, fmt: str, fp8_scale: torch.Tensor, out: int, inp: int) -> TiledKernel:
    """DPQ: INT tiles dequantized, rounded onto the FP8 grid and scaled in the tile (``.dense`` is the
    INT part)."""
    scale = fp8_scale.float()

    def tile(rows: slice) -> torch.Tensor:
        s = scale if scale.shape[0] == 1 else scale[rows]
        return fp_round(dense.dequantize_rows(rows), fmt).mul_(s)

    k = TiledKernel(tile, out, inp, dense.nbytes() + scale.numel() * 4)
    k.dense = dense
    return k


def int_tiles(codes: torch.Tensor, scales: torch.Tensor) -> TiledKernel:
    """Wide integers (``int16 [out, in]``, kept as ``.codes``) times one scale per row (or per
    matrix), tile by tile."""
    out, inp = codes.shape
    s = scales.float().expand(out, 1)

    def tile(rows: slice) -> torch.Tensor:
        return codes[rows].float().mul_(s[rows])

    k = TiledKernel(tile, out, inp, codes.numel() * codes.element_size() + scales.numel() * 4)
    k.codes = codes
    return k


def lowbit_codes(kernel: LowBitKernel, rows: slice | None = None) -> torch.Tensor:
    """The integer codes ``c`` of ``kernel``'s ``rows`` (``[r, in]`` int32, saved column order), exactly.

    Read through the layout's own ``dequantize`` with every scale 1 and every zero-point 0: that is
    ``(c - 0) * 1 = c``, exact in float32 for codes below ``2**8``, whatever the layout's packing
    (so this follows any layout version)."""
    w = kernel.weight
    unit = copy.copy(w)
    unit.scales = torch.ones_like(w.scales)
    unit.zeros = torch.zeros_like(w.zeros)
    c = unit.dequantize(rows or slice(None)).to(torch.int32)
    if kernel.perm is None:
        return c
    out = torch.empty_like(c)
    out[:, kernel.perm] = c
    return out


def row_chunks(n_rows: int, n_cols: int):
    """Row slices of about one tile each (bounded temporary memory when unpacking a kernel)."""
    step = max(1, TORCH_TILE_ELEMS // max(n_cols, 1))
    return [slice(r0, min(n_rows, r0 + step)) for r0 in range(0, n_rows, step)]
