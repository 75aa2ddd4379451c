"""Dequantization kernels for packed codes.

:mod:`bitmosaic.kernels.cpu` is the fast CPU path (table-driven unpacking, gather-free group
broadcast), tested bit for bit against the reference in :mod:`bitmosaic.formats`.
"""

from .cpu import dequantize_packed, unpack_codes_fast

__all__ = ["unpack_codes_fast", "dequantize_packed"]
