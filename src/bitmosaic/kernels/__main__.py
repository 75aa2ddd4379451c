"""``python -m bitmosaic.kernels``: build (or load) the C++ extensions now, say which are ready, which
instruction sets this CPU runs them on, and whether the integer-activation kernel has AVX-512 VNNI
and AMX tiles."""

from __future__ import annotations

import sys
import time

from .build import build_all
from .isa import available_isas


def main() -> int:
    t0 = time.perf_counter()
    ok = build_all()
    for name, built in ok.items():
        print(f"{name}: {'ready' if built else 'unavailable (pure-torch path)'}")
    print(f"ISAs on this CPU: {', '.join(available_isas()) or 'none'}; {time.perf_counter() - t0:.1f} s")
    if ok.get("intmm"):
        from .intmm import amx, vnni

        how = "AVX-512 VNNI (vpdpbusd)" if vnni() else "no VNNI: the AVX2 body on avx512"
        tiles = "; prefill on AMX-INT8 tiles" if amx() else ""
        print(f"integer activations (intmm): {how}{tiles}")
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
