"""The bit-plane lookup-table matmul (SFMP §4.5, App. B, G; T-MAC): ``y = x Wᵀ`` from one-bit planes.

:class:`BitPlaneWeight` is a drop-in for :class:`bitmosaic.kernels.qmatmul.LowBitWeight`: the same
``from_codes(codes, bits, scales, zeros, group_size, row_block=None)``, ``matmul``, ``dequantize``
and ``nbytes``, with ``W = (c - z) * s``.  A block is ``row_block`` rows x ``group_size`` columns
and has one width in 1..8 (``bits`` an int or ``[ceil(N / row_block), G]``).  The codes are held in
the block-major bit-plane layout of :mod:`bitmosaic.formats.bitplane` (built at load time; the
saved format stays the source of truth); scales and zero-points are float32, kept transposed
``[G, N]`` so that 16 rows of one group are contiguous.

Kernels (``csrc/lutgemv.cpp``, a torch C++ extension built on first use and cached by torch,
:mod:`bitmosaic.kernels.build`):

* **batch 1** (decode): the LUT GEMV.  With the ±1 form (App. B Eq. 17: ``ŝ = s/2``,
  ``Ŵ_i = 2 W_i - 1``, ``ẑ = s ((2^q - 1)/2 - z)``), ``y = Σ_g ŝ Σ_i 2^i (Σ_j Ŵ_i[j] x_j) + ẑ·Σ_g x``;
  the inner sums are table lookups.  AVX-512 (``vpermps``, 16 rows at once) and AVX2 (two 8-entry
  lookups and a blend, 8 rows at once) use tables of all 16 signed sums of 4 activations; the portable
  loop uses tables of 8 activations with 128 stored entries (the other half by negation).  The tables
  are float32, so the result equals ``dequantize`` + matmul up to float rounding.  The AVX2 and AVX-512
  tiles are one body over vector traits (``csrc/lutgemv_simd.h``).  The ISA is chosen per call
  (:mod:`bitmosaic.kernels.isa`: ``isa="auto"`` is ``$BITMOSAIC_KERNEL_ISA`` or the best this CPU
  has; a name forces one).  Quantised (int8) tables, as
  T-MAC uses, would change the numerics and are not offered.
* **2-64 rows**: the GEMV once per row (faster than tiles there, ``lut_gemv.py --batch``).
* **more rows** (prefill): a tile of rows is dequantized (exactly ``(c - z) * s``) into a small
  buffer and multiplied with ``torch.mm``; the float weight never exists whole.

Capabilities (read by :func:`bitmosaic.kernels.select.select_kernel`): any width 1-8 per block, CPU,
any group size; the measured choice at 1-3 bits and 1-64 rows of x with its compiled extension
(``FAST_BITS``, the measurements are noted there), so the packed kinds (RTN, GPTQ, AWQ, ...) decode on it
at 1-3 bits, and on ``LowBitWeight`` from 4 bits except in groups smaller than (or not a multiple of)
64, where ``LowBitWeight`` measured slower (its ``FAST_GROUP_SIZE_MULTIPLE``): there neither is "fast"
and the packed kinds' first runnable kernel, this one, runs them.

Measured (``benchmarks/kernels/lut_gemv.py``, ``benchmarks/results/lut_gemv.md``, AVX-512 path,
batch 1): faster than the unpack+FMA ``LowBitWeight`` at 1-4 bits on every measured shape, slower at 8
bits; latency grows linearly with bits (R² 0.97-0.99; W1/W4 0.2-0.7, W8/W4 about 2).  The GEMV prefetches the
tile four ahead: without it, weights that stream from memory (every layer of a decode step) left
its loads waiting and it lost to ``LowBitWeight`` end to end.

Without a compiler (or with ``BITMOSAIC_NO_EXT=1``) every batch runs the pure-torch tiled
dequantize + mm, after one warning.  :func:`lut_gemv_reference` is the pure-PyTorch statement of the
LUT algorithm with ``g = 8`` and 128 stored table entries, for tests.
"""

from __future__ import annotations

import math

import torch

from ..formats import bitplane as bp
from . import build, ops, tiles
from .isa import ISAS
from .torch_paths import bitplane_dequantize

__all__ = ["BitPlaneWeight", "extension", "lut_gemv_reference"]


def extension():
    """The compiled LUT extension, or ``None`` (no compiler, build failure, or ``BITMOSAIC_NO_EXT=1``)."""
    return build.load("lutgemv")


