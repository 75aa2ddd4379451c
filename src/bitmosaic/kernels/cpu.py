"""Fast CPU dequantization of packed codes (see :mod:`bitmosaic.formats.packing` for the format).

Everything here is checked, bit for bit, against the reference path
``layout.dequantize(packing.unpack_codes(packed, bits, cols), scales, zeros, g_idx)``:

* **Unpacking by table lookup.**  For 2/4/8 bits every byte holds ``8 // bits`` whole codes, so a
  256-entry table maps a byte to its codes (low bits first) and one ``index_select`` unpacks a
  whole matrix; 8-bit codes are just the bytes, so a cast suffices.  For 3 bits a chunk of 3
  bytes is a 24-bit little-endian word whose two 12-bit halves each hold exactly 4 codes, so a
  4096-entry table indexed by the halves unpacks it with the same single gather.  Tables are built
  once per ``(bits, dtype, device)`` and cached (constants, not configuration).
* **Tables in the output dtype.**  :func:`dequantize_packed` gathers floats directly (codes are
  integers ``<= 255``, exact in float32/float16/bfloat16).  With a scalar zero-point (symmetric
  grid) the zero is subtracted inside the 256/4096-entry table -- the same ``dtype`` subtraction,
  element for element -- so only the multiply by the scales touches the full matrix.
* **No gather for contiguous groups.**  When the caller says the group map is the trivial
  ``j // group_size`` (``contiguous=True`` with ``group_size``, typically decided once at load time
  with :func:`bitmosaic.formats.layout.is_trivial_g_idx`), scales and zeros are broadcast over a
  ``[rows, groups, group_size]`` view (the partial last group handled as its own slice) instead of
  being gathered into a full ``[rows, cols]`` matrix.  Otherwise (act-order ``g_idx``) the reference
  gather is used.

* **5, 6 and 7 bits** (for mixed-width models): codes straddle bytes with no table-sized period, so
  they are unpacked by the reference word arithmetic (vectorised; :func:`formats.packing.unpack_codes`)
  and then treated like 8-bit codes.

The arithmetic is ``(codes - zero) * scale`` in ``dtype`` exactly as
:func:`bitmosaic.formats.grid.dequantize_codes`, so results are bitwise identical to the reference.
"""

from __future__ import annotations

import torch

from ..formats.layout import normalize_group_size, num_groups
from ..formats.packing import SUPPORTED_BITS, packed_cols, unpack_codes

__all__ = ["unpack_codes_fast", "dequantize_packed"]

# (bits, dtype, device) -> lookup table; module-level constant cache.
_LUTS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _lut(bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256, 8 // bits]`` byte table (2/4/8 bits) or ``[4096, 4]`` 12-bit table (3 bits)."""
    key = (bits, dtype, device)
    lut = _LUTS.get(key)
    if lut is None:
        if bits == 3:
            idx = torch.arange(1 << 12, dtype=torch.int32)
            per = 4
        else:
            idx = torch.arange(256, dtype=torch.int32)
            per = 8 // bits
        shifts = torch.arange(per, dtype=torch.int32) * bits
        lut = ((idx[:, None] >> shifts) & ((1 << bits) - 1)).to(dtype=dtype, device=device).contiguous()
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


def _gather_codes(packed: torch.Tensor, bits: int, cols: int, lut: torch.Tensor | None) -> torch.Tensor:
    """Codes (or table values) ``[rows, cols]``, contiguous, in ``lut``'s dtype.

    ``lut`` is ``None`` only for 8 bits, where the caller converts the bytes itself.
    """
    rows = packed.shape[0]
    if bits == 3:
        b = packed.reshape(rows, -1, 3).to(torch.int32)
        idx = torch.empty(b.shape[0], b.shape[1], 2, dtype=torch.int32, device=packed.device)
        torch.bitwise_or(b[..., 0], (b[..., 1] & 0xF) << 8, out=idx[..., 0])
        torch.bitwise_or(b[..., 1] >> 4, b[..., 2] << 4, out=idx[..., 1])
        flat = lut.index_select(0, idx.reshape(-1))
    else:
        flat = lut.index_select(0, packed.reshape(-1).to(torch.int32))
    out = flat.reshape(rows, -1)
    if out.shape[1] != cols:
        out = out[:, :cols].contiguous()
    return out


_WORD_BITS = (5, 6, 7)  # unpacked by word arithmetic, then handled like 8-bit codes


def _direct_codes(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Codes of the widths without a lookup table (5-8 bits), ``[rows, cols]`` (uint8 or int32)."""
    if bits == 8:
        return packed[:, :cols]
    return unpack_codes(packed, bits, cols)


def unpack_codes_fast(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Table-driven equivalent of :func:`bitmosaic.formats.packing.unpack_codes` (int32 ``[rows, cols]``)."""
    _check_packed(packed, bits, cols)
    if bits == 8 or bits in _WORD_BITS:
        return _direct_codes(packed, bits, cols).to(torch.int32)
    return _gather_codes(packed, bits, cols, _lut(bits, torch.int32, packed.device))


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
) -> torch.Tensor:
    """Dequantize packed ``[rows, cols]`` codes to ``dtype``; bitwise equal to the reference.

    ``scales`` (and ``zeros`` when a tensor) are ``[rows, G]``; a scalar ``zeros`` (python number or
    0-d tensor) is the symmetric grid's fixed zero-point.  With ``contiguous=True`` (or
    ``g_idx=None``) the group map is taken to be ``j // group_size`` without looking at ``g_idx``;
    otherwise ``g_idx`` ``[cols]`` is gathered like :func:`bitmosaic.formats.layout.dequantize`.
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
    if scalar_zero:
        z = torch.tensor(float(zeros), dtype=dtype, device=packed.device)
        if bits == 8 or bits in _WORD_BITS:
            w = _direct_codes(packed, bits, cols).to(dtype).sub_(z)
        else:
            # (code - zero) folded into the table: the same dtype subtraction, per table entry.
            w = _gather_codes(packed, bits, cols, _lut(bits, dtype, packed.device) - z)
    else:
        z = zeros.to(device=packed.device, dtype=dtype)
        if bits == 8 or bits in _WORD_BITS:
            w = _direct_codes(packed, bits, cols).to(dtype)
        else:
            w = _gather_codes(packed, bits, cols, _lut(bits, dtype, packed.device))

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
