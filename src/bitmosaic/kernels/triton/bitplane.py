"""SFMP's bit-plane kernels on the GPU (issue 76; SFMP §4.5, App. B): they read the block-major bit planes of
:mod:`bitmosaic.formats.bitplane` as packed -- any mix of widths 1-8 per (row block, group) block, the
per-block offset table.

- :func:`bitplane_gemv`: one row of ``x`` at a time times the planes (decode), on the format alone.
- :class:`TritonBitPlaneWeight`: the SFMP module kind's kernel on CUDA (``SFMPLinear.KERNELS`` lists it
  first, :mod:`bitmosaic.kernels.select` picks it there by its declared capabilities), the same interface
  as the CPU's :class:`~bitmosaic.kernels.lut.BitPlaneWeight`: up to :data:`GEMV_MAX_ROWS` rows of ``x``
  the GEMV above (the planes read once per row); more rows (prefill) the batched path: the planes
  dequantized by a Triton kernel, a few row blocks at a time, into a float32 tile multiplied by
  ``torch.mm`` (the dequantize-then-GEMM the CPU LUT kernel also takes above its GEMV rows).  SFMP's
  column gather and row un-permutation (§4.4, Eq. 14) are ``index_select`` around the kernel.

Reference: ``F.linear(x, formats.bitplane.dequantize(unpack(planes), scales, zeros, group_size))``; the
kernels rebuild the same integer codes and the same ``(c - z) * s`` (the dequantization is bitwise equal),
so only the float32 summation order differs (tests/kernels/triton/test_triton_bitplane.py,
test_triton_sfmp.py).
"""

from __future__ import annotations

import torch

from ...formats.bitplane import BitPlanes
from ..lut import BitPlaneWeight
from ..tiles import TORCH_TILE_ELEMS
from . import TritonKernel, check_device, jit_module

__all__ = ["bitplane_gemv", "TritonBitPlaneWeight", "GEMV_MAX_ROWS"]

GEMV_MAX_ROWS = 16  # up to this many rows of x: the GEMV; above, dequantize row blocks + torch.mm


def _words(p: BitPlanes) -> torch.Tensor:
    """The planes as int32 words (every block's stream is whole words: rows x chunks x q x 4 bytes)."""
    data = p.data
    if data.numel() % 4:
        data = torch.cat([data, data.new_zeros(4 - data.numel() % 4)])
    return data.view(torch.int32)


def _rows2d(x: torch.Tensor, K: int) -> torch.Tensor:
    x2 = x.reshape(-1, K)
    if x2.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        x2 = x2.float()
    return x2.contiguous()


