"""CPU kernels of the microscaling (``mx``) kind: the FP4 LUT GEMV and the reference tiles (issue 75, item 5).

:class:`FP4LutWeight` runs MXFP4 and NVFP4 weights (E2M1 codes, a block divisor per ``block`` inputs of a
row) at decode and small batches through lookup tables, the bit-plane LUT kernel's idea
(:mod:`bitmosaic.kernels.lut`, SFMP §4.5, T-MAC) for a 4-bit *float* code: for each activation ``x_j`` a
table ``T_j[c] = e2m1(c) · x_j`` of the 16 E2M1 values, then per block ``y[n] += d[n, b] · Σ_j T_j[c[n, j]]``
(``csrc/fp4gemv.cpp``; ``d`` the E8M0 power of two, or NVFP4's E4M3 scale over the FP32 tensor scale, as
:func:`bitmosaic.formats.mx.element_divisor` rounds it).  AVX-512: one ``vpermps`` looks up 16 rows;
AVX2: two 8-entry ``vpermps`` and a blend, 8 rows; portable C++: scalar lookups; the ISA per call
(:mod:`bitmosaic.kernels.isa`).  Activations stay float32: the result is the reference
dequantize-then-matmul up to float32 rounding (``tests/kernels/test_fp4lut.py`` states the bound).
Up to ``SUPPORTS_ROWS[1]`` rows of ``x`` run the GEMV (8 rows per pass, each weight byte loaded once
per pass); more rows (prefill) run tiles dequantized from the kernel layout (exactly the reference
values) and ``torch.mm``.  Without the compiled extension every call runs those tiles.

Layout (built at load time from the stored :class:`~bitmosaic.formats.mx.MXTensor`, which stays the
source of truth): tiles of 16 rows; per tile and quad of 8 columns the 16 rows' 32-bit words (each the
row's 4 saved ``weight_packed`` bytes of those columns: nibble ``n`` is column ``8q + n``), so one load
feeds 8 lookups of 16 rows; zero codes past ``N`` and ``K``; divisors float32 ``[blocks, Npad]``.

:class:`MXTiledWeight` is the reference kernel: rows of the weight dequantized exactly a tile at a time
and multiplied in float32 -- every microscaling format (FP8 ones included), and FP4 where the LUT
extension is not compiled.

Capabilities (:func:`bitmosaic.kernels.select.select_kernel`; the ``mx`` kind lists
``("fp4_lut", "mx_tiles")``): FP4 (``bits`` 4) on the CPU at 1-32 rows of ``x`` with its compiled
extension, measured in ``benchmarks/kernels/mx_gemv.py`` (``benchmarks/results/mx_gemv.md``).
"""

from __future__ import annotations

import math

import torch

from ..formats.mx import E2M1_VALUES, MXTensor, element_divisor, mx_dequantize, unpack_fp4
from . import build, tiles
from .isa import ISAS, isa_number

__all__ = ["FP4LutWeight", "MXTiledWeight", "extension", "TILE"]

TILE = 16  # rows per tile (csrc/fp4gemv.cpp)


def extension():
    """The compiled FP4 extension, or ``None`` (no compiler, build failure, or ``BITMOSAIC_NO_EXT=1``)."""
    return build.load("fp4gemv")


