"""Exact dense bit packing of unsigned integer codes, row by row.

Format
------
A ``[rows, cols]`` matrix of codes in ``0 .. 2**bits - 1`` (``bits`` in :data:`SUPPORTED_BITS`)
is stored as a ``torch.uint8`` matrix ``[rows, ceil(cols / 8) * bits]``:

* every row is packed on its own: it is padded on the right with zero codes to a multiple of
  8 values, so a row never shares a byte with the next one and rows can be sliced freely;
* each chunk of 8 consecutive values occupies exactly ``bits`` bytes (8 x ``bits`` bits), so
  3-bit codes are stored densely (8 codes -> 3 bytes), not in 4-bit slots;
* bit order is little-endian: read the chunk's ``bits`` bytes as a little-endian unsigned
  integer ``W``; value ``i`` of the chunk (``0 <= i < 8``) is ``(W >> (i * bits)) & (2**bits - 1)``.

For 2/4/8 bits this is the familiar "low bits first" nibble/crumb order: byte ``b`` of a row
holds values ``b * 8 // bits ...`` starting at its least significant bits.  Example: 2-bit
``[1, 2, 3, 0, 0, 0, 0, 0]`` packs to bytes ``[0x39, 0x00]`` and 3-bit ``[7, 0, ..., 0]`` to
``[0x07, 0x00, 0x00]``.

This module is the reference implementation (exact, vectorised, simple); the fast CPU path in
:mod:`bitmosaic.kernels.cpu` is tested against it.
"""

from __future__ import annotations

import torch

__all__ = ["SUPPORTED_BITS", "pack_codes", "unpack_codes", "packed_nbytes", "packed_cols"]

SUPPORTED_BITS = (2, 3, 4, 5, 6, 7, 8)  # a chunk of 8 codes is one word of 8*bits <= 64 bits

_CHUNK = 8  # values per chunk; a chunk takes exactly ``bits`` bytes


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(
            f"unsupported bit width {bits!r}: packing supports bits in {SUPPORTED_BITS}; "
            "quantize to one of these widths (or store the codes unpacked)"
        )