def _tables(p: BitPlanes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the kernels read: the int32 words, the block offsets (int64 bytes) and widths (int32)."""
    return _words(p), p.offsets.to(torch.int64).contiguous(), p.bits.to(torch.int32).contiguous()


def _gemv(p: BitPlanes, tables, s_t, z_t, x2: torch.Tensor) -> torch.Tensor:
    """``x2 [M, K]`` times the planes (``s_t``/``z_t``: ``[G, N]`` float32) -> ``[M, N]``, ``x2``'s dtype."""
    M = x2.shape[0]
    y = torch.empty(M, p.N, dtype=x2.dtype, device=x2.device)
    if M and p.N:
        words, off, bits = tables
        grid = (p.bits.shape[0], -(-p.row_block // 16), M)
        jit_module("bitplane_jit").bitplane_gemv_kernel[grid](
            x2, words, off, bits, s_t, z_t, y, p.N, p.K, p.n_groups, p.group_size, p.row_block,
            x2.stride(0), y.stride(0),
        )  # fmt: skip
    return y


def bitplane_gemv(p: BitPlanes, scales: torch.Tensor, zeros, x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` times the bit-plane weight ``p`` (``scales``/``zeros`` ``[N, G]`` or a number) ->
    ``[..., N]`` in ``x``'s dtype (float32 sums)."""
    if x.shape[-1] != p.K:
        raise ValueError(f"x has {x.shape[-1]} features but the bit-plane weight has {p.K} input columns")
    check_device(x)
    G = p.n_groups
    s = scales.float().expand(p.N, G).T.contiguous()
    z = zeros.float() if torch.is_tensor(zeros) else torch.tensor(float(zeros), device=x.device)
    z = z.expand(p.N, G).T.contiguous()
    y = _gemv(p, _tables(p), s, z, _rows2d(x, p.K))
    return y.reshape(*x.shape[:-1], p.N).to(x.dtype)


class TritonBitPlaneWeight(TritonKernel, BitPlaneWeight):
    """:class:`~bitmosaic.kernels.lut.BitPlaneWeight`'s planes, scales and zero-points (so SFMP rebuilds its
    saved buffers from it the same way), multiplied by the Triton kernels on CUDA."""

    KERNEL_NAME = "triton_bitplane"
    SUPPORTS_ROWS = (1, None)  # the GEMV up to GEMV_MAX_ROWS rows, the batched path above
    FAST_BITS = BitPlaneWeight.SUPPORTS_BITS

    def __init__(self, planes: BitPlanes, scales_t: torch.Tensor, zeros_t: torch.Tensor):
        super().__init__(planes, scales_t, zeros_t)
        self._tables = _tables(planes)

    def to(self, device) -> TritonBitPlaneWeight:
        """The same weight with every tensor on ``device``."""
        p = self.planes
        moved = BitPlanes(p.data.to(device), p.offsets.to(device), p.bits.to(device), p.N, p.K, p.group_size,
                          p.row_block)  # fmt: skip
        return TritonBitPlaneWeight(moved, self.scales_t.to(device), self.zeros_t.to(device))

    def matmul(self, x: torch.Tensor, isa: str = "auto", in_index: torch.Tensor | None = None,
               out_index: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """``x [..., K]`` -> ``[..., N]`` in ``x``'s dtype (float32 sums), ``x[..., in_index]`` multiplied and
        ``y[..., out_index]`` returned when given (``isa``: ignored, the CPU kernel's argument)."""
        if x.shape[-1] != self.K:
            raise ValueError(f"x has {x.shape[-1]} features but the weight has {self.K} input columns")
        check_device(x)
        if in_index is not None:
            x = x.index_select(-1, in_index.to(device=x.device, dtype=torch.long))
        x2 = _rows2d(x, self.K)
        if x2.shape[0] <= GEMV_MAX_ROWS:
            y = _gemv(self.planes, self._tables, self.scales_t, self.zeros_t, x2)
        else:
            y = torch.empty(x2.shape[0], self.N, dtype=torch.float32, device=x2.device)
            xf = x2.float()
            for r0, r1 in self._row_chunks():
                torch.mm(xf, self.dequantize(slice(r0, r1)).T, out=y[:, r0:r1])
        if out_index is not None:
            y = y.index_select(-1, out_index.to(device=y.device, dtype=torch.long))
        return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)

    def _row_chunks(self):
        """Whole row blocks of about one tile of float32 weights each (bounded temporary memory)."""
        rb = self.row_block
        step = max(1, TORCH_TILE_ELEMS // max(rb * self.K, 1)) * rb
        return [(r0, min(self.N, r0 + step)) for r0 in range(0, self.N, step)]

    def dequantize(self, rows: slice | None = None) -> torch.Tensor:
        """Rows of ``W`` in float32, exactly ``(c - z) * s`` (the Triton dequantization kernel)."""
        r0, r1, _ = (rows or slice(None)).indices(self.N)
        r1 = max(r0, r1)
        device = self.scales_t.device
        if r1 == r0 or self.K == 0:
            return torch.empty(r1 - r0, self.K, dtype=torch.float32, device=device)
        p, rb = self.planes, self.row_block
        rb0, rb1 = r0 // rb, -(-r1 // rb)
        full = torch.empty(min(self.N, rb1 * rb) - rb0 * rb, self.K, dtype=torch.float32, device=device)
        check_device(full)
        grid = (rb1 - rb0, -(-rb // 16), p.n_groups)
        jit_module("bitplane_jit").bitplane_dequant_kernel[grid](
            *self._tables, self.scales_t, self.zeros_t, full, rb0, rb0 * rb, self.N, self.K, p.n_groups,
            p.group_size, rb,
        )  # fmt: skip
        return full[r0 - rb0 * rb : r1 - rb0 * rb]
