"""Instruction sets of the C++ kernels: one numbering, one detection, one override.

``ISAS = ("portable", "avx2", "avx512")``; an ISA's index in it is the number every compiled kernel call
takes (``csrc/isa.h``: ``kPortable = 0``, ``kAvx2 = 1``, ``kAvx512 = 2``), for every extension
(``qmatmul``, ``lutgemv``, ``mosaic``, ``intmm``, ``scalesearch``, ``fp4gemv``).  ``avx512`` means
AVX-512 F/BW/VL/DQ/VBMI, ``avx2`` AVX2 + FMA, ``portable`` plain C++.  The CPU detection is the C++
header's (every extension exports ``isa_supported(i)``); :func:`available_isas` lists what this CPU runs.

Each call runs on :func:`kernel_isa`: the best available ISA, or the one named by
``$BITMOSAIC_KERNEL_ISA=portable|avx2|avx512`` (``auto`` or unset: the best; a name this CPU lacks is
an error), read at every call so a benchmark can switch it between calls.  The bit-plane kernel's
``matmul(x, isa=...)`` names one for a single call instead.
"""

from __future__ import annotations

import os

__all__ = ["ISAS", "ISA_ENV", "available_isas", "kernel_isa", "isa_number"]

ISAS = ("portable", "avx2", "avx512")  # index = the number csrc/isa.h uses
ISA_ENV = "BITMOSAIC_KERNEL_ISA"

_supported: dict[int, tuple[str, ...]] = {}  # id(extension module) -> its ISAs (the CPU does not change)


def _any_extension():
    from . import build

    for name in build.EXTENSIONS:
        ext = build.load(name)
        if ext is not None:
            return ext
    return None


def available_isas(ext=None) -> list[str]:
    """The ISAs this CPU runs the compiled kernels on, in ``ISAS`` order (so the last is the best);
    empty without a compiled extension.  ``ext``: the extension to ask (default: any that loads; they
    share one detection)."""
    ext = _any_extension() if ext is None else ext
    if ext is None:
        return []
    got = _supported.get(id(ext))
    if got is None:
        got = _supported[id(ext)] = tuple(n for i, n in enumerate(ISAS) if ext.isa_supported(i))
    return list(got)


def kernel_isa(name: str = "auto", ext=None) -> str | None:
    """The ISA a kernel call runs on: ``name`` unless ``"auto"``, else ``$BITMOSAIC_KERNEL_ISA`` unless
    unset or ``auto``, else the best available; ``None`` without a compiled extension.  ValueError for a
    name that is not an ISA or that this CPU lacks."""
    avail = available_isas(ext)
    if not avail:
        return None
    source = "isa"
    want = name.strip().lower() if isinstance(name, str) else name
    if want == "auto":
        source = f"${ISA_ENV}"
        want = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    if want == "auto":
        return avail[-1]
    if want not in ISAS:
        raise ValueError(f"{source}={want!r} is not one of auto, {', '.join(ISAS)}; unset it or pick one")
    if want not in avail:
        raise ValueError(
            f"{source}={want} but this CPU runs only {', '.join(avail)}; unset it or pick one of those"
        )
    return want


def isa_number(name: str = "auto", ext=None) -> int:
    """:func:`kernel_isa` as the number the compiled kernels take (``ext`` must be loaded)."""
    return ISAS.index(kernel_isa(name, ext))
