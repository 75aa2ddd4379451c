"""Exact canonical Huffman coding of integer weight matrices (HPTQ / HRTN storage).

HPTQ (paper 004, Sec. 5 "Huffman-encoded post-training quantization", pseudocode in App. D.1,
Algorithms 11 and 12) quantizes a weight matrix to *unbounded* signed integers with one scalar scale
and stores the integers Huffman-coded; the scale is chosen by a binary search on the measured
bits per weight.  This module is that storage format, with the bit count taken from what is
actually stored, code table included.

Code
----
:func:`build_code` counts the distinct integers and builds an optimal Huffman code with
:mod:`heapq` (ties broken by node id: leaves in ascending symbol order first, then merged nodes
in creation order, so the code is deterministic).  One distinct symbol gets a 1-bit code.  If the
longest code exceeds ``max_len`` (default 24) the lengths are limited with the JPEG (ITU T.81
Annex K.3) adjustment of the length histogram: two leaves at the deepest level are replaced by
their parent, and a shallower leaf is split to take the other one; Kraft's sum stays exactly 1.
The limited lengths are then handed out shortest-first in order of decreasing count.  This is
near-optimal, not optimal (package-merge would be); it only ever triggers for extremely skewed
counts (a 24-bit code needs a symbol ~ phi**-24 ~ 1e-5 times as frequent as the most frequent).

The code is *canonical*: symbols are sorted by ``(length, symbol value)`` and codewords are
consecutive integers within a length, the first codeword of length ``L + 1`` being
``(first[L] + count[L]) << 1``.  A code is therefore fully described by its
``symbols`` (int16 when stored) and ``lengths`` (uint8), in canonical order.

Stream
------
A ``[rows, cols]`` integer matrix is encoded row-major into one MSB-first bitstream: every row is
encoded contiguously and rows follow each other with no padding between them; the stream is
padded with zero bits to a whole byte at the end.  ``row_offsets`` (``rows + 1`` entries) are the
bit positions where each row starts (the last is the payload length), so rows can be decoded
independently (:func:`decode` decodes all rows in parallel, one symbol per step).

Stored tensors and accounting
-----------------------------
:func:`to_tensors` gives what is saved (e.g. in safetensors):

* ``data``     uint8  ``[ceil(payload_bits / 8)]``      -- the bitstream;
* ``symbols``  int16  ``[n_symbols]``                   -- the code table, canonical order;
* ``lengths``  uint8  ``[n_symbols]``                   -- code lengths, same order;
* ``row_ends`` int32  ``[rows]``                        -- ``row_offsets[1:]`` (the first offset
  is always 0 and not stored).

so :meth:`HuffmanStream.nbits_total` ``= 8 * len(data) + 24 * n_symbols + 32 * rows`` is exactly
``storage_bits(to_tensors(stream))``.  The matrix shape and the scale are stored by the caller.
:func:`estimate_bits` computes the same number from the symbol counts and code lengths without
materialising the bitstream (cheap enough for the scale binary search).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "HuffmanCode",
    "HuffmanStream",
    "build_code",
    "encode",
    "decode",
    "estimate_bits",
    "encoded_bits_per_value",
    "to_tensors",
    "from_tensors",
    "DEFAULT_MAX_LEN",
    "SYMBOL_BITS",
    "LENGTH_BITS",
    "OFFSET_BITS",
]

DEFAULT_MAX_LEN = 24
MAX_SUPPORTED_LEN = 32  # decode windows are read from 40-bit big-endian words: 7 + 32 <= 40
SYMBOL_BITS = 16  # symbols are stored as int16
LENGTH_BITS = 8  # code lengths are stored as uint8
OFFSET_BITS = 32  # row ends are stored as int32
_INT16_MIN, _INT16_MAX = -(2**15), 2**15 - 1
_WORD_BITS = 40


# ----------------------------------------------------------------------------------------- helpers
def _as_int_array(values: np.ndarray | torch.Tensor, ndim: int | None = None) -> np.ndarray:
    """``values`` as an int64 numpy array; float input must hold integers exactly."""
    if torch.is_tensor(values):
        values = values.detach().cpu().numpy()
    a = np.asarray(values)
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"expected a {ndim}-D integer array, got shape {tuple(a.shape)}")
    if a.dtype == np.bool_:
        raise TypeError("expected integer values, got a boolean array")
    if np.issubdtype(a.dtype, np.floating):
        if a.size and not (np.all(np.isfinite(a)) and np.all(a == np.round(a))):
            raise ValueError("floating-point values must be finite integers to be Huffman-coded")
        return a.astype(np.int64)
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"expected integer values, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def _check_int16_range(lo: int, hi: int) -> None:
    if lo < _INT16_MIN or hi > _INT16_MAX:
        raise ValueError(
            f"Huffman symbols must fit in int16 [{_INT16_MIN}, {_INT16_MAX}] for the code table, "
            f"but the values range over [{lo}, {hi}]: the quantization scale is too small "
            "(increase it so the integers stay within int16)"
        )


def _histogram(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values (ascending) and their counts; like ``np.unique(return_counts=True)`` but
    O(n) via ``np.bincount`` (the int16 range check bounds the bincount size)."""
    if flat.size == 0:
        raise ValueError("cannot build a Huffman code from an empty array")
    lo, hi = int(flat.min()), int(flat.max())
    _check_int16_range(lo, hi)
    counts = np.bincount(flat - lo, minlength=hi - lo + 1)
    present = np.flatnonzero(counts)
    return present.astype(np.int64) + lo, counts[present].astype(np.int64)


