"""Fast CPU dequantization of packed codes (see :mod:`bitmosaic.formats.packing` for the format).

Everything here is checked, bit for bit, for every width 2-8, against the reference path
``layout.dequantize(packing.unpack_codes(packed, bits, cols) + code_offset, scales, zeros, g_idx)``:

* **Unpacking by table lookup (2, 3, 4 bits).**  For 2/4 bits every byte holds ``8 // bits``
  whole codes, so a 256-entry table maps a byte to its codes (low bits first) and one
  ``index_select`` unpacks a whole matrix.  For 3 bits a chunk of 3 bytes is a 24-bit little-endian
  word whose two 12-bit halves each hold exactly 4 codes, so a 4096-entry table indexed by the
  halves unpacks it with the same single gather.  Integer tables are built once per
  ``(bits, device)`` and cached (constants, not configuration).
* **Word shifts (5, 6, 7 bits).**  Codes straddle bytes with no table-sized period, so each chunk of
  ``bits`` bytes is zero-extended to 8 bytes and read as one 64-bit word (a reinterpreting view in
  the host's byte order); one broadcast shift by ``0, bits, ..., 7 * bits`` and a mask give its 8
  codes.  8-bit codes are the bytes themselves.
* **Values in the output dtype.**  :func:`dequantize_packed` converts each table (256/4096 entries)
  to the output dtype, so the gather yields floats directly.  A layer's ``code_offset`` (no-clip
  codes stored shifted) is added to the *integer* codes before the single cast, exactly like the
  reference ``unpack_codes(...) + offset``; with a scalar zero-point (symmetric grid) the zero is
  subtracted inside the table -- the same ``dtype`` subtraction, element for element -- so only the
  multiply by the scales touches the full matrix.
* **No gather for contiguous groups.**  When the caller says the group map is the trivial
  ``j // group_size`` (``contiguous=True`` with ``group_size``, typically decided once at load time
  with :func:`bitmosaic.formats.layout.is_trivial_g_idx`), scales and zeros are broadcast over a
  ``[rows, groups, group_size]`` view (the partial last group handled as its own slice) instead of
  being gathered into a full ``[rows, cols]`` matrix.  Otherwise (act-order ``g_idx``) the reference
  gather is used.

Every tensor is made on ``packed``'s device, so the same code runs on CUDA tensors.

The arithmetic is ``(codes - zero) * scale`` in ``dtype`` exactly as
:func:`bitmosaic.formats.grid.dequantize_codes`, so results are bitwise identical to the reference.
"""

from __future__ import annotations

import sys

import torch

from ..formats.layout import normalize_group_size, num_groups
from ..formats.packing import SUPPORTED_BITS, packed_cols

__all__ = ["unpack_codes_fast", "dequantize_packed"]

_LUT_BITS = (2, 3, 4)  # unpacked by one table gather; 5-7 bits by chunk-word shifts; 8 bits are bytes

# (bits, device) -> int32 lookup table; module-level constant cache.
_LUTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _lut(bits: int, device: torch.device) -> torch.Tensor:
    """``[256, 8 // bits]`` byte table (2/4 bits) or ``[4096, 4]`` 12-bit table (3 bits), int32."""
    key = (bits, device)
    lut = _LUTS.get(key)
    if lut is None:
        if bits == 3:
            idx = torch.arange(1 << 12, dtype=torch.int32)
            per = 4
        else:
            idx = torch.arange(256, dtype=torch.int32)
            per = 8 // bits
        shifts = torch.arange(per, dtype=torch.int32) * bits
        lut = ((idx[:, None] >> shifts) & ((1 << bits) - 1)).to(device=device).contiguous()
        _LUTS[key] = lut
    return lut


