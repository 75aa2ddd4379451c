"""The lattice codebook search of llama.cpp's IQ types compiled, with the torch reference's results bit for
bit (issue 72).

:func:`bitmosaic.algorithms.gguf_lattice.nearest_many` scores every codebook point of ``IQ3_S`` /
``IQ2_S`` / ``IQ2_XS`` / ``IQ3_XXS`` / ``IQ2_XXS`` for every trial scale of the scale search.  In torch
each trial is a ``[points, 512]`` (IQ2_S: 1024) tensor written to memory and reduced;
``csrc/latticesearch.cpp`` keeps a point's ``A_g``, ``B_g`` (and ``F_g``) for all codebook points in cache,
evaluates every trial scale of the point on them, and runs threads over points.  It performs the
reference's float32 operations in the reference's order (built with ``-ffp-contract=off``: no fused
multiply-add; the loops vectorise elementwise, with no reordered sums), so indices and values are
identical (tests/kernels/test_lattice_search.py).  Float32 CPU tensors only; otherwise (or without a
compiler) the reference runs.
"""

from __future__ import annotations

import torch

from ..algorithms import gguf_lattice as _lattice
from . import build
from .isa import isa_number

__all__ = ["extension", "install", "nearest_many"]


def extension():
    """The compiled ``latticesearch`` extension, or ``None`` (no compiler, ``$BITMOSAIC_NO_EXT=1``)."""
    return build.load("latticesearch")


def nearest_many(a, m, s, G, parity: bool = False, k: int | None = None):
    """:func:`bitmosaic.algorithms.gguf_lattice.nearest_many` (``k`` given: ``nearest_k``) compiled, or
    ``None`` where it does not apply (not float32 on the CPU, no extension)."""
    ts = (a, m, s, G)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in ts):
        return None
    ext = extension()
    if ext is None:
        return None
    args = (a.contiguous(), m.contiguous(), s.contiguous(), G.T.contiguous())
    if k is not None:
        return tuple(ext.nearest_k(*args, int(k), isa_number(ext=ext)))
    return tuple(ext.nearest_many(*args, bool(parity), isa_number(ext=ext)))


def install() -> None:
    """Make :func:`nearest_many` the codebook search of :mod:`bitmosaic.algorithms.gguf_lattice`."""
    _lattice.set_fast_nearest(nearest_many)