def _huffman_lengths(counts: np.ndarray) -> np.ndarray:
    """Optimal (unlimited) Huffman code lengths for positive ``counts``; deterministic ties."""
    n = len(counts)
    if n == 1:
        return np.ones(1, dtype=np.int64)
    heap = [(int(c), i) for i, c in enumerate(counts)]
    heapq.heapify(heap)
    parent = [0] * (2 * n - 1)
    nxt = n
    while len(heap) > 1:
        c1, a = heapq.heappop(heap)
        c2, b = heapq.heappop(heap)
        parent[a] = parent[b] = nxt
        heapq.heappush(heap, (c1 + c2, nxt))
        nxt += 1
    depth = [0] * (2 * n - 1)  # root is node 2n-2; parents always have larger ids than children
    for i in range(2 * n - 3, -1, -1):
        depth[i] = depth[parent[i]] + 1
    return np.asarray(depth[:n], dtype=np.int64)


def _limit_lengths(lengths: np.ndarray, counts: np.ndarray, max_len: int) -> np.ndarray:
    """Limit code lengths to ``max_len`` (JPEG Annex K.3 histogram adjustment, Kraft sum kept at 1)."""
    top = int(lengths.max())
    if top <= max_len:
        return lengths
    bl = np.bincount(lengths, minlength=top + 1).tolist()
    for i in range(top, max_len, -1):
        while bl[i] > 0:
            j = i - 2
            while bl[j] == 0:
                j -= 1
            # j >= 1 always holds when n_symbols <= 2**max_len (checked by the caller)
            bl[i] -= 2  # two siblings at depth i ...
            bl[i - 1] += 1  # ... one moves up to their parent's place
            bl[j + 1] += 2  # ... the other becomes the sibling of a leaf pushed down from depth j
            bl[j] -= 1
    sorted_lengths = np.repeat(np.arange(len(bl), dtype=np.int64), bl)  # ascending
    order = np.lexsort((np.arange(len(counts)), -counts))  # most frequent first, ties by symbol
    out = np.empty_like(lengths)
    out[order] = sorted_lengths
    return out


