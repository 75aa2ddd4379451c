"""CPU kernels of the microscaling (``mx``) kind: the FP4 LUT GEMV and the reference tiles (issue 75, item 5).

:class:`FP4LutWeight` runs MXFP4 and NVFP4 weights (E2M1 codes, a block divisor per ``block`` inputs of a
row) at decode and small batches through lookup tables, the bit-plane LUT kernel's idea
(:mod:`bitmosaic.kernels.lut`, SFMP §4.5, T-MAC) for a 4-bit *float* code: for each activation ``x_j`` a
table ``T_j[c] = e2m1(c) · x_j`` of the 16 E2M1 values, then per block ``y[n] += d[n, b] · Σ_j T_j[c[n, j]]``
(``csrc/fp4gemv.cpp``).  ``d`` is decoded inside the kernel from the stored scale byte, once per block:
MXFP4's E8M0 byte ``e`` -> ``2^(e - 127)`` built from its bits, NVFP4's E4M3 byte through a 256-entry table
of ``e4m3(s) / g`` (``g`` the FP32 tensor scale, each entry rounded once to float32) built per call -- the
divisors :func:`bitmosaic.formats.mx.element_divisor` gives, bit for bit.  So the kernel holds the file's
bytes and no float copy of the scales: 4.25 bits per weight for MXFP4, 4.5 for NVFP4 (plus the 4-byte
tensor scale and the padding to whole tiles), where a float32 divisor per block made it 5 and 6.
AVX-512: one ``vpermps`` looks up 16 rows;
AVX2: two 8-entry ``vpermps`` and a blend, 8 rows; portable C++: scalar lookups; the ISA per call
(:mod:`bitmosaic.kernels.isa`).  Activations stay float32: the result is the reference
dequantize-then-matmul up to float32 rounding (``tests/kernels/test_fp4lut.py`` states the bound).
Up to ``SUPPORTS_ROWS[1]`` rows of ``x`` run the GEMV (8 rows per pass, each weight byte loaded once
per pass); more rows (prefill) run tiles dequantized from the kernel layout (exactly the reference
values) and ``torch.mm``.  Without the compiled extension every call runs those tiles.

Layout (built at load time from the stored :class:`~bitmosaic.formats.mx.MXTensor`, which stays the
source of truth): tiles of 16 rows; per tile and quad of 8 columns the 16 rows' 32-bit words (each the
row's 4 saved ``weight_packed`` bytes of those columns: nibble ``n`` is column ``8q + n``), so one load
feeds 8 lookups of 16 rows; zero codes past ``N`` and ``K``; the saved ``weight_scale`` bytes transposed,
uint8 ``[blocks, Npad]`` (zero past ``N``), so the module releases both buffers and rebuilds them from it.

The call is the ``torch.library`` operator ``bitmosaic::fp4_gemv`` (:func:`fp4_gemv`, the conventions of
:mod:`bitmosaic.kernels.ops`: a fake implementation, the extension or the tiles inside its body), so
``torch.compile`` traces a model of ``mx`` modules without a graph break at the kernel.

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

from ..formats.mx import (
    E2M1_VALUES,
    MXTensor,
    decode_scales,
    element_divisor,
    get_mx_format,
    mx_dequantize,
    unpack_fp4,
)
from . import build, tiles
from .isa import ISAS, isa_number
from .ops import ext_isa, ext_operator, operator

__all__ = ["FP4LutWeight", "MXTiledWeight", "extension", "fp4_gemv", "TILE", "SCALE_KINDS"]

TILE = 16  # rows per tile (csrc/fp4gemv.cpp)
SCALE_KINDS = ("e8m0", "e4m3")  # index = the kernel's scale_kind (csrc/fp4gemv.cpp kE8M0, kE4M3)
GEMV_ROWS = 32  # rows of x the GEMV runs; more run the tiles (FP4LutWeight.SUPPORTS_ROWS)


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


def _packed_rows(data: torch.Tensor, K: int, r0: int, r1: int) -> torch.Tensor:
    """Stored FP4 bytes ``[r1 - r0, K/2]`` of rows ``r0:r1`` of the tile layout ``data``."""
    t0, t1 = r0 // TILE, -(-r1 // TILE)
    nq = data.shape[1]
    part = data[t0:t1].reshape(t1 - t0, nq, TILE, 4).transpose(1, 2).reshape(-1, nq * 4)
    return part[r0 - t0 * TILE : r1 - t0 * TILE, : K // 2]


def _divisors(scales_t: torch.Tensor, scale_kind: int, global_scale: float, r0: int, r1: int) -> torch.Tensor:
    """Float32 divisors ``[r1 - r0, blocks]`` of rows ``r0:r1`` from their scale bytes, as the reference
    (:func:`~bitmosaic.formats.mx.element_divisor`) computes them."""
    fmt = get_mx_format("nvfp4" if scale_kind == 1 else "mxfp4")
    stored = scales_t[:, r0:r1].T
    if scale_kind == 1:
        stored = stored.contiguous().view(torch.float8_e4m3fn)
    gs = torch.tensor([global_scale], dtype=torch.float32) if fmt.global_scale else None
    return element_divisor(decode_scales(stored, fmt), fmt, gs)


def _rows(data, scales_t, K, block, scale_kind, global_scale, r0, r1) -> torch.Tensor:
    """Rows ``r0:r1`` of ``W`` in float32 from the kernel layout, exactly the reference's ``e2m1(c) · d``."""
    codes = unpack_fp4(_packed_rows(data, K, r0, r1)).to(torch.int64)
    v = E2M1_VALUES[codes & 7]
    v = torch.where((codes & 8) != 0, -v, v)
    d = _divisors(scales_t, scale_kind, global_scale, r0, r1).repeat_interleave(block, 1)[:, :K]
    return v * d