def _check_packed(packed: torch.Tensor, bits: int, cols: int) -> None:
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bit width {bits!r}: supported bits are {SUPPORTED_BITS}")
    if not torch.is_tensor(packed) or packed.dtype != torch.uint8 or packed.dim() != 2:
        desc = f"{packed.dtype} {tuple(packed.shape)}" if torch.is_tensor(packed) else type(packed).__name__
        raise ValueError(f"packed must be a 2-D torch.uint8 tensor [rows, packed_cols], got {desc}")
    expect = packed_cols(cols, bits)
    if packed.shape[1] != expect:
        raise ValueError(
            f"packed has {packed.shape[1]} bytes per row but {cols} columns of {bits}-bit codes "
            f"need ceil({cols}/8)*{bits} = {expect}; check cols and bits match the packing"
        )


def _gather_codes(packed: torch.Tensor, bits: int, cols: int, table: torch.Tensor) -> torch.Tensor:
    """``table``'s rows for the codes of ``packed`` (2/3/4 bits): ``[rows, cols]``, contiguous."""
    rows = packed.shape[0]
    if bits == 3:
        b = packed.reshape(rows, packed.shape[1] // 3, 3).to(torch.int32)
        idx = torch.empty(b.shape[0], b.shape[1], 2, dtype=torch.int32, device=packed.device)
        torch.bitwise_or(b[..., 0], (b[..., 1] & 0xF) << 8, out=idx[..., 0])
        torch.bitwise_or(b[..., 1] >> 4, b[..., 2] << 4, out=idx[..., 1])
        flat = table.index_select(0, idx.reshape(-1))
    else:
        flat = table.index_select(0, packed.reshape(-1).to(torch.int32))
    out = flat.reshape(rows, packed.shape[1] // bits * 8)  # 8 codes per chunk of `bits` bytes
    if out.shape[1] != cols:
        out = out[:, :cols].contiguous()
    return out


def _chunk_words(packed: torch.Tensor, bits: int, byteorder: str = sys.byteorder) -> torch.Tensor:
    """Each chunk of ``bits`` bytes as one int64 word ``[rows, chunks, 1]`` (value ``i`` of the chunk
    at bits ``i * bits ...``), by zero-extending it to 8 bytes laid out in ``byteorder``."""
    rows, n_chunks = packed.shape[0], packed.shape[1] // bits
    chunks = packed.reshape(rows, n_chunks, bits)
    w8 = torch.zeros(rows, n_chunks, 8, dtype=torch.uint8, device=packed.device)
    if byteorder == "little":
        w8[..., :bits] = chunks
    else:
        w8[..., 8 - bits :] = chunks.flip(-1)
    return w8.view(torch.int64)


def _int_codes(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Codes of the table-free widths (5-8 bits), ``[rows, cols]``: int64 (5-7) or uint8 (8)."""
    if bits == 8:
        return packed[:, :cols]
    shifts = torch.arange(8, dtype=torch.int64, device=packed.device) * bits
    codes = (_chunk_words(packed, bits) >> shifts).bitwise_and_((1 << bits) - 1)
    return codes.reshape(packed.shape[0], codes.shape[1] * 8)[:, :cols]


def unpack_codes_fast(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Fast equivalent of :func:`bitmosaic.formats.packing.unpack_codes` (int32 ``[rows, cols]``)."""
    _check_packed(packed, bits, cols)
    if bits in _LUT_BITS:
        return _gather_codes(packed, bits, cols, _lut(bits, packed.device))
    return _int_codes(packed, bits, cols).to(torch.int32).contiguous()


def _dequantized_codes(
    packed: torch.Tensor,
    bits: int,
    cols: int,
    dtype: torch.dtype,
    code_offset: int,
    zero: torch.Tensor | None,
) -> torch.Tensor:
    """``(code + code_offset).to(dtype) [- zero]``, ``[rows, cols]``, a new contiguous tensor.

    The offset is added to the integer codes before the one cast to ``dtype`` (as the reference
    does); for the table widths that happens on the table, as does the scalar ``zero``.
    """
    if bits in _LUT_BITS:
        table = _lut(bits, packed.device)
        table = (table + code_offset if code_offset else table).to(dtype)
        return _gather_codes(packed, bits, cols, table if zero is None else table - zero)
    codes = _int_codes(packed, bits, cols)
    if code_offset:
        codes = codes.to(torch.int64) + code_offset
    w = codes.to(dtype).contiguous()
    return w if zero is None else w.sub_(zero)


def _resolve_groups(
    cols: int,
    n_groups: int,
    g_idx: torch.Tensor | None,
    group_size: int | None,
    contiguous: bool,
) -> int | None:
    """Return the effective contiguous group size, or ``None`` when ``g_idx`` must be gathered."""
    if not contiguous and g_idx is not None:
        if g_idx.numel() != cols:
            raise ValueError(f"g_idx has {g_idx.numel()} entries but the weight has {cols} columns")
        return None
    if group_size is None:
        if n_groups != 1:
            raise ValueError(
                "a contiguous group map needs group_size (scales have "
                f"{n_groups} groups); pass group_size=..., or pass g_idx with contiguous=False"
            )
        group_size = -1
    g = normalize_group_size(group_size, cols)
    if num_groups(cols, g) != n_groups:
        raise ValueError(
            f"scales have {n_groups} groups but {cols} columns in groups of {g} make "
            f"{num_groups(cols, g)}; check group_size"
        )
    return g


def dequantize_packed(
    packed: torch.Tensor,
    bits: int,
    cols: int,
    scales: torch.Tensor,
    zeros: torch.Tensor | float | int,
    g_idx: torch.Tensor | None,
    dtype: torch.dtype = torch.float32,
    *,
    group_size: int | None = None,
    contiguous: bool = False,
    code_offset: int = 0,
) -> torch.Tensor:
    """Dequantize packed ``[rows, cols]`` codes to ``dtype``; bitwise equal to the reference.

    ``scales`` (and ``zeros`` when a tensor) are ``[rows, G]``; a scalar ``zeros`` (python number or
    0-d tensor) is the symmetric grid's fixed zero-point.  With ``contiguous=True`` (or
    ``g_idx=None``) the group map is taken to be ``j // group_size`` without looking at ``g_idx``;
    otherwise ``g_idx`` ``[cols]`` is gathered like :func:`bitmosaic.formats.layout.dequantize`.
    ``code_offset`` is added to every unpacked code first (a no-clip layer's stored shift): the result
    equals ``layout.dequantize(unpack_codes(packed, bits, cols) + code_offset, ...)``.
    """
    _check_packed(packed, bits, cols)
    rows = packed.shape[0]
    if scales.dim() != 2 or scales.shape[0] != rows:
        raise ValueError(f"scales must be [rows={rows}, groups], got shape {tuple(scales.shape)}")
    n_groups = scales.shape[1]
    scalar_zero = not torch.is_tensor(zeros) or zeros.dim() == 0
    if not scalar_zero and tuple(zeros.shape) != tuple(scales.shape):
        raise ValueError(f"zeros shape {tuple(zeros.shape)} must match scales shape {tuple(scales.shape)}")
    g = _resolve_groups(cols, n_groups, g_idx, group_size, contiguous)

    s = scales.to(device=packed.device, dtype=dtype)
    code_offset = int(code_offset)
    if scalar_zero:
        z = torch.tensor(float(zeros), dtype=dtype, device=packed.device)
        w = _dequantized_codes(packed, bits, cols, dtype, code_offset, z)
    else:
        z = zeros.to(device=packed.device, dtype=dtype)
        w = _dequantized_codes(packed, bits, cols, dtype, code_offset, None)

    if g is None:  # arbitrary (act-order) group map: gather like the reference
        idx = g_idx.to(device=packed.device, dtype=torch.long)
        if not scalar_zero:
            w.sub_(z[:, idx])
        return w.mul_(s[:, idx])

    n_full = cols // g
    if n_full:
        wf = w[:, : n_full * g].view(rows, n_full, g)
        if not scalar_zero:
            wf.sub_(z[:, :n_full, None])
        wf.mul_(s[:, :n_full, None])
    if n_full * g != cols:  # partial last group
        wp = w[:, n_full * g :]
        if not scalar_zero:
            wp.sub_(z[:, n_full : n_full + 1])
        wp.mul_(s[:, n_full : n_full + 1])
    return w
