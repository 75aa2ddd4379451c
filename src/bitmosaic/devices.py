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
