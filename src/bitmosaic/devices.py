"""Which device a run uses: one resolution for the CLI, the Python API and the pipeline."""

from __future__ import annotations

import torch
from torch import nn

from .errors import DeviceError

__all__ = ["DEVICE_CHOICES", "resolve_device"]

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_device(name: str | torch.device | None = "auto", model: nn.Module | None = None) -> torch.device:
    """The device a run uses: ``"auto"`` = CUDA when available, else CPU; ``None`` = where ``model``'s
    parameters are (``"auto"`` without a model); ``"cpu"``; ``"cuda"`` / ``"cuda:N"``, which raise
    :class:`DeviceError` when CUDA (or GPU ``N``) is not there."""
    if name is None and model is not None:
        for p in model.parameters():
            return p.device
        return torch.device("cpu")
    if isinstance(name, torch.device):
        name = str(name)
    name = "auto" if name is None else str(name).strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise DeviceError(f"bad device {name!r}; use cuda or cuda:N") from None
        if not torch.cuda.is_available():
            raise DeviceError(
                f"--device {name}: CUDA is not available here (torch {torch.__version__}, "
                f"CUDA build: {torch.version.cuda or 'no'}); use --device cpu or --device auto"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise DeviceError(f"--device {name}: this machine has {count} CUDA device(s); use cuda:0..")
        return dev
    raise DeviceError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_CHOICES)} (or cuda:N)")


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_MB
    except (OSError, ValueError, IndexError):
        return 0.0


_PAGE_MB = 4096 / 2**20
_trimmed_at = [0.0]  # the process's resident size after the last trim (one process, one heap)
# no trim before the resident size grew this much since the last one: the pages a trim returns fault in
# again when reused (a steady loop reuses them every batch).  Measured on SmolLM2's GPTQ defaults
# (16 x 512, 2 threads, interleaved runs in one process): 44.7 s with a trim at every call, 37.7 s
# with this floor (medians of 3), peak resident size +85 MB
TRIM_MIN_MB = 256.0


def release_host_memory() -> None:
    """Give freed heap pages back to the OS (glibc's ``malloc_trim``; nothing elsewhere), once the
    resident size grew :data:`TRIM_MIN_MB` since the last trim.

    Freed temporaries under glibc's mmap threshold (up to 32 MB: row blocks, scale searches, a
    layer's activations) stay in the heap, and long-lived small blocks allocated between them keep
    the holes from being returned or coalesced: measured on an 8B-shaped layer, 0.2-0.5 GB of holes
    within one 14336-wide GPTQ solve and 0.3-0.9 GB over a layer.  A trim costs a few milliseconds
    plus the page faults of reusing the pages.  The pipeline calls it after each solve, group and
    layer, inside calibration forwards and after a wide GPTQ solve's scale fit."""
    if _rss_mb() - _trimmed_at[0] < TRIM_MIN_MB:
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
    _trimmed_at[0] = _rss_mb()
