"""Block-major bit-plane layout of integer codes with a per-block bit width (SFMP §4.5, App. B, G).

Geometry
--------
A weight ``[N, K]`` of integer codes is cut into blocks of ``m_b = row_block`` rows times
``n_b = group_size`` columns (partial blocks at the bottom and on the right are allowed).  Block
``(rb, g)`` holds codes of one width ``q = bits[rb, g]`` in 1..8, so any mix of widths lives in one
matrix.  Blocks are stored contiguously, one after another in row-major order of the block grid;
``offsets[rb, g]`` is the byte offset of block ``(rb, g)`` in ``data`` (the per-block offset table)
and ``bits`` ``[n_rb, G]`` (uint8) is the bit-width map.

Inside a block (``R`` rows, ``L`` columns, width ``q``)
--------------------------------------------------------
Each code ``c = Σ_i 2^i W_i`` is split into ``q`` one-bit planes ``W_i ∈ {0, 1}`` (App. B, Eq. 15).
The planes are packed along the reduction dimension: the bits of 32 consecutive columns of one row
and one plane form one little-endian 32-bit word (bit ``t`` = column ``32c + t`` of the block).  A
block has ``nch = ceil(L / 32)`` such column chunks; columns past ``L`` are zero bits (padding).
Rows are taken in tiles of ``TILE_ROWS = 16`` (the last tile of a block may be shorter, ``R' < 16``
rows), and a tile stores, for each chunk ``c`` and then each plane ``i`` (0 = least significant),
the ``R'`` words of its rows one after another::

    block = tile 0 | tile 1 | ...       tile = [chunk c][plane i][row r] -> uint32 (4 bytes, LE)

so the word of (row ``r`` of the tile, chunk ``c``, plane ``i``) is at byte
``4 * ((c * q + i) * R' + r)`` of its tile and a full tile is ``64 * nch * q`` bytes.  Sixteen
consecutive rows of one plane and chunk are one 64-byte vector: the batch-1 kernel
(:mod:`bitmosaic.kernels.lut`) looks up 16 rows at once, and reads every block front to back.

±1 re-parameterisation (App. B, Eq. 16-17)
-------------------------------------------
Here a weight is ``W = (c - z) * s`` (the project's convention: ``z`` is a zero-point in code
units).  The paper writes ``Ŵ = Σ_i 2^i s W_i + z_p`` with an additive zero ``z_p = -z s``, and sets
``ŝ = s / 2``, ``Ŵ_i = 2 W_i - 1 ∈ {-1, +1}``, ``ẑ = z_p + s (2^q - 1) / 2``.  In our convention::

    W = Σ_i 2^i ŝ Ŵ_i + ẑ,   ŝ = s / 2,   ẑ = s ((2^q - 1) / 2 - z)          (:func:`pm_affine`)

so a stored bit 1 means ``+1`` and a stored bit 0 means ``-1``; padding bits (0 = ``-1``) must meet
zero activations.  ``y = Σ_g ŝ Σ_i 2^i (Σ_j Ŵ_i[j] x_j) + ẑ Σ_{j in g} x_j`` -- the last term is the
folded zero-point ``ẑ·Σx``.  The stored buffers hold only the planes; ``ŝ``/``ẑ`` follow from the
per-group scales and zero-points and the block's ``q``.

Everything here is pure and exact: :func:`pack` / :func:`unpack` round-trip any codes,
:func:`bits_accounting` counts every stored bit, :func:`dequantize` is the reference
``(c - z) * s``.  Layout version :data:`BITPLANE_VERSION`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import dequantize as dequantize_groups

__all__ = [
    "BITPLANE_VERSION",
    "TILE_ROWS",
    "WORD_COLS",
    "BitPlanes",
    "normalize_geometry",
    "pack",
    "unpack",
    "block_words",
    "pm_affine",
    "row_bits",
    "dequantize",
    "bits_accounting",
]

BITPLANE_VERSION = 1
TILE_ROWS = 16  # rows per tile: one 64-byte vector of 32-bit words
WORD_COLS = 32  # columns per word (bits along the reduction dimension)


@dataclass(frozen=True)
class BitPlanes:
    """The packed buffers (module doc): ``data`` uint8, ``offsets`` int64 ``[n_rb, G]`` (bytes),
    ``bits`` uint8 ``[n_rb, G]``, and the geometry ``N, K, group_size, row_block``."""

    data: torch.Tensor
    offsets: torch.Tensor
    bits: torch.Tensor
    N: int
    K: int
    group_size: int
    row_block: int

    @property
    def n_groups(self) -> int:
        return self.bits.shape[1]

    def block_rows(self, rb: int) -> tuple[int, int]:
        r0 = rb * self.row_block
        return r0, min(self.N, r0 + self.row_block)

    def block_cols(self, g: int) -> tuple[int, int]:
        c0 = g * self.group_size
        return c0, min(self.K, c0 + self.group_size)


def normalize_geometry(N: int, K: int, group_size, row_block, bits) -> tuple[int, int, torch.Tensor]:
    """``(group_size, row_block, bits map uint8 [n_rb, G])`` from the ``from_codes`` arguments:
    ``group_size`` ``-1``/``None``/``>= K`` means one group per row; ``row_block`` ``None`` means one
    row block; ``bits`` is an int in 1..8 or an integer tensor ``[n_rb, G]``."""
    gs = K if group_size is None or group_size < 0 or group_size >= K else int(group_size)
    gs = max(gs, 1)
    G = -(-K // gs) if K else 0
    rb = N if row_block is None else int(row_block)
    if rb < 1 and N:
        raise ValueError(f"row_block must be >= 1 (rows per block), got {row_block}")
    rb = max(rb, 1)
    n_rb = -(-N // rb) if N else 0
    if isinstance(bits, bool) or not (isinstance(bits, int) or torch.is_tensor(bits)):
        raise ValueError(f"bits must be an int in 1..8 or an integer tensor [n_rb, G], got {bits!r}")
    if isinstance(bits, int):
        if not 1 <= bits <= 8:
            raise ValueError(f"bits must be in 1..8, got {bits}")
        return gs, rb, torch.full((n_rb, G), bits, dtype=torch.uint8)
    if bits.is_floating_point() or tuple(bits.shape) != (n_rb, G):
        raise ValueError(
            f"bits must be an integer tensor [row blocks={n_rb}, groups={G}] (row_block={rb}, "
            f"group_size={gs}), got {bits.dtype} {tuple(bits.shape)}"
        )
    if bits.numel() and (int(bits.min()) < 1 or int(bits.max()) > 8):
        raise ValueError(f"every block's bits must be in 1..8, got {int(bits.min())}..{int(bits.max())}")
    return gs, rb, bits.to(torch.uint8).contiguous()


def _block_nbytes(rows: int, cols: int, q: int) -> int:
    return rows * (-(-cols // WORD_COLS)) * q * 4


def _bytes_to_tiles(wb: torch.Tensor) -> torch.Tensor:
    """``[R, nch, q, 4]`` uint8 (each word's little-endian bytes) -> the block's byte stream (tiles
    of 16 rows, module doc)."""
    R, nch, q, _ = wb.shape
    full = R // TILE_ROWS * TILE_ROWS
    parts = [wb[:full].reshape(-1, TILE_ROWS, nch, q, 4).permute(0, 2, 3, 1, 4).reshape(-1)]
    if full < R:
        parts.append(wb[full:].permute(1, 2, 0, 3).reshape(-1))
    return torch.cat(parts)


def _transpose8(x: torch.Tensor) -> torch.Tensor:
    """8x8 bit transpose of each int64 (byte ``t`` bit ``i`` -> byte ``i`` bit ``t``; delta swaps,
    Hacker's Delight §7-3).  The masks drop the sign bits an arithmetic shift brings in."""
    for shift, mask in ((7, 0x00AA00AA00AA00AA), (14, 0x0000CCCC0000CCCC), (28, 0x00000000F0F0F0F0)):
        t = (x ^ (x >> shift)) & mask
        x = x ^ t ^ (t << shift)
    return x


def pack(codes: torch.Tensor, bits, group_size: int, row_block: int | None = None) -> BitPlanes:
    """Pack integer ``codes [N, K]`` (block ``(rb, g)``'s codes in ``[0, 2**bits[rb, g])``) into the
    block-major bit-plane layout.  ``bits``/``group_size``/``row_block`` as :func:`normalize_geometry`."""
    if not torch.is_tensor(codes) or codes.dim() != 2 or codes.is_floating_point():
        raise ValueError("codes must be a 2-D integer tensor [out, in]")
    N, K = codes.shape
    gs, rbs, bmap = normalize_geometry(N, K, group_size, row_block, bits)
    n_rb, G = bmap.shape
    codes = codes.to(torch.int32)
    offsets = torch.zeros(n_rb, G, dtype=torch.int64)
    chunks, pos = [], 0
    for rb in range(n_rb):
        rows = codes[rb * rbs : (rb + 1) * rbs]
        for g in range(G):
            q = int(bmap[rb, g])
            blk = rows[:, g * gs : (g + 1) * gs].contiguous()
            if blk.numel() and (int(blk.min()) < 0 or int(blk.max()) >= 1 << q):
                raise ValueError(
                    f"codes of block (rows {rb * rbs}.., group {g}) lie in [{int(blk.min())}, "
                    f"{int(blk.max())}], outside its {q}-bit range [0, {(1 << q) - 1}]"
                )
            R, L = blk.shape
            nch = -(-L // WORD_COLS)
            padded = torch.nn.functional.pad(blk, (0, nch * WORD_COLS - L)).to(torch.uint8)
            # 8 codes (one byte each) as one int64; its bit transpose holds in byte i the plane-i byte
            # of those 8 columns (bit t = column t): byte k of a plane word covers columns 8k .. 8k+7
            planes = _transpose8(padded.reshape(R, -1).view(torch.int64)).view(torch.uint8)
            wb = planes.reshape(R, nch, 4, 8)[..., :q].permute(0, 1, 3, 2)  # [R, nch, q, 4]
            offsets[rb, g] = pos
            stream = _bytes_to_tiles(wb)
            pos += stream.numel()
            chunks.append(stream)
    data = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)
    return BitPlanes(data.contiguous(), offsets, bmap, N, K, gs, rbs)


def block_words(p: BitPlanes, rb: int, g: int, t0: int = 0, t1: int | None = None) -> torch.Tensor:
    """The words ``[rows, nch, q]`` (int64) of row tiles ``t0 .. t1`` (exclusive; all by default) of
    block ``(rb, g)``, read from those tiles' bytes only."""
    br0, br1 = p.block_rows(rb)
    c0, c1 = p.block_cols(g)
    R, L, q = br1 - br0, c1 - c0, int(p.bits[rb, g])
    nt = -(-R // TILE_ROWS)
    t1 = nt if t1 is None else min(t1, nt)
    rows = max(0, min(R, t1 * TILE_ROWS) - t0 * TILE_ROWS)
    nch = -(-L // WORD_COLS)
    start = int(p.offsets[rb, g]) + _block_nbytes(t0 * TILE_ROWS, L, q)
    raw = p.data[start : start + _block_nbytes(rows, L, q)].to(torch.int64).reshape(-1, 4)
    w = (raw << torch.arange(0, 32, 8)).sum(1)
    full = rows // TILE_ROWS * TILE_ROWS  # only the block's last tile can be short
    parts = [w[: full * nch * q].reshape(-1, nch, q, TILE_ROWS).permute(0, 3, 1, 2).reshape(-1, nch, q)]
    if full < rows:
        parts.append(w[full * nch * q :].reshape(nch, q, rows - full).permute(2, 0, 1))
    return torch.cat(parts)


def _decode_words(words: torch.Tensor, cols: int) -> torch.Tensor:
    """``[R, nch, q]`` words -> codes ``[R, cols]`` int32 (Σ_i 2^i · plane bit)."""
    R, nch, q = words.shape
    bits = (words.unsqueeze(-1) >> torch.arange(WORD_COLS)) & 1  # [R, nch, q, 32]
    codes = (bits << torch.arange(q).reshape(1, 1, q, 1)).sum(2)  # [R, nch, 32]
    return codes.reshape(R, nch * WORD_COLS)[:, :cols].to(torch.int32)


def unpack(p: BitPlanes, rows: slice | None = None) -> torch.Tensor:
    """Codes ``[r1 - r0, K]`` (int32) of the given rows (all by default); the exact inverse of
    :func:`pack`."""
    r0, r1, _ = (rows or slice(None)).indices(p.N)
    r1 = max(r0, r1)
    out = torch.empty(r1 - r0, p.K, dtype=torch.int32)
    for rb in range(r0 // p.row_block if p.N else 0, -(-r1 // p.row_block) if r1 > r0 else 0):
        br0, br1 = p.block_rows(rb)
        lo, hi = max(br0, r0), min(br1, r1)
        if lo >= hi:
            continue
        t0, t1 = (lo - br0) // TILE_ROWS, -(-(hi - br0) // TILE_ROWS)
        skip = lo - br0 - t0 * TILE_ROWS
        for g in range(p.n_groups):
            c0, c1 = p.block_cols(g)
            codes = _decode_words(block_words(p, rb, g, t0, t1), c1 - c0)
            out[lo - r0 : hi - r0, c0:c1] = codes[skip : skip + hi - lo]
    return out


def _expand(t, N: int, G: int) -> torch.Tensor:
    return t.float() if torch.is_tensor(t) else torch.full((N, G), float(t))


def pm_affine(scales: torch.Tensor, zeros, bits_per_group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ±1 form's ``(ŝ, ẑ)`` ``[N, G]`` (module doc, App. B Eq. 17): ``ŝ = s/2``,
    ``ẑ = s ((2^q - 1)/2 - z)``, with ``q = bits_per_group`` ``[N, G]`` (each row's block width)."""
    dt = torch.promote_types(scales.dtype, torch.float32)  # float32, or float64 for float64 scales
    s = scales.to(dt)
    z = zeros.to(dt) if torch.is_tensor(zeros) else torch.full(s.shape, float(zeros), dtype=dt)
    half_range = ((1 << bits_per_group.to(torch.int64)) - 1).to(dt) / 2
    return s / 2, s * (half_range - z)


def row_bits(p: BitPlanes) -> torch.Tensor:
    """The bit width of every (row, group): ``[N, G]`` int64."""
    return p.bits.to(torch.int64).repeat_interleave(p.row_block, 0)[: p.N]


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros, group_size: int) -> torch.Tensor:
    """The reference ``W = (c - z) * s`` in float32 (``z`` a number or ``[N, G]``)."""
    N, K = codes.shape
    gs = K if group_size is None or group_size < 0 or group_size >= K else max(int(group_size), 1)
    return dequantize_groups(codes, scales, _expand(zeros, N, scales.shape[1]), torch.arange(K) // gs)


def bits_accounting(p: BitPlanes, scale_bits: int = 32, zero_bits: int | None = 32) -> dict:
    """Every stored bit: ``code_bits`` (Σ block codes × q, the information), ``padding_bits`` (zero
    bits that complete 32-column words), ``plane_bits`` = their sum = ``8 * data.numel()``,
    ``offset_bits`` (int64 per block), ``bitmap_bits`` (uint8 per block), ``scale_bits`` and
    ``zero_bits`` (``N × G`` numbers of the given widths; ``zero_bits=None`` for one shared
    zero-point, counted as one number of 32 bits), their ``total_bits`` and ``bits_per_weight``."""
    code_bits = 0
    for rb in range(p.bits.shape[0]):
        r0, r1 = p.block_rows(rb)
        for g in range(p.n_groups):
            c0, c1 = p.block_cols(g)
            code_bits += (r1 - r0) * (c1 - c0) * int(p.bits[rb, g])
    plane_bits = 8 * p.data.numel()
    nblocks = p.bits.numel()
    out = {
        "code_bits": code_bits,
        "padding_bits": plane_bits - code_bits,
        "plane_bits": plane_bits,
        "offset_bits": 64 * nblocks,
        "bitmap_bits": 8 * nblocks,
        "scale_bits": scale_bits * p.N * p.n_groups,
        "zero_bits": 32 if zero_bits is None else zero_bits * p.N * p.n_groups,
    }
    out["total_bits"] = sum(
        out[k] for k in ("plane_bits", "offset_bits", "bitmap_bits", "scale_bits", "zero_bits")
    )
    out["bits_per_weight"] = out["total_bits"] / max(p.N * p.K, 1)
    return out
