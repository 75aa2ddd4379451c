"""The CPU low-bit matmul: ``y = x Wᵀ`` from packed integer codes, never a float ``W``.

Layout (``LAYOUT_VERSION = 2``), built at load time from the saved format by
:meth:`LowBitWeight.from_codes` (the saved format stays the source of truth):

* rows are cut into row blocks of ``row_block`` rows; block ``(rb, g)`` -- the rows of ``rb`` times
  the columns of group ``g`` -- has one bit width ``bits[rb, g]`` in 1..8, so any mix of widths
  per block (SFMP) lives in one matrix;
* every row of a row block has the same byte length; within it, the groups follow each other;
* a group of ``len`` codes at width ``b`` is cut into **spans of 64 codes** (the last one padded with zero
  codes, whose activations the kernel never reads) -- except **shared spans**: a row block whose groups
  have one width and 16 or 32 codes each (``K`` a multiple of 64) holds its rows' codes in spans of 64 as
  one group would, group ``g`` from code ``g gs mod 64`` of span ``g gs // 64`` (its offset that span's),
  so g32 and g16 take their bits and no padding (padded, 4-bit g32 took 8 bits per weight); the kernels
  know them by a second group starting in the first one's span; a span is ``8 b`` bytes read as one
  little-endian bit stream of 16 *lanes* of ``4 b`` bits, lane ``i`` holding codes ``i, 16+i, 32+i, 48+i``
  of the span at bits ``0, b, 2b, 3b`` (:func:`_span_order`).  One AVX-512 register of 16 32-bit lanes
  (AVX2: two registers of 8) gathered from a span, shifted by ``t b`` and masked, holds the 16 consecutive
  codes ``16 t .. 16 t + 15`` -- the same three instructions for every width 1..8, so 2-, 3-, 4- and 8-bit
  blocks and any mix of them take one fast path (layout 1 had SIMD layouts for 2/4/8 bits only; 3 bits and
  mixes ran a slow generic loop);
* ``W[n, j] = (c[n, j] - z[n, g]) * s[n, g]`` with ``g = j // group_size`` (contiguous groups; a
  partial last group is allowed); scales and zero-points are float32 ``[N, G]``.

Kernels (``csrc/qmatmul.cpp``, a torch C++ extension built on first use and cached by torch,
:mod:`bitmosaic.kernels.build`):

* **decode** (at most 8 rows of ``x``): per output row and group, ``s (Σ c x - z Σ x)`` with the group
  sums of ``x`` computed once per call; each span's codes are converted to float once and
  multiplied-added with every row of ``x`` (float32 FMA, no quantized activations).  Rows are split
  across ``torch.get_num_threads()``.
* **prefill** (more rows): each thread dequantizes a tile of weight rows into its own small buffer
  (bitwise equal to the reference; ``tiles.PREFILL_TILE_ELEMS``) and multiplies it with ``torch.mm``
  (single-threaded inside the parallel region) into its rows of ``yᵀ``; ``_TILE_SHARED`` selects
  the older scheme (all threads fill one tile, then one parallel GEMM).

Instruction sets (:mod:`bitmosaic.kernels.isa`): ``avx512``, ``avx2`` and ``portable``, one kernel body
for both SIMD sets over vector traits (``csrc/vec.h``, ``csrc/qmatmul_simd.h``), each compiled for its
target so the extension loads on any x86-64 CPU; every call runs on :func:`~bitmosaic.kernels.isa.kernel_isa`
(the best, or ``$BITMOSAIC_KERNEL_ISA``).  Without a compiler (or with ``BITMOSAIC_NO_EXT=1``) a
pure-torch path with the same API and results runs instead, after one warning.

Capabilities (read by :func:`bitmosaic.kernels.select.select_kernel`): any width 1-8 per block, CPU,
any group size; fast at every width and batch (the GEMV up to 8 rows, tiles above), compiled or not.

Design choice (two designs were measured): this unpack-in-register design is measured in
``benchmarks/kernels/kernels.py`` (``benchmarks/results/kernels.md``); the bit-plane lookup-table design
(T-MAC, SFMP §4.5) is a separate kernel.
"""

from __future__ import annotations

import torch

from ..formats.packing import pack_codes
from . import build, ops, tiles
from .isa import isa_number
from .torch_paths import SPAN, lowbit_dequantize, span_order, tiled_matmul_torch, unpack_any

__all__ = ["LowBitWeight", "extension", "LAYOUT_VERSION", "tiled_matmul_torch"]

LAYOUT_VERSION = 3  # 3: shared spans for groups of 16 / 32
_DECODE_MAX_ROWS = 8
_TILE_SHARED = False  # True: all threads fill one tile, then one parallel GEMM (False: a tile per thread)


def extension():
    """The compiled extension, or ``None`` (no compiler, build failure, or ``BITMOSAIC_NO_EXT=1``)."""
    return build.load("qmatmul")


