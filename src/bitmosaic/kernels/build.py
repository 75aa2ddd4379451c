"""Building the C++ kernels (``csrc/``): once, on first use (or ahead with ``python -m
bitmosaic.kernels``), cached by torch (``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``) under a name that changes with the sources, the torch version and the
machine architecture; ``scripts/install.sh`` builds them at install time.

Seven extensions: ``qmatmul`` (:mod:`bitmosaic.kernels.qmatmul`), ``lutgemv``
(:mod:`bitmosaic.kernels.lut`), ``mosaic`` (:mod:`bitmosaic.kernels.mosaic`), ``intmm``
(:mod:`bitmosaic.kernels.intmm`, integer activations), ``scalesearch``
(:mod:`bitmosaic.kernels.scale_search`, the MSE scale search), ``latticesearch``
(:mod:`bitmosaic.kernels.lattice_search`, the GGUF lattice codebook search) and ``fp4gemv``
(:mod:`bitmosaic.kernels.fp4lut`, the MXFP4/NVFP4 LUT GEMV), each compiled for the
baseline x86-64 with its SIMD code per ISA inside (:mod:`bitmosaic.kernels.isa`).  A build prints one
line to stderr first (it takes a while: ``COLD_BUILD_S``).  When an extension cannot be built (no C++
compiler, a failed build) or ``$BITMOSAIC_NO_EXT=1``, :func:`load` returns ``None`` and the kernels run
their pure-torch path, after one warning per process::

    bitmosaic: C++ kernels unavailable (<reason>); using the pure-torch path, <N> slower
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import threading
import warnings
from pathlib import Path

__all__ = ["COMPILED", "EXTENSIONS", "NO_EXT_ENV", "load", "build_all", "module_name"]

NO_EXT_ENV = "BITMOSAIC_NO_EXT"
CSRC = Path(__file__).with_name("csrc")
EXTENSIONS = {  # name -> source
    "qmatmul": "qmatmul.cpp",
    "lutgemv": "lutgemv.cpp",
    "mosaic": "mosaic.cpp",
    "intmm": "intmm.cpp",
    "scalesearch": "scalesearch.cpp",
    "latticesearch": "latticesearch.cpp",
    "fp4gemv": "fp4gemv.cpp",
}
COLD_BUILD_S = "about 2 minutes for all seven"  # 121 s CPU measured for five, cold cache (README "Kernels")
# the pure-torch fallback against the compiled kernels at batch 1, 4096x4096 g128, 1 thread: LowBitWeight
# W2/W4 1.4 ms -> 590-600 ms (about 430x), BitPlaneWeight W2/W4 1.6/5.7 ms -> 670-730 ms (130-430x)
FALLBACK_SLOWDOWN = "100-400x"
_CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]

_lock = threading.Lock()
# the extensions this process compiled (a first build, or one torch's cache found stale): a timing that
# loads kernels inside its timed region reads this to say a compile was inside it
COMPILED: list[str] = []
_loaded: dict[str, object | None] = {}
_warned = False


def _sources(filename: str, seen: set[str] | None = None) -> list[str]:
    """``filename`` and every ``csrc`` file it includes with ``#include "..."``, recursively."""
    seen = set() if seen is None else seen
    if filename in seen or not (CSRC / filename).exists():
        return []
    seen.add(filename)
    out = [filename]
    for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', (CSRC / filename).read_text(), re.M):
        out += _sources(inc, seen)
    return out


def module_name(name: str) -> str:
    """The torch extension name: the kernel and a hash of its source, the ``csrc`` headers it includes
    (torch's cache keys on the listed source only), the torch version and installation, the machine
    architecture and the folder the sources are in, so environments sharing one cache each keep their
    own build instead of rebuilding each other's: another torch, the same torch in another virtual
    environment, or another checkout of the same code (torch's build files name the sources and the
    include folders by path, so two of those under one name rebuilt each other's kernel on every
    switch -- a minute or more each, measured inside a timed calibration).  (The instruction set is
    chosen at run time inside one build: ``isa.py``.)"""
    import platform

    import torch

    where = f"{Path(torch.__file__).resolve().parent}|{CSRC.resolve()}"
    h = hashlib.sha1(f"{torch.__version__}|{platform.machine()}|{where}|".encode())
    for f in _sources(EXTENSIONS[name]):
        h.update(f.encode() + (CSRC / f).read_bytes())
    return f"bitmosaic_{name}_{h.hexdigest()[:10]}"


def _reason(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    msg = f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__
    return msg if len(msg) <= 200 else msg[:197] + "..."


def _warn_unavailable(reason: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"bitmosaic: C++ kernels unavailable ({reason}); using the pure-torch path, "
        f"{FALLBACK_SLOWDOWN} slower",
        RuntimeWarning,
        stacklevel=4,
    )


def _mtime(path: Path | None) -> int | None:
    try:
        return None if path is None else path.stat().st_mtime_ns
    except OSError:
        return None


def _compile(name: str):
    from torch.utils import cpp_extension

    modname = module_name(name)
    try:  # a private helper, only for the one-line notice and the rebuild record
        so = Path(cpp_extension._get_build_directory(modname, False)) / f"{modname}.so"
    except Exception:  # noqa: BLE001
        so = None
    before = _mtime(so)
    if so is not None and before is None:
        print(f"bitmosaic: compiling the {name} C++ kernel (first use only; {COLD_BUILD_S})", file=sys.stderr)
    ext = cpp_extension.load(
        name=modname,
        sources=[str(CSRC / EXTENSIONS[name])],
        extra_cflags=_CFLAGS,
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )
    if so is not None and _mtime(so) != before:  # built now: first use, or a build torch found stale
        COMPILED.append(name)
    return ext


def load(name: str):
    """The compiled extension ``name`` (built once per process, or loaded from torch's cache), or
    ``None`` under ``$BITMOSAIC_NO_EXT=1`` or when it cannot be built (one warning per process)."""
    if os.environ.get(NO_EXT_ENV) == "1":
        _warn_unavailable(f"${NO_EXT_ENV}=1")
        return None
    try:
        return _loaded[name]
    except KeyError:
        pass
    with _lock:
        if name not in _loaded:
            try:
                _loaded[name] = _compile(name)
            except Exception as e:  # noqa: BLE001 - any build failure falls back, with one warning
                _loaded[name] = None
                _warn_unavailable(_reason(e))
    return _loaded[name]


def build_all() -> dict[str, bool]:
    """Build (or load) every extension now; ``{name: built}``."""
    return {name: load(name) is not None for name in EXTENSIONS}
