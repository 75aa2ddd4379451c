"""GPU kernels in Triton for the papers' formats (issue 76), verified on the CPU with Triton's interpreter.

One file per kernel family: ``intmm.py`` (the packed INT kinds: dequant GEMM with ``tl.dot`` for prefill,
GEMV for decode; with ``with_fp8`` DPQ's INT4 -> FP8 E4M3 dequantization, fed with FP8 activations to
an FP8 ``tl.dot`` where :func:`fp8_dot` says the device has one, else multiplied in float),
``sparse.py`` (SSQR's dense product plus its CSR outliers), ``blockres.py`` (MosaicQuant's dense base plus
residual blocks in one kernel), ``sqsplit.py`` (SQ-format's static split GEMM), ``bitplane.py`` (SFMP's
bit-plane GEMV, the SFMP module kind's kernel on CUDA; docs/cpu-inference.md, "GPU kernels", says what is
not written yet).  The ``*_jit.py`` files hold the ``@triton.jit`` bodies; they are imported lazily, on the
first launch, because Triton reads ``TRITON_INTERPRET`` when a kernel is decorated.

Nothing here imports Triton at import time: without it (or with ``BITMOSAIC_NO_TRITON=1``) :func:`available`
is false and the selector (:mod:`bitmosaic.kernels.select`) simply does not offer these kernels.

Where they run: CUDA devices.  ``TRITON_INTERPRET=1`` runs the same kernels in Triton's interpreter on CPU
tensors (how the test suite proves them); ``BITMOSAIC_TRITON_ON_CPU=1`` together with it makes the
selector offer them for CPU modules too -- a device stand-in for testing the selection and load paths on a
machine without a GPU (never a speed path: the interpreter is slow).
"""

from __future__ import annotations

import functools
import importlib
import os

__all__ = [
    "NO_TRITON_ENV", "ON_CPU_ENV", "FP8_DOT_ENV", "FP8_DOT_CAPABILITY",
    "available", "interpreting", "devices", "fp8_dot", "jit_module",
]  # fmt: skip

NO_TRITON_ENV = "BITMOSAIC_NO_TRITON"
ON_CPU_ENV = "BITMOSAIC_TRITON_ON_CPU"
FP8_DOT_ENV = "BITMOSAIC_TRITON_FP8_DOT"  # 0: never the FP8 tl.dot (DPQ multiplies in float32 instead)
FP8_DOT_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) on


@functools.cache
def _importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install (missing driver libraries)
        return False
    return True


def available() -> bool:
    """Whether Triton is importable here and not switched off (``$BITMOSAIC_NO_TRITON=1``)."""
    return os.environ.get(NO_TRITON_ENV, "0") != "1" and _importable()


def interpreting() -> bool:
    """Whether Triton kernels run in its interpreter (``TRITON_INTERPRET=1``, read when decorated)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def devices() -> tuple[str, ...]:
    """The device types the Triton kernels are offered for: ``cuda``, plus ``cpu`` under the stand-in
    (``TRITON_INTERPRET=1`` and ``BITMOSAIC_TRITON_ON_CPU=1``)."""
    if not available():
        return ()
    if interpreting() and os.environ.get(ON_CPU_ENV, "0") == "1":
        return ("cuda", "cpu")
    return ("cuda",)


def fp8_dot(device) -> bool:
    """Whether ``tl.dot`` runs FP8 E4M3 operands on ``device``: a CUDA device of compute capability >= 8.9
    (Ada, Hopper: FP8 tensor cores), or the CPU under the interpreter (which runs an fp8 ``tl.dot`` with
    exact products and float32 sums: tests/kernels/triton/test_triton_dpq_fp8.py); never with
    ``$BITMOSAIC_TRITON_FP8_DOT=0``."""
    if os.environ.get(FP8_DOT_ENV, "1") == "0":
        return False
    import torch

    d = torch.device(device)
    if d.type == "cuda":
        return tuple(torch.cuda.get_device_capability(d)) >= FP8_DOT_CAPABILITY
    return d.type == "cpu" and interpreting()


class TritonKernel:
    """The capabilities every Triton kernel class shares (the selector's attributes, kernels/select.py):
    CUDA devices, plus the CPU under the interpreter stand-in; no C++ extension needed."""

    SUPPORTS_DEVICES = ("cuda",)  # plus the CPU under the interpreter stand-in: supported_devices()
    NEEDS_COMPILED = False

    @staticmethod
    def compiled() -> bool:
        return bool(devices())

    @staticmethod
    def supported_devices() -> tuple[str, ...]:
        return devices()


def jit_module(name: str):
    """The ``@triton.jit`` module ``bitmosaic.kernels.triton.<name>`` (imported on first use)."""
    if not available():
        raise RuntimeError(f"Triton is not available (pip install 'triton>=3.2,<4', unset ${NO_TRITON_ENV})")
    return importlib.import_module(f"{__name__}.{name}")


def check_device(t) -> None:
    """A Triton launch needs CUDA tensors, or CPU tensors under the interpreter (else a one-line error)."""
    if t.device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"the Triton kernels run on CUDA tensors (got {t.device.type}); set TRITON_INTERPRET=1 before "
            "importing them to run them in Triton's interpreter on the CPU"
        )