def _check_bits_map(bits, n_rb: int, G: int) -> torch.Tensor:
    if isinstance(bits, bool):
        raise ValueError(f"bits must be an int in 1..8 or an int tensor, got {bits!r}")
    if isinstance(bits, int):
        if not 1 <= bits <= 8:
            raise ValueError(f"bits must be in 1..8, got {bits}")
        return torch.full((n_rb, G), bits, dtype=torch.uint8)
    if not torch.is_tensor(bits) or bits.is_floating_point() or tuple(bits.shape) != (n_rb, G):
        raise ValueError(
            f"bits must be an int or an integer tensor [row blocks={n_rb}, groups={G}], got "
            f"{tuple(bits.shape) if torch.is_tensor(bits) else type(bits).__name__}"
        )
    if bits.numel() and (int(bits.min()) < 1 or int(bits.max()) > 8):
        raise ValueError(f"every block's bits must be in 1..8, got {int(bits.min())}..{int(bits.max())}")
    return bits.to(torch.uint8).contiguous()


_SPAN, _span_order, _unpack_any = SPAN, span_order, unpack_any  # the layout's span order (torch_paths.py)


def _pack_any(codes: torch.Tensor, b: int, spans: bool = True) -> torch.Tensor:
    """Pack one block's ``codes [rows, len]`` (in range for width ``b`` in 1..8) in the span layout
    (module doc): zero-padded to whole spans, reordered by :func:`_span_order`, then a little-endian bit
    stream (``spans=False``: ``codes`` are padded and in span order already)."""
    rows, cols = codes.shape
    padded = codes.to(torch.uint8)
    if spans:
        order = _span_order(cols)
        padded = torch.nn.functional.pad(padded, (0, order.numel() - cols))[:, order]
    if b >= 2:
        return pack_codes(padded, b)
    c = padded.reshape(rows, -1, 8)
    weights = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8)
    return (c * weights).sum(-1, dtype=torch.int32).to(torch.uint8)


