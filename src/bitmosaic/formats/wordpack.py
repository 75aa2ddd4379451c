"""Dense bit-stream packing of unsigned codes into int32 words: the layout GPTQ and compressed-tensors
checkpoints share (our own :mod:`bitmosaic.formats.packing` packs bytes row by row instead).

Format
------
Along the packed dimension, the ``n`` codes of ``bits`` bits each form one little-endian bit stream:
code ``i`` occupies stream bits ``i*bits .. i*bits + bits - 1`` and word ``w`` holds stream bits
``32*w .. 32*w + 31``, lowest bits first.  So 4-bit codes put 8 codes in a word (code 0 in bits 0-3),
8-bit codes 4, and 3-bit codes spill across words (32 codes fill exactly 3 words; code 10 has its two
low bits at the top of word 0 and its high bit at the bottom of word 1).  The stream is zero-padded
to a whole number of words: ``ceil(n * bits / 32)`` words.  Words are stored as ``torch.int32`` with
the same bit pattern (a word with bit 31 set is negative).

- GPTQ ``qweight`` ``[in*bits/32, out]`` packs the input dimension (dim 0), ``qzeros``
  ``[groups, out*bits/32]`` the output dimension (dim 1) -- AutoGPTQ's ``pack`` writes this stream
  for 2/3/4/8 bits.
- compressed-tensors ``weight_packed`` ``[out, ceil(in*bits/32)]`` packs dim 1 (its
  ``pack_to_int32`` since 0.1x dense cross-element packing), ``weight_zero_point`` packs dim 0.
"""

from __future__ import annotations

import torch

__all__ = ["pack_words", "unpack_words", "packed_words"]


def packed_words(n: int, bits: int) -> int:
    """Words that hold ``n`` codes of ``bits`` bits: ``ceil(n * bits / 32)``."""
    return -(-n * bits // 32)


def _check(bits: int, dim: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"word packing takes 1..8 bits per code, got {bits!r}")
    if dim not in (0, 1):
        raise ValueError(f"dim must be 0 or 1 for a 2-D tensor, got {dim}")


def pack_words(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack the unsigned ``codes`` (2-D, integers in ``[0, 2**bits)``) along ``dim`` into int32 words."""
    _check(bits, dim)
    if codes.dim() != 2 or codes.dtype.is_floating_point:
        raise ValueError(f"codes must be a 2-D integer tensor, got {codes.dtype} {tuple(codes.shape)}")
    c = codes.to(torch.int64)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) >= 1 << bits):
        raise ValueError(
            f"codes in [{int(c.min())}, {int(c.max())}] do not fit {bits} bits; "
            f"the packer takes [0, {(1 << bits) - 1}]"
        )
    if dim == 0:
        c = c.t()
    rows, n = c.shape
    nw = packed_words(n, bits)
    pad = -(-n // 32) * 32 - n
    c = torch.nn.functional.pad(c, (0, pad)).reshape(rows, -1, 32)
    words = torch.zeros(rows, c.shape[1], bits, dtype=torch.int64)
    for i in range(32):
        pos = i * bits
        w, off = divmod(pos, 32)
        words[:, :, w] |= (c[:, :, i] << off) & 0xFFFFFFFF
        if off + bits > 32:  # the code's high bits spill into the next word
            words[:, :, w + 1] |= c[:, :, i] >> (32 - off)
    words = words.reshape(rows, -1)[:, :nw]
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return (words.t() if dim == 0 else words).contiguous()


def unpack_words(words: torch.Tensor, bits: int, n: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_words`: ``n`` codes along ``dim`` (int32 ``[..]``) from int32 words."""
    _check(bits, dim)
    if words.dtype != torch.int32 or words.dim() != 2:
        raise ValueError(f"words must be a 2-D int32 tensor, got {words.dtype} {tuple(words.shape)}")
    w = words.t() if dim == 0 else words
    if w.shape[1] != packed_words(n, bits):
        raise ValueError(f"{w.shape[1]} words cannot hold exactly {n} codes of {bits} bits")
    w = w.to(torch.int64) & 0xFFFFFFFF
    rows = w.shape[0]
    nb = -(-n // 32) * bits
    w = torch.nn.functional.pad(w, (0, nb - w.shape[1])).reshape(rows, -1, bits)
    out = torch.zeros(rows, w.shape[1], 32, dtype=torch.int64)
    mask = (1 << bits) - 1
    for i in range(32):
        pos = i * bits
        k, off = divmod(pos, 32)
        v = w[:, :, k] >> off
        if off + bits > 32:
            v = v | (w[:, :, k + 1] << (32 - off))
        out[:, :, i] = v & mask
    out = out.reshape(rows, -1)[:, :n].to(torch.int32)
    return (out.t() if dim == 0 else out).contiguous()