@operator("fp4_gemv")
def fp4_gemv(
    x: torch.Tensor,
    data: torch.Tensor,
    scales_t: torch.Tensor,
    N: int,
    K: int,
    block: int,
    scale_kind: int,
    global_scale: float,
    isa: str,
) -> torch.Tensor:
    """``x [M, K]`` float32 times the FP4 weight in the LUT layout (module doc) -> ``[M, N]`` float32: the
    compiled LUT GEMV up to ``GEMV_ROWS`` rows of ``x``, tiles dequantized from the layout above (and
    without the extension).  ``scale_kind``: index in :data:`SCALE_KINDS`; ``global_scale``: NVFP4's FP32
    tensor scale (1.0 for MXFP4)."""
    ext = extension()
    if ext is not None and x.shape[0] <= GEMV_ROWS:
        return ext.fp4_gemv(x, data, scales_t, N, K, block, scale_kind, global_scale, isa_number(isa, ext))
    return _tiled_mm(x, N, K, lambda a, b: _rows(data, scales_t, K, block, scale_kind, global_scale, a, b))


@fp4_gemv.register_fake
def _(x, data, scales_t, N, K, block, scale_kind, global_scale, isa):
    return x.new_empty(x.shape[0], N)


def _gemv_ext_fake(x, data, scales_t, N, K, block, scale_kind, global_scale, isa):
    return x.new_empty(x.shape[0], N)


# bitmosaic::fp4_gemv_ext: the extension's own operator (csrc/fp4gemv.cpp, the ISA as its number), what a
# compiled graph calls at 1-GEMV_ROWS rows of x -- C++ through the dispatcher, no Python kernel between
ext_operator("fp4_gemv_ext", "fp4gemv", _gemv_ext_fake)