def _pack_row_block(
    rows: torch.Tensor, bits: torch.Tensor, gs: int, r0: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row block's ``codes [R, K]`` at the groups' widths ``bits [G]`` -> (its bytes ``[R, n]``, each
    group's byte offset ``[G]``): the groups' :func:`_pack_any` spans side by side.  When the groups share
    one width and one length (``K = G gs``), they are packed in one call: a group pads to whole spans of
    64 codes and a width-``b`` span is ``8 b`` bytes, so no byte holds two groups and the bytes are the
    per-group concatenation (``tests/kernels/test_qmatmul.py``) for a fraction of the Python work."""
    R, K = rows.shape
    G = bits.numel()
    offs = torch.zeros(G, dtype=torch.int64)
    if G and R and K == G * gs and bool((bits == bits[0]).all()):
        b = int(bits[0])
        lo, hi = (int(v) for v in torch.aminmax(rows))
        if lo >= 0 and hi < 1 << b and G > 1 and gs < SPAN and SPAN % gs == 0 and K % SPAN == 0:
            # shared spans: the row's codes in spans of 64 as one group would be, each group at its
            # columns' offset (group g in span g gs // 64, from code g gs % 64): no padding
            return _pack_any(rows, b), (torch.arange(G, dtype=torch.int64) * gs // SPAN) * (8 * b)
        if lo >= 0 and hi < 1 << b:  # else the loop below names the block
            order = _span_order(gs)
            grouped = rows.to(torch.uint8).reshape(R, G, gs)
            padded = torch.nn.functional.pad(grouped, (0, order.numel() - gs))[..., order]
            out = _pack_any(padded.reshape(R, G * order.numel()), b, spans=False)
            return out, torch.arange(G, dtype=torch.int64) * (order.numel() // 8 * b)
    parts, pos = [], 0
    for g in range(G):
        b = int(bits[g])
        block = rows[:, g * gs : (g + 1) * gs]
        if block.numel() and (int(block.min()) < 0 or int(block.max()) >= 1 << b):
            raise ValueError(
                f"codes of block (rows {r0}.., group {g}) lie in [{int(block.min())}, "
                f"{int(block.max())}], outside the {b}-bit range [0, {(1 << b) - 1}]"
            )
        packed = _pack_any(block, b)
        offs[g] = pos
        pos += packed.shape[1]
        parts.append(packed)
    return (torch.cat(parts, 1) if parts else torch.zeros(R, 0, dtype=torch.uint8)), offs


class LowBitWeight:
    """A low-bit weight in the kernel layout (module doc); ``matmul`` never builds the float weight."""

    KERNEL_NAME = "lowbit"
    SUPPORTS_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
    SUPPORTS_MIXED_BITS = True
    SUPPORTS_DEVICES = ("cpu",)
    SUPPORTS_GROUP_SIZE_MULTIPLE = 1
    SUPPORTS_ROWS = (1, None)
    FAST_BITS = SUPPORTS_BITS
    # Groups shorter than a span (64 codes) cost it a scale per 16 or 32 codes inside the span loop: at
    # 1536x576, 4 bits, 1 thread, one process on a loaded machine, g32 0.111 ms and g16 0.218 ms (shared
    # spans, layout 3) against the bit-plane LUT's 0.059 / 0.123 (before layout 3 each group was padded to
    # 64 codes: g32 0.167 ms, 10 bits per weight resident).  The selector then takes the LUT.
    FAST_GROUP_SIZE_MULTIPLE = 64
    NEEDS_COMPILED = False  # its pure-torch path is the default everywhere else

    @staticmethod
    def compiled() -> bool:
        return extension() is not None

    def __init__(self, data, base, rowlen, goff, bits, scales, zeros, K, group_size, row_block):
        self.data, self.base, self.rowlen, self.goff, self.bits = data, base, rowlen, goff, bits
        self.scales, self.zeros = scales, zeros
        self.K, self.group_size, self.row_block = K, group_size, row_block
        self.N = scales.shape[0]

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        bits: int | torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | float,
        group_size: int,
        row_block: int | None = None,
    ) -> LowBitWeight:
        """Build from integer ``codes [N, K]`` (each in ``[0, 2**bits)`` of its block), ``scales``
        ``[N, G]``, ``zeros`` ``[N, G]`` or a number, ``group_size`` (``-1`` or ``>= K``: one group per
        row) and per-block ``bits`` (an int, or ``[ceil(N / row_block), G]``)."""
        if not torch.is_tensor(codes) or codes.dim() != 2 or codes.is_floating_point():
            raise ValueError("codes must be a 2-D integer tensor [out, in]")
        N, K = codes.shape
        gs = K if group_size is None or group_size < 0 or group_size >= K else int(group_size)
        gs = max(gs, 1)
        G = -(-K // gs) if K else 0
        if tuple(scales.shape) != (N, G):
            raise ValueError(
                f"scales must be [out={N}, groups={G}] for group size {gs}, got {tuple(scales.shape)}"
            )
        rb = N if row_block is None else int(row_block)
        if rb < 1 and N:
            raise ValueError(f"row_block must be >= 1, got {row_block}")
        rb = max(rb, 1)
        n_rb = -(-N // rb) if N else 0
        bmap = _check_bits_map(bits, n_rb, G)
        z = zeros if torch.is_tensor(zeros) else torch.full((N, G), float(zeros))
        if tuple(z.shape) != (N, G):
            raise ValueError(f"zeros must be a number or [out={N}, groups={G}], got {tuple(z.shape)}")
        codes = codes.to(torch.int32)
        chunks, base, rowlen, goff = [], [], [], torch.zeros(n_rb, G, dtype=torch.int64)
        offset = 0
        for r in range(n_rb):
            rows = codes[r * rb : (r + 1) * rb]
            row_bytes, goff[r] = _pack_row_block(rows, bmap[r], gs, r * rb)
            pos = row_bytes.shape[1]
            base.append(offset)
            rowlen.append(pos)
            offset += row_bytes.numel()
            chunks.append(row_bytes.reshape(-1))
        chunks.append(torch.zeros(64, dtype=torch.uint8))  # a span's SIMD load may read 63 bytes on
        data = torch.cat(chunks).contiguous()
        return cls(
            data,
            torch.tensor(base, dtype=torch.int64),
            torch.tensor(rowlen, dtype=torch.int64),
            goff.contiguous(),
            bmap,
            scales.float().contiguous(),
            z.float().contiguous(),
            K,
            gs,
            rb,
        )

    def _args(self):
        return (self.data, self.base, self.rowlen, self.goff, self.bits, self.scales, self.zeros,
                self.K, self.group_size, self.row_block)  # fmt: skip

    def nbytes(self) -> int:
        ts = (self.data, self.base, self.rowlen, self.goff, self.bits, self.scales, self.zeros)
        return sum(t.numel() * t.element_size() for t in ts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` (float32/bfloat16/float16) -> ``[..., N]`` in ``x``'s dtype (float32 sums)."""
        if x.shape[-1] != self.K:
            raise ValueError(f"x has {x.shape[-1]} features but the weight has {self.K} input columns")
        x2 = x.reshape(-1, self.K).float()
        tile = max(8, tiles.PREFILL_TILE_ELEMS // max(self.K, 1))
        tile = -tile if _TILE_SHARED else tile
        y = ops.qmatmul(x2, *self._args(), tile, "auto")  # the extension, else the pure-torch path
        return y.reshape(*x.shape[:-1], self.N).to(x.dtype)

    def dequantize(self, rows: slice | None = None) -> torch.Tensor:
        """Rows of ``W`` in float32, exactly ``(c - z) * s``."""
        r0, r1, _ = (rows or slice(None)).indices(self.N)
        r1 = max(r0, r1)
        ext = extension()
        if ext is not None:
            return ext.dequantize(*self._args(), r0, r1, isa_number(ext=ext))
        return self._dequantize_torch(r0, r1)

    def _dequantize_torch(self, r0: int, r1: int) -> torch.Tensor:
        """The pure-torch path: unpack the rows' groups at their widths, then ``(c - z) * s``."""
        return lowbit_dequantize(*self._args(), r0, r1)
