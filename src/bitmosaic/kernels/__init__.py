"""Dequantization kernels for packed codes, and the compiled MSE scale search.

:mod:`bitmosaic.kernels.cpu` is the fast CPU path (table-driven unpacking, gather-free group
broadcast), tested bit for bit against the reference in :mod:`bitmosaic.formats`.  Importing this
package installs :func:`bitmosaic.kernels.scale_search.mse_search` as the MSE scale search of
:mod:`bitmosaic.algorithms.scales` (the same chosen scales, compiled on first use; issue 74) and
:func:`bitmosaic.kernels.lattice_search.nearest_many` as the codebook search of the GGUF lattice types
(issue 72).
"""

from . import lattice_search as _lattice_search
from . import scale_search as _scale_search
from .cpu import dequantize_packed, unpack_codes_fast

_scale_search.install()
_lattice_search.install()

__all__ = ["unpack_codes_fast", "dequantize_packed"]