def packed_cols(cols: int, bits: int) -> int:
    """Bytes per packed row: ``ceil(cols / 8) * bits``."""
    _check_bits(bits)
    if cols < 0:
        raise ValueError(f"cols must be >= 0, got {cols}")
    return -(-cols // _CHUNK) * bits


def packed_nbytes(rows: int, cols: int, bits: int) -> int:
    """Total bytes of the packed ``[rows, cols]`` code matrix (row padding included)."""
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    return rows * packed_cols(cols, bits)


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer ``codes`` ``[rows, cols]`` into ``uint8`` ``[rows, ceil(cols/8)*bits]``.

    Raises ``ValueError`` for an unsupported ``bits``, a non-2-D or non-integer input, or any
    code outside ``[0, 2**bits - 1]``.
    """
    _check_bits(bits)
    if not torch.is_tensor(codes):
        raise ValueError(f"codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.dim() != 2:
        raise ValueError(
            f"codes must be 2-D [rows, cols], got shape {tuple(codes.shape)}; "
            "reshape to 2-D (e.g. codes.reshape(-1, cols)) before packing"
        )
    if not _is_integer_dtype(codes.dtype):
        raise ValueError(
            f"codes must have an integer dtype, got {codes.dtype}; "
            "round and cast the codes first (e.g. codes.round().to(torch.int32))"
        )
    maxq = (1 << bits) - 1
    rows, cols = codes.shape
    if codes.numel():
        lo, hi = (int(v) for v in torch.aminmax(codes))
        if lo < 0 or hi > maxq:
            n_bad = int(((codes < 0) | (codes > maxq)).sum())
            raise ValueError(
                f"{n_bad} of {codes.numel()} codes are out of range for {bits}-bit packing "
                f"(observed min {lo}, max {hi}; allowed range [0, {maxq}]); "
                "clamp the codes to the grid (quantize with clip=True) or use more bits"
            )
    n_chunks = -(-cols // _CHUNK)
    out = torch.empty(rows, n_chunks * bits, dtype=torch.uint8, device=codes.device)
    step = max(1, (1 << 22) // max(cols, 1))  # rows at a time: the int64 words stay ~32 MB
    for r in range(0, rows, step):
        out[r : r + step] = _pack_rows(codes[r : r + step], bits, n_chunks)
    return out


def _pack_bytes(codes: torch.Tensor, bits: int, n_chunks: int) -> torch.Tensor:
    """2/4/8 bits: ``8 // bits`` whole codes per byte, so the little-endian chunk word is byte ``k``
    holding codes ``k * per ...`` from its low bits -- the same bytes as the word path, in uint8."""
    rows, cols = codes.shape
    per = 8 // bits
    c = codes.to(torch.uint8)
    pad = n_chunks * _CHUNK - cols
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    if per == 1:
        return c.contiguous()
    c = c.reshape(rows, n_chunks * bits, per)
    out = c[..., 0].clone()
    for i in range(1, per):
        out |= c[..., i] << (i * bits)
    return out


def _pack_rows(codes: torch.Tensor, bits: int, n_chunks: int) -> torch.Tensor:
    return _pack_bytes(codes, bits, n_chunks) if 8 % bits == 0 else _pack_words(codes, bits, n_chunks)


def _pack_words(codes: torch.Tensor, bits: int, n_chunks: int) -> torch.Tensor:
    """Any width: each chunk of 8 codes as one int64 word of ``8 * bits`` bits, cut into bytes."""
    rows, cols = codes.shape
    c = codes.to(torch.int64)
    pad = n_chunks * _CHUNK - cols
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    c = c.reshape(rows, n_chunks, _CHUNK)
    # The chunk as one integer of 8*bits <= 64 bits (int64 wraps two's-complement for 8 bits,
    # which keeps the bit pattern exact).
    word = c[..., 0].clone()
    for i in range(1, _CHUNK):
        word |= c[..., i] << (i * bits)
    out = torch.empty(rows, n_chunks, bits, dtype=torch.uint8, device=codes.device)
    for k in range(bits):
        out[..., k] = ((word >> (8 * k)) & 0xFF).to(torch.uint8)
    return out.reshape(rows, n_chunks * bits)


def unpack_codes(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Exact inverse of :func:`pack_codes`: ``uint8 [rows, ceil(cols/8)*bits]`` -> ``int32 [rows, cols]``."""
    _check_bits(bits)
    if not torch.is_tensor(packed):
        raise ValueError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be torch.uint8 (the output of pack_codes), got {packed.dtype}")
    if packed.dim() != 2:
        raise ValueError(f"packed must be 2-D [rows, packed_cols], got shape {tuple(packed.shape)}")
    expect = packed_cols(cols, bits)
    if packed.shape[1] != expect:
        raise ValueError(
            f"packed has {packed.shape[1]} bytes per row but {cols} columns of {bits}-bit codes "
            f"need ceil({cols}/8)*{bits} = {expect}; check cols and bits match the packing"
        )
    if 8 % bits == 0:
        return _unpack_bytes(packed, bits, cols)
    return _unpack_words(packed, bits, cols)


def _unpack_bytes(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """2/4/8 bits: shift the whole codes out of each byte in uint8 (inverse of :func:`_pack_bytes`)."""
    rows, nbytes = packed.shape
    per, maxq = 8 // bits, (1 << bits) - 1
    out = torch.empty(rows, nbytes, per, dtype=torch.uint8, device=packed.device)
    for i in range(per):
        out[..., i] = (packed >> (i * bits)) & maxq
    return out.reshape(rows, nbytes * per)[:, :cols].to(torch.int32)


def _unpack_words(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Any width: each chunk's ``bits`` bytes as one int64 word, the codes shifted out of it."""
    rows = packed.shape[0]
    n_chunks = packed.shape[1] // bits
    b = packed.reshape(rows, n_chunks, bits).to(torch.int64)
    word = b[..., 0].clone()
    for k in range(1, bits):
        word |= b[..., k] << (8 * k)
    maxq = (1 << bits) - 1
    out = torch.empty(rows, n_chunks, _CHUNK, dtype=torch.int32, device=packed.device)
    for i in range(_CHUNK):
        out[..., i] = ((word >> (i * bits)) & maxq).to(torch.int32)
    return out.reshape(rows, n_chunks * _CHUNK)[:, :cols].contiguous()