def _transposed(attr: str) -> property:
    """An ``[N, G]`` float32 property stored transposed (``[G, N]``, contiguous) in ``attr``."""
    return property(
        lambda self: getattr(self, attr).T.contiguous(),
        lambda self, value: setattr(self, attr, value.float().T.contiguous()),
    )


class BitPlaneWeight:
    """A low-bit weight in the bit-plane layout; ``matmul`` never builds the whole float weight."""

    KERNEL_NAME = "lut"
    SUPPORTS_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
    SUPPORTS_MIXED_BITS = True
    SUPPORTS_DEVICES = ("cpu",)
    SUPPORTS_GROUP_SIZE_MULTIPLE = 1
    SUPPORTS_ROWS = (1, 64)  # the GEMV per row up to 64 rows (lut_gemv.py --batch); tiles above
    # 1-3 bits: decoding SmolLM2 end to end (1 thread), W2 51.2 / W3 50.0 tok/s against 42.7 / 43.4 on
    # LowBitWeight (decode.md, the "(FMA)" rows; +15-20% in each of three runs).  At 4 bits it is faster
    # per call too, but end to end it measured +4% on 1 thread and -13% on 2 (one run, noisy).
    FAST_BITS = (1, 2, 3)
    NEEDS_COMPILED = True  # its pure-torch fallback is no faster than LowBitWeight's

    @staticmethod
    def compiled() -> bool:
        return extension() is not None

    def __init__(self, planes: bp.BitPlanes, scales_t: torch.Tensor, zeros_t: torch.Tensor):
        self.planes = planes
        self.scales_t, self.zeros_t = scales_t, zeros_t  # float32 [G, N]
        self.N, self.K = planes.N, planes.K
        self.group_size, self.row_block = planes.group_size, planes.row_block

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        bits: int | torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | float,
        group_size: int,
        row_block: int | None = None,
    ) -> BitPlaneWeight:
        """Build from integer ``codes [N, K]`` (each in ``[0, 2**bits)`` of its block), ``scales``
        ``[N, G]``, ``zeros`` ``[N, G]`` or a number, ``group_size`` (``-1`` or ``>= K``: one group per
        row) and per-block ``bits`` (an int, or ``[ceil(N / row_block), G]``) -- exactly the
        arguments of ``LowBitWeight.from_codes``.  Blocks are ``row_block`` x ``group_size``."""
        if not torch.is_tensor(codes) or codes.dim() != 2 or codes.is_floating_point():
            raise ValueError("codes must be a 2-D integer tensor [out, in]")
        N, K = codes.shape
        gs, _, _ = bp.normalize_geometry(N, K, group_size, row_block, bits)
        G = -(-K // gs) if K else 0
        if not torch.is_tensor(scales) or tuple(scales.shape) != (N, G):
            raise ValueError(
                f"scales must be [out={N}, groups={G}] for group size {gs}, got "
                f"{tuple(scales.shape) if torch.is_tensor(scales) else type(scales).__name__}"
            )
        if torch.is_tensor(zeros) and tuple(zeros.shape) != (N, G):
            raise ValueError(f"zeros must be a number or [out={N}, groups={G}], got {tuple(zeros.shape)}")
        planes = bp.pack(codes, bits, group_size, row_block)
        z = zeros.float() if torch.is_tensor(zeros) else torch.full((N, G), float(zeros))
        return cls(planes, scales.float().T.contiguous(), z.T.contiguous())

    # [N, G] float32, as LowBitWeight's (the kernels keep them transposed in scales_t / zeros_t)
    scales = _transposed("scales_t")
    zeros = _transposed("zeros_t")

    def _args(self):
        p = self.planes
        return (p.data, p.offsets, p.bits, self.scales_t, self.zeros_t, p.N, p.K, p.group_size, p.row_block)

    def nbytes(self) -> int:
        """Bytes held: the planes, the offset table, the bit map, scales and zero-points."""
        p = self.planes
        ts = (p.data, p.offsets, p.bits, self.scales_t, self.zeros_t)
        return sum(t.numel() * t.element_size() for t in ts)

    def bits_accounting(self) -> dict:
        """Every stored bit of this weight (:func:`bitplane.bits_accounting`; float32 scales/zeros)."""
        return bp.bits_accounting(self.planes, scale_bits=32, zero_bits=32)

    def matmul(
        self,
        x: torch.Tensor,
        isa: str = "auto",
        in_index: torch.Tensor | None = None,
        out_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [..., K]`` (float32/bfloat16/float16) -> ``[..., N]`` in ``x``'s dtype (float32 sums).
        1-64 rows of ``x``: the LUT GEMV (per row) on path ``isa`` (``auto``/``avx512``/``avx2``/
        ``portable``); more rows: the tiled dequantize + mm.  ``in_index`` (int32/int64 ``[K]``):
        multiply ``x[..., in_index]`` instead; ``out_index`` (int32/int64 ``[n]``): return
        ``y[..., out_index]``.  The compiled path does both inside the call (SFMP's permutations,
        §4.4 Eq. 14; act-order groups), exactly equal to the two ``index_select`` around it."""
        if x.shape[-1] != self.K:
            raise ValueError(f"x has {x.shape[-1]} features but the weight has {self.K} input columns")
        if isa != "auto" and isa not in ISAS:
            raise ValueError(f"isa must be one of auto, {', '.join(ISAS)}, got {isa!r}")
        x2 = x.reshape(math.prod(x.shape[:-1]), self.K).float()
        tile = max(8, tiles.PREFILL_TILE_ELEMS // max(self.K, 1))
        n_out = self.N if out_index is None else out_index.numel()
        y = ops.lut_matmul(x2, *self._args(), tile, isa, in_index, out_index)  # the extension, else torch
        return y.reshape(*x.shape[:-1], n_out).to(x.dtype)

    def dequantize(self, rows: slice | None = None) -> torch.Tensor:
        """Rows of ``W`` in float32, exactly ``(c - z) * s``."""
        r0, r1, _ = (rows or slice(None)).indices(self.N)
        r1 = max(r0, r1)
        ext = extension()
        if ext is not None:
            return ext.dequantize(*self._args(), r0, r1)
        return self._dequantize_torch(r0, r1)

    def _dequantize_torch(self, r0: int, r1: int) -> torch.Tensor:
        return bitplane_dequantize(self.planes, self.scales_t, self.zeros_t, r0, r1)


# signs of the 128 stored entries of an 8-activation table: entry p (bit 7 clear) = Σ_t ±x_t
_SIGNS8 = ((torch.arange(128).unsqueeze(1) >> torch.arange(8)) & 1).float() * 2 - 1  # [128, 8]


def lut_gemv_reference(w: BitPlaneWeight, x: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch LUT GEMV (App. B, G) for one activation row ``x [K]`` -> ``[N]`` (float32).

    Per group, the activations are cut into runs of ``g = 8`` (zero past the group's end); each run
    gets a table of the 128 signed sums ``Σ_t (2 p_t - 1) x_t`` with bit 7 of ``p`` clear; a byte ``u``
    of a plane word reads ``T[u]`` when ``u < 128`` and ``-T[255 - u]`` otherwise (mirror).  Planes
    add with weight ``2^i``; then ``ŝ·(...) + ẑ·Σx`` per group (:func:`bitplane.pm_affine`)."""
    p = w.planes
    x = x.reshape(-1).float()
    if x.numel() != p.K:
        raise ValueError(f"x has {x.numel()} features but the weight has {p.K} input columns")
    y = torch.zeros(p.N, dtype=torch.float32)
    s_hat, z_hat = bp.pm_affine(w.scales_t.T, w.zeros_t.T, bp.row_bits(p))
    for g in range(p.n_groups):
        c0, c1 = p.block_cols(g)
        nch = -(-(c1 - c0) // bp.WORD_COLS)
        xg = torch.nn.functional.pad(x[c0:c1], (0, nch * bp.WORD_COLS - (c1 - c0))).reshape(-1, 8)
        table = xg @ _SIGNS8.T  # [nch * 4, 128]
        for rb in range(p.bits.shape[0]):
            r0, r1 = p.block_rows(rb)
            q = int(p.bits[rb, g])
            words = bp.block_words(p, rb, g)  # [R, nch, q]
            u = (words.unsqueeze(-1) >> torch.arange(0, 32, 8)) & 0xFF  # [R, nch, q, 4] bytes
            neg = u >= 128
            look = torch.where(neg, 255 - u, u)
            run = (torch.arange(nch).reshape(1, nch, 1, 1) * 4 + torch.arange(4)).expand_as(look)
            vals = table[run, look]
            vals = torch.where(neg, -vals, vals)
            plane_sums = vals.sum((1, 3))  # [R, q]
            acc = (plane_sums * (2.0 ** torch.arange(q))).sum(1)
            y[r0:r1] += s_hat[r0:r1, g] * acc + z_hat[r0:r1, g] * x[c0:c1].sum()
    return y