class FP4LutWeight:
    """An MXFP4/NVFP4 weight in the FP4 LUT layout (module doc); ``matmul`` never builds the float weight."""

    KERNEL_NAME = "fp4_lut"
    SUPPORTS_BITS = (4,)  # E2M1 elements only
    SUPPORTS_MIXED_BITS = False
    SUPPORTS_DEVICES = ("cpu",)
    SUPPORTS_GROUP_SIZE_MULTIPLE = 8  # a block holds whole words (8 codes)
    SUPPORTS_ROWS = (1, GEMV_ROWS)  # the GEMV (8 rows of x per pass); tiles above
    FAST_BITS = (4,)  # mx_gemv.md: faster than the reference tiles at every measured shape
    NEEDS_COMPILED = True  # its pure-torch path is the reference tiles

    @staticmethod
    def compiled() -> bool:
        return extension() is not None

    def __init__(self, data, scales_t, N: int, K: int, block: int, scale: str = "e8m0", global_scale=1.0):
        """``data`` uint8 ``[ntiles, ceil(K/8), 64]``, ``scales_t`` uint8 ``[blocks, ntiles*16]`` (the
        scale bytes, ``scale`` ``"e8m0"`` or ``"e4m3"``), ``global_scale`` NVFP4's tensor scale (a float32
        value)."""
        if scale not in SCALE_KINDS:
            raise ValueError(f"the FP4 LUT decodes E8M0 or E4M3 scale bytes, not {scale!r}")
        self.data, self.scales_t = data, scales_t
        self.N, self.K, self.block = N, K, block
        self.scale, self.scale_kind, self.global_scale = scale, SCALE_KINDS.index(scale), float(global_scale)

    @classmethod
    def from_tensor(cls, t: MXTensor) -> FP4LutWeight:
        """The kernel layout of an FP4 microscaled matrix (``t.fmt.elem == "e2m1"``, one block row)."""
        f = t.fmt
        if f.elem != "e2m1" or f.block_rows != 1 or f.block % 8 or f.scale not in SCALE_KINDS:
            raise ValueError(f"the FP4 LUT runs E2M1 weights in row blocks of 8k columns, not {f.name}")
        N, K = t.shape
        nt, nq = -(-N // TILE), -(-K // 8)
        packed = torch.nn.functional.pad(t.elements.to(torch.uint8), (0, nq * 4 - K // 2, 0, nt * TILE - N))
        data = packed.reshape(nt, TILE, nq, 4).transpose(1, 2).reshape(nt, nq, 4 * TILE).contiguous()
        sc = t.scales.view(torch.uint8)  # E8M0 or E4M3 bytes, as stored
        scales_t = torch.nn.functional.pad(sc.T, (0, nt * TILE - N)).contiguous()
        gs = float(t.global_scale.float().reshape(())) if f.global_scale else 1.0
        return cls(data, scales_t, N, K, f.block, f.scale, gs)

    def nbytes(self) -> int:
        """Resident bytes: the codes, the scale bytes and NVFP4's 4-byte tensor scale (no float copy)."""
        return self.data.numel() + self.scales_t.numel() + (4 if self.scale == "e4m3" else 0)

    def packed_rows(self, r0: int, r1: int) -> torch.Tensor:
        """Stored bytes ``[r1 - r0, K/2]`` of rows ``r0:r1`` (the saved ``weight_packed`` rows, exactly)."""
        return _packed_rows(self.data, self.K, r0, r1)

    def scale_rows(self, r0: int, r1: int) -> torch.Tensor:
        """Stored block scales ``[r1 - r0, blocks]`` of rows ``r0:r1`` in their dtype (the saved
        ``weight_scale`` rows, exactly: E8M0 uint8 or float8_e4m3fn)."""
        s = self.scales_t[:, r0:r1].T.contiguous()
        return s if self.scale == "e8m0" else s.view(torch.float8_e4m3fn)

    def divisors(self) -> torch.Tensor:
        """Float32 divisors ``[N, blocks]`` decoded from the scale bytes (what the kernel multiplies by)."""
        return _divisors(self.scales_t, self.scale_kind, self.global_scale, 0, self.N)

    def dequantize(self, rows: slice | None = None) -> torch.Tensor:
        """Rows of ``W`` in float32, exactly the reference's ``e2m1(c) · d``."""
        r0, r1, _ = (rows or slice(None)).indices(self.N)
        data, scales_t, _, K, block, kind, gs = self._args()
        return _rows(data, scales_t, K, block, kind, gs, r0, max(r0, r1))

    def _args(self) -> tuple:
        return (self.data, self.scales_t, self.N, self.K, self.block, self.scale_kind, self.global_scale)

    def matmul(self, x: torch.Tensor, isa: str = "auto") -> torch.Tensor:
        """``x [..., K]`` (float32/bfloat16/float16) -> ``[..., N]`` in ``x``'s dtype (float32 sums): the LUT
        GEMV on path ``isa`` (``auto``/``avx512``/``avx2``/``portable``) up to ``SUPPORTS_ROWS[1]`` rows,
        tiles above (and without the extension); through the operator :func:`fp4_gemv` (a compiled graph
        calls the extension's own ``bitmosaic::fp4_gemv_ext`` where the GEMV runs: C++ through the
        dispatcher, no Python kernel between, as :mod:`.ops` does for the other extensions)."""
        if x.shape[-1] != self.K:
            raise ValueError(f"x has {x.shape[-1]} features but the weight has {self.K} input columns")
        if isa != "auto" and isa not in ISAS:
            raise ValueError(f"isa must be one of auto, {', '.join(ISAS)}, got {isa!r}")
        x2 = x.reshape(math.prod(x.shape[:-1]), self.K).float()
        if torch.compiler.is_compiling() and x2.shape[0] <= GEMV_ROWS and ext_isa("fp4_gemv_ext", isa) >= 0:
            y = torch.ops.bitmosaic.fp4_gemv_ext.default(x2, *self._args(), ext_isa("fp4_gemv_ext", isa))
        else:
            y = fp4_gemv(x2, *self._args(), isa)
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