def _code_from_counts(symbols: np.ndarray, counts: np.ndarray, max_len: int) -> HuffmanCode:
    """Canonical length-limited Huffman code for ``symbols`` (ascending, distinct) with ``counts``."""
    if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)):
        raise TypeError(f"max_len must be an int, got {max_len!r}")
    if not 1 <= max_len <= MAX_SUPPORTED_LEN:
        raise ValueError(f"max_len must be in [1, {MAX_SUPPORTED_LEN}], got {max_len}")
    symbols = np.asarray(symbols, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    n = len(symbols)
    if n != len(counts) or n == 0 or np.any(counts <= 0):
        raise ValueError("need at least one symbol, with positive counts")
    if n > 2**max_len:
        raise ValueError(f"{n} distinct symbols cannot be coded with codes of at most {max_len} bits")
    lengths = _limit_lengths(_huffman_lengths(counts), counts, int(max_len))
    order = np.lexsort((symbols, lengths))
    return HuffmanCode(symbols=symbols[order], lengths=lengths[order].astype(np.uint8))


# ------------------------------------------------------------------------------------------- code
@dataclass(frozen=True, eq=False)
class HuffmanCode:
    """A canonical prefix code: ``symbols`` (int64) sorted by ``(length, symbol)``, ``lengths`` (uint8).

    Codewords are implied (canonical): see :attr:`codewords`.  Arrays are made read-only.
    """

    symbols: np.ndarray
    lengths: np.ndarray

    def __post_init__(self) -> None:
        symbols = np.array(self.symbols, dtype=np.int64).reshape(-1)
        raw = np.asarray(self.lengths).reshape(-1)
        if symbols.size == 0 or symbols.shape != raw.shape:
            raise ValueError(
                f"symbols and lengths must be non-empty and of equal size, got {symbols.size}, {raw.size}"
            )
        if raw.min() < 1 or raw.max() > MAX_SUPPORTED_LEN:
            raise ValueError(f"code lengths must be in [1, {MAX_SUPPORTED_LEN}]")
        lengths = raw.astype(np.uint8)
        L = lengths.astype(np.int64)
        ok = (L[1:] > L[:-1]) | ((L[1:] == L[:-1]) & (symbols[1:] > symbols[:-1]))
        if not np.all(ok):
            raise ValueError("symbols must be distinct and in canonical order (by length, then value)")
        m = int(L.max())
        if int(np.sum(np.left_shift(1, m - L, dtype=np.int64))) > 2**m:
            raise ValueError("code lengths violate Kraft's inequality: not a prefix code")
        symbols.setflags(write=False)
        lengths.setflags(write=False)
        object.__setattr__(self, "symbols", symbols)
        object.__setattr__(self, "lengths", lengths)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HuffmanCode):
            return NotImplemented
        return np.array_equal(self.symbols, other.symbols) and np.array_equal(self.lengths, other.lengths)

    def __hash__(self) -> int:
        return hash((self.symbols.tobytes(), self.lengths.tobytes()))

    @property
    def num_symbols(self) -> int:
        return int(self.symbols.size)

    @property
    def max_len(self) -> int:
        return int(self.lengths.max())

    def _tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``count[L]``, ``first[L]`` (first codeword of length L), ``offset[L]`` (its index); L=0..max."""
        m = self.max_len
        count = np.bincount(self.lengths, minlength=m + 1).astype(np.int64)
        count[0] = 0
        first = np.zeros(m + 1, dtype=np.int64)
        code = 0
        for L in range(1, m + 1):
            first[L] = code
            code = (code + int(count[L])) << 1
        offset = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
        return count, first, offset

    @property
    def codewords(self) -> np.ndarray:
        """Canonical codewords (int64), MSB-first, ``lengths[i]`` bits each, same order as ``symbols``."""
        _, first, offset = self._tables()
        L = self.lengths.astype(np.int64)
        return first[L] + (np.arange(self.num_symbols, dtype=np.int64) - offset[L])

    def table_bits(self, symbol_bits: int = SYMBOL_BITS, length_bits: int = LENGTH_BITS) -> int:
        """Bits to store the table: one symbol and one length per entry."""
        return self.num_symbols * (symbol_bits + length_bits)

    def expected_bits(self, counts: np.ndarray | Mapping[int, int]) -> int:
        """Payload bits (table excluded) to code symbols with these ``counts``.

        ``counts`` is either aligned with :attr:`symbols` or a mapping ``symbol -> count``.
        """
        if isinstance(counts, Mapping):
            lut = dict(zip(self.symbols.tolist(), self.lengths.tolist(), strict=True))
            missing = [s for s, c in counts.items() if c and s not in lut]
            if missing:
                raise ValueError(f"symbols {missing[:5]} are not in the code")
            return int(sum(int(c) * lut[s] for s, c in counts.items() if c))
        c = np.asarray(counts, dtype=np.int64).reshape(-1)
        if c.shape != self.symbols.shape:
            raise ValueError(f"counts must be aligned with the {self.num_symbols} symbols, got {c.size}")
        return int(np.dot(c, self.lengths.astype(np.int64)))

    def _index_of(self, flat: np.ndarray) -> np.ndarray:
        """Index into :attr:`symbols` of every value of ``flat`` (int64); error if one is not coded."""
        if flat.size == 0:
            return np.zeros(0, dtype=np.int64)
        lo, hi = int(self.symbols.min()), int(self.symbols.max())
        vlo, vhi = int(flat.min()), int(flat.max())
        if vlo < lo or vhi > hi:
            raise ValueError(f"values range over [{vlo}, {vhi}] but the code covers only [{lo}, {hi}]")
        if hi - lo < 1 << 17:  # dense lookup table (always the case for int16 symbols)
            lut = np.full(hi - lo + 1, -1, dtype=np.int64)
            lut[self.symbols - lo] = np.arange(self.num_symbols, dtype=np.int64)
            idx = lut[flat - lo]
        else:
            order = np.argsort(self.symbols)
            pos = np.minimum(np.searchsorted(self.symbols[order], flat), self.num_symbols - 1)
            idx = np.where(self.symbols[order][pos] == flat, order[pos], -1)
        if idx.size and idx.min() < 0:
            bad = np.unique(flat[idx < 0])[:5].tolist()
            raise ValueError(f"values {bad} are not symbols of the code")
        return idx


def build_code(values: np.ndarray | torch.Tensor, max_len: int = DEFAULT_MAX_LEN) -> HuffmanCode:
    """Canonical Huffman code of the integers in ``values`` (any shape), lengths <= ``max_len``.

    Raises ``ValueError`` if the values do not fit in int16 (the table stores int16 symbols).
    """
    symbols, counts = _histogram(_as_int_array(values).reshape(-1))
    return _code_from_counts(symbols, counts, max_len)


# ----------------------------------------------------------------------------------------- stream
@dataclass(eq=False)
class HuffmanStream:
    """A Huffman-coded ``[rows, cols]`` integer matrix (see the module docstring for the format)."""

    code: HuffmanCode
    data: np.ndarray  # uint8 MSB-first bitstream
    row_offsets: np.ndarray  # int64 [rows + 1], bit where each row starts; last = payload bits
    shape: tuple[int, int]

    @property
    def payload_bits(self) -> int:
        return int(self.row_offsets[-1])

    def nbits_total(self, offset_bits: int = OFFSET_BITS) -> int:
        """Stored bits: bitstream bytes + code table + one ``offset_bits`` row end per row.

        Row ends are stored as int32 (``row_offsets[1:]``, the first offset being always 0), so the
        default equals ``storage_bits(to_tensors(self))``.
        """
        return int(self.data.size) * 8 + self.code.table_bits() + self.shape[0] * offset_bits

    def bits_per_value(self, offset_bits: int = OFFSET_BITS) -> float:
        n = self.shape[0] * self.shape[1]
        if n == 0:
            raise ValueError("bits per value of an empty matrix is undefined")
        return self.nbits_total(offset_bits) / n


def encode(values: np.ndarray | torch.Tensor, code: HuffmanCode | None = None) -> HuffmanStream:
    """Huffman-code a 2-D integer matrix row by row into one bitstream (vectorised).

    ``code`` defaults to :func:`build_code` of ``values``; with a given code every value must be one
    of its symbols.
    """
    a = _as_int_array(values, ndim=2)
    rows, cols = (int(s) for s in a.shape)
    if code is None:
        code = build_code(a)
    flat = np.ascontiguousarray(a).reshape(-1)
    idx = code._index_of(flat)
    lengths = code.lengths.astype(np.int64)[idx]
    words = code.codewords[idx]
    row_offsets = np.zeros(rows + 1, dtype=np.int64)
    if flat.size == 0:
        return HuffmanStream(code, np.zeros(0, dtype=np.uint8), row_offsets, (rows, cols))
    ends = np.cumsum(lengths)
    starts = ends - lengths
    row_offsets[1:] = ends[cols - 1 :: cols]
    total = int(ends[-1])
    nbytes = (total + 7) // 8
    # place every codeword in a 40-bit big-endian window starting at its first byte; codewords never
    # share a bit, so adding their bytes (exact in float64) is the same as OR-ing them
    byte = starts >> 3
    win = words << (_WORD_BITS - (starts & 7) - lengths)
    nslots = (7 + code.max_len + 7) // 8
    acc = np.zeros(nbytes + nslots, dtype=np.float64)
    for k in range(nslots):
        part = (win >> (_WORD_BITS - 8 - 8 * k)) & 0xFF
        acc += np.bincount(byte + k, weights=part, minlength=nbytes + nslots)
    data = acc[:nbytes].astype(np.uint8)
    return HuffmanStream(code, data, row_offsets, (rows, cols))


def decode(stream: HuffmanStream) -> np.ndarray:
    """Exact inverse of :func:`encode`: the int64 ``[rows, cols]`` matrix.

    All rows are decoded in parallel, one symbol per step: each row's next ``max_len`` bits are read
    from a precomputed 40-bit big-endian word per byte, the code length is the first canonical
    "limit" the window is below (``searchsorted``), and the symbol index follows from the first
    codeword and index of that length.
    """
    rows, cols = stream.shape
    code = stream.code
    offs = np.asarray(stream.row_offsets, dtype=np.int64)
    if offs.shape != (rows + 1,):
        raise ValueError(f"row_offsets must have {rows + 1} entries, got {offs.size}")
    if rows == 0 or cols == 0:
        return np.zeros((rows, cols), dtype=np.int64)
    m = code.max_len
    count, first, offset = code._tables()
    Ls = np.arange(1, m + 1, dtype=np.int64)
    limit = (first[1:] + count[1:]) << (m - Ls)  # non-decreasing; window w has length L <=> first L
    # per-length tables, plus a sentinel entry (index m) hit only by invalid windows -> negative index
    base = np.append(offset[1:] - first[1:], -(1 << 50))
    shift = np.append(m - Ls, 0)
    adv = np.append(Ls, 1)
    d = np.asarray(stream.data, dtype=np.uint8).astype(np.int64)
    nb = d.size
    if (int(offs[-1]) + 7) // 8 > nb:
        raise ValueError("corrupt Huffman stream: row offsets point past the end of the data")
    d = np.concatenate([d, np.zeros(_WORD_BITS // 8, dtype=np.int64)])
    wordarr = np.zeros(nb + 1, dtype=np.int64)
    for k in range(_WORD_BITS // 8):
        wordarr |= d[k : k + nb + 1] << (_WORD_BITS - 8 - 8 * k)
    top = _WORD_BITS - m
    mask = (1 << m) - 1
    pos = offs[:-1].copy()
    out = np.empty((cols, rows), dtype=np.int64)
    for c in range(cols):
        w = (wordarr.take(pos >> 3, mode="clip") >> (top - (pos & 7))) & mask  # clip: corrupt input
        li = np.searchsorted(limit, w, side="right")
        out[c] = base[li] + (w >> shift[li])
        pos += adv[li]
    if not np.array_equal(pos, offs[1:]) or out.min() < 0:
        raise ValueError("corrupt Huffman stream: decoded rows do not end at their recorded offsets")
    return np.ascontiguousarray(code.symbols[out].T)


# ------------------------------------------------------------------------------------- accounting
def estimate_bits(
    values: np.ndarray | torch.Tensor,
    code: HuffmanCode | None = None,
    max_len: int = DEFAULT_MAX_LEN,
    offset_bits: int = OFFSET_BITS,
) -> int:
    """``encode(values, code).nbits_total(offset_bits)`` exactly, without building the bitstream.

    ``values`` is a 2-D integer matrix; ``code`` defaults to ``build_code(values, max_len)``.
    """
    a = _as_int_array(values, ndim=2)
    rows = int(a.shape[0])
    flat = a.reshape(-1)
    if code is None:
        symbols, counts = _histogram(flat)
        code = _code_from_counts(symbols, counts, max_len)
        # counts are in ascending symbol order; the code's symbols are in canonical order
        lengths_by_symbol = np.empty(len(symbols), dtype=np.int64)
        lengths_by_symbol[np.searchsorted(symbols, code.symbols)] = code.lengths
        payload = int(np.dot(counts, lengths_by_symbol))
    else:
        idx = code._index_of(flat)
        payload = int(np.dot(np.bincount(idx, minlength=code.num_symbols), code.lengths.astype(np.int64)))
    return (payload + 7) // 8 * 8 + code.table_bits() + rows * offset_bits


def encoded_bits_per_value(values: np.ndarray | torch.Tensor, max_len: int = DEFAULT_MAX_LEN) -> float:
    """Real stored bits per value of Huffman-coding ``values`` (2-D), table and row ends included.

    Exact (equal to ``encode(values).bits_per_value()``) but computed by :func:`estimate_bits`,
    so it is cheap enough for a scale binary search.
    """
    a = _as_int_array(values, ndim=2)
    if a.size == 0:
        raise ValueError("bits per value of an empty matrix is undefined")
    return estimate_bits(a, max_len=max_len) / a.size


# ------------------------------------------------------------------------------------ persistence
def to_tensors(stream: HuffmanStream) -> dict[str, torch.Tensor]:
    """The tensors to save: ``data`` uint8, ``symbols`` int16, ``lengths`` uint8, ``row_ends`` int32.

    Their total size is exactly ``stream.nbits_total()``.  The shape is not included.
    """
    code = stream.code
    lo, hi = int(code.symbols.min()), int(code.symbols.max())
    _check_int16_range(lo, hi)
    ends = np.asarray(stream.row_offsets, dtype=np.int64)[1:]
    if ends.size and int(ends.max()) > np.iinfo(np.int32).max:
        raise ValueError(
            f"row offset {int(ends.max())} bits overflows the int32 row_ends: the matrix is too large "
            "for one stream (split it into several streams of fewer rows)"
        )
    return {
        "data": torch.from_numpy(np.array(stream.data, dtype=np.uint8)),
        "symbols": torch.from_numpy(code.symbols.astype(np.int16)),
        "lengths": torch.from_numpy(np.array(code.lengths, dtype=np.uint8)),
        "row_ends": torch.from_numpy(ends.astype(np.int32)),
    }


def from_tensors(d: Mapping[str, torch.Tensor], shape: tuple[int, int]) -> HuffmanStream:
    """Inverse of :func:`to_tensors` given the matrix ``shape`` ``(rows, cols)``."""
    rows, cols = (int(s) for s in shape)
    missing = {"data", "symbols", "lengths", "row_ends"} - set(d)
    if missing:
        raise KeyError(f"Huffman tensors are missing {sorted(missing)}")
    ends = d["row_ends"].detach().cpu().numpy().astype(np.int64).reshape(-1)
    if ends.size != rows:
        raise ValueError(f"row_ends has {ends.size} entries but shape {shape} has {rows} rows")
    code = HuffmanCode(
        symbols=d["symbols"].detach().cpu().numpy().astype(np.int64),
        lengths=d["lengths"].detach().cpu().numpy().astype(np.uint8),
    )
    data = d["data"].detach().cpu().numpy().astype(np.uint8).reshape(-1)
    row_offsets = np.concatenate([np.zeros(1, dtype=np.int64), ends])
    return HuffmanStream(code, data, row_offsets, (rows, cols))