def _tiled_mm(x2: torch.Tensor, n_out: int, n_in: int, rows_of) -> torch.Tensor:
    """``x2 [M, in] @ Wᵀ``, ``W`` made by ``rows_of(r0, r1) -> float32 [r1 - r0, in]`` a tile at a time."""
    y = torch.empty(x2.shape[0], n_out, dtype=torch.float32)
    step = max(8, tiles.PREFILL_TILE_ELEMS // max(n_in, 1))
    for r0 in range(0, n_out, step):
        r1 = min(n_out, r0 + step)
        torch.mm(x2, rows_of(r0, r1).T, out=y[:, r0:r1])
    return y


class FP4LutWeight:
    """An MXFP4/NVFP4 weight in the FP4 LUT layout (module doc); ``matmul`` never builds the float weight."""

    KERNEL_NAME = "fp4_lut"
    SUPPORTS_BITS = (4,)  # E2M1 elements only
    SUPPORTS_MIXED_BITS = False
    SUPPORTS_DEVICES = ("cpu",)
    SUPPORTS_GROUP_SIZE_MULTIPLE = 8  # a block holds whole words (8 codes)
    SUPPORTS_ROWS = (1, 32)  # the GEMV (8 rows of x per pass); tiles above
    FAST_BITS = (4,)  # mx_gemv.md: faster than the reference tiles at every measured shape
    NEEDS_COMPILED = True  # its pure-torch path is the reference tiles

    @staticmethod
    def compiled() -> bool:
        return extension() is not None

    def __init__(self, data: torch.Tensor, div_t: torch.Tensor, N: int, K: int, block: int):
        self.data, self.div_t = data, div_t  # uint8 [ntiles, ceil(K/8), 64], float32 [blocks, ntiles*16]
        self.N, self.K, self.block = N, K, block

    @classmethod
    def from_tensor(cls, t: MXTensor) -> FP4LutWeight:
        """The kernel layout of an FP4 microscaled matrix (``t.fmt.elem == "e2m1"``, one block row)."""
        f = t.fmt
        if f.elem != "e2m1" or f.block_rows != 1 or f.block % 8:
            raise ValueError(f"the FP4 LUT runs E2M1 weights in row blocks of 8k columns, not {f.name}")
        N, K = t.shape
        nt, nq = -(-N // TILE), -(-K // 8)
        packed = torch.nn.functional.pad(t.elements.to(torch.uint8), (0, nq * 4 - K // 2, 0, nt * TILE - N))
        data = packed.reshape(nt, TILE, nq, 4).transpose(1, 2).reshape(nt, nq, 4 * TILE).contiguous()
        div = element_divisor(t.scale_values(), f, t.global_scale)  # [N, blocks] float32
        div_t = torch.nn.functional.pad(div.T, (0, nt * TILE - N)).contiguous()
        return cls(data, div_t, N, K, f.block)

    def nbytes(self) -> int:
        return self.data.numel() + self.div_t.numel() * 4

    def packed_rows(self, r0: int, r1: int) -> torch.Tensor:
        """Stored bytes ``[r1 - r0, K/2]`` of rows ``r0:r1`` (the saved ``weight_packed`` rows, exactly)."""
        t0, t1 = r0 // TILE, -(-r1 // TILE)
        nq = self.data.shape[1]
        part = self.data[t0:t1].reshape(t1 - t0, nq, TILE, 4).transpose(1, 2).reshape(-1, nq * 4)
        return part[r0 - t0 * TILE : r1 - t0 * TILE, : self.K // 2]

    def dequantize(self, rows: slice | None = None) -> torch.Tensor:
        """Rows of ``W`` in float32, exactly the reference's ``e2m1(c) · d``."""
        r0, r1, _ = (rows or slice(None)).indices(self.N)
        r1 = max(r0, r1)
        codes = unpack_fp4(self.packed_rows(r0, r1)).to(torch.int64)
        v = E2M1_VALUES[codes & 7]
        v = torch.where((codes & 8) != 0, -v, v)
        d = self.div_t[:, r0:r1].T.repeat_interleave(self.block, 1)[:, : self.K]
        return v * d

    def matmul(self, x: torch.Tensor, isa: str = "auto") -> torch.Tensor:
        """``x [..., K]`` (float32/bfloat16/float16) -> ``[..., N]`` in ``x``'s dtype (float32 sums): the LUT
        GEMV on path ``isa`` (``auto``/``avx512``/``avx2``/``portable``) up to ``SUPPORTS_ROWS[1]`` rows,
        tiles above (and without the extension)."""
        if x.shape[-1] != self.K:
            raise ValueError(f"x has {x.shape[-1]} features but the weight has {self.K} input columns")
        if isa != "auto" and isa not in ISAS:
            raise ValueError(f"isa must be one of auto, {', '.join(ISAS)}, got {isa!r}")
        x2 = x.reshape(math.prod(x.shape[:-1]), self.K).float()
        ext = extension()
        if ext is not None and x2.shape[0] <= self.SUPPORTS_ROWS[1]:
            y = ext.fp4_gemv(x2, self.data, self.div_t, self.N, self.K, self.block, isa_number(isa, ext))
        else:
            y = _tiled_mm(x2, self.N, self.K, lambda a, b: self.dequantize(slice(a, b)))
        return y.reshape(*x.shape[:-1], self.N).to(x.dtype)


class MXTiledWeight:
    """The reference kernel of every microscaling format: exact rows of ``W`` a tile at a time, times ``x``
    in float32 (never a resident float weight)."""

    KERNEL_NAME = "mx_tiles"
    SUPPORTS_BITS = (4, 8)
    SUPPORTS_MIXED_BITS = False
    SUPPORTS_DEVICES = ("cpu",)
    SUPPORTS_GROUP_SIZE_MULTIPLE = 1
    SUPPORTS_ROWS = (1, None)
    FAST_BITS = (4, 8)  # the only CPU path of the FP8 formats, and of FP4 without the compiled LUT
    NEEDS_COMPILED = False

    @staticmethod
    def compiled() -> bool:
        return False

    def __init__(self, t: MXTensor):
        self.t = t
        self.N, self.K = t.shape

    @classmethod
    def from_tensor(cls, t: MXTensor) -> MXTiledWeight:
        return cls(t)

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.t.tensors())

    def dequantize(self, rows: slice | None = None) -> torch.Tensor:
        """Rows of ``W`` in float32 (:func:`~bitmosaic.formats.mx.mx_dequantize` of their blocks)."""
        r0, r1, _ = (rows or slice(None)).indices(self.N)
        f, t = self.t.fmt, self.t
        sa, sb = r0 // f.block_rows, -(-max(r0, r1) // f.block_rows)
        a, b = sa * f.block_rows, min(sb * f.block_rows, self.N)
        part = MXTensor(f, (b - a, self.K), t.elements[a:b], t.scales[sa:sb], t.global_scale)
        return mx_dequantize(part)[r0 - a : max(r0, r1) - a]

    def matmul(self, x: torch.Tensor, isa: str = "auto") -> torch.Tensor:
        """``x [..., K]`` -> ``[..., N]`` in ``x``'s dtype (float32 products); ``isa`` is ignored."""
        if x.shape[-1] != self.K:
            raise ValueError(f"x has {x.shape[-1]} features but the weight has {self.K} input columns")
        x2 = x.reshape(math.prod(x.shape[:-1]), self.K).float()
        y = _tiled_mm(x2, self.N, self.K, lambda a, b: self.dequantize(slice(a, b)))
        return y.reshape(*x.shape[:-1], self.N).to(x.dtype)
