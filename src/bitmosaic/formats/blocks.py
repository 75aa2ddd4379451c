"""Block-major storage of a matrix of codes with one bit width per block (SFMP §4.5, Fig. 5).

The ``[N, K]`` codes are cut into ``block_rows x block_cols`` blocks (the last row / column block
may be partial); blocks are stored one after the other, row block by row block, each block's codes
in row-major order packed densely at the block's width ``b`` in 1..8: chunks of 8 codes in ``b``
bytes, little-endian (code ``i`` of a chunk in bits ``b*i .. b*i+b-1``; the scheme of
:mod:`bitmosaic.formats.packing`, extended to 1 bit); a block's last chunk is zero-padded.  The
per-block byte offsets follow from the bit map (:func:`block_offsets`) and are not stored.

This is the saved (source-of-truth) layout; kernels re-layout it at load time.
"""

from __future__ import annotations

import torch

__all__ = ["block_offsets", "pack_blocks", "unpack_blocks", "packed_block_bytes"]


def _extent(i: int, block: int, total: int) -> tuple[int, int]:
    return i * block, min(total, (i + 1) * block)


def packed_block_bytes(n_codes: int, bits: int) -> int:
    return -(-n_codes // 8) * bits


def block_offsets(shape, bits: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """Byte offset of every block (``[n_rb, n_cb]`` int64) and, as the last entry of the flat
    order, the total: returns ``[n_rb * n_cb + 1]``."""
    N, K = shape
    n_rb, n_cb = bits.shape
    sizes = []
    for r in range(n_rb):
        r0, r1 = _extent(r, block_rows, N)
        for c in range(n_cb):
            c0, c1 = _extent(c, block_cols, K)
            sizes.append(packed_block_bytes((r1 - r0) * (c1 - c0), int(bits[r, c])))
    return torch.cumsum(torch.tensor([0] + sizes, dtype=torch.int64), 0)


def _pack_flat(codes: torch.Tensor, b: int) -> torch.Tensor:
    c = torch.nn.functional.pad(codes.to(torch.int64), (0, -codes.numel() % 8)).reshape(-1, 8)
    words = (c << (torch.arange(8, dtype=torch.int64) * b)).sum(1)
    return words.view(torch.uint8).reshape(-1, 8)[:, :b].reshape(-1)


def _unpack_flat(data: torch.Tensor, b: int, n: int) -> torch.Tensor:
    chunks = data.reshape(-1, b)
    words = torch.zeros(chunks.shape[0], 8, dtype=torch.uint8)
    words[:, :b] = chunks
    w = words.view(torch.int64)  # little-endian hosts (x86, arm64)
    out = (w >> (torch.arange(8, dtype=torch.int64) * b)) & ((1 << b) - 1)
    return out.reshape(-1)[:n]


def pack_blocks(codes: torch.Tensor, bits: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """Block-major packed bytes (uint8 ``[total]``) of ``codes [N, K]`` with widths ``bits [n_rb, n_cb]``."""
    N, K = codes.shape
    n_rb, n_cb = bits.shape
    if (n_rb, n_cb) != (-(-N // block_rows), -(-K // block_cols)):
        raise ValueError(
            f"bit map {tuple(bits.shape)} does not match {N}x{K} in {block_rows}x{block_cols} blocks"
        )
    out = []
    codes = codes.cpu()
    for r in range(n_rb):
        r0, r1 = _extent(r, block_rows, N)
        for c in range(n_cb):
            c0, c1 = _extent(c, block_cols, K)
            b = int(bits[r, c])
            blk = codes[r0:r1, c0:c1]
            if blk.numel() and (int(blk.min()) < 0 or int(blk.max()) >= 1 << b):
                raise ValueError(f"codes of block ({r}, {c}) do not fit its {b} bits")
            out.append(_pack_flat(blk.reshape(-1), b))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.uint8)


def unpack_blocks(
    data: torch.Tensor, shape, bits: torch.Tensor, block_rows: int, block_cols: int
) -> torch.Tensor:
    """Inverse of :func:`pack_blocks` -> int32 codes ``[N, K]``."""
    N, K = shape
    off = block_offsets(shape, bits, block_rows, block_cols)
    if data.numel() != int(off[-1]):
        raise ValueError(f"packed blocks hold {data.numel()} bytes, the bit map needs {int(off[-1])}")
    out = torch.empty(N, K, dtype=torch.int32)
    data = data.cpu()
    n_rb, n_cb = bits.shape
    for r in range(n_rb):
        r0, r1 = _extent(r, block_rows, N)
        for c in range(n_cb):
            c0, c1 = _extent(c, block_cols, K)
            i = r * n_cb + c
            seg = data[int(off[i]) : int(off[i + 1])]
            n = (r1 - r0) * (c1 - c0)
            out[r0:r1, c0:c1] = (
                _unpack_flat(seg, int(bits[r, c]), n).reshape(r1 - r0, c1 - c0).to(torch.int32)
            )
    return out
