"""Errors that bitmosaic raises for bad input, and the small checks that raise them.

Every class here derives from :class:`BitmosaicError`, itself a ``ValueError``: callers that caught
``ValueError`` keep working, and the CLI turns any ``BitmosaicError`` into one line on stderr and exit
status 2.  Messages are one line and name both the problem and the fix.

This module imports nothing else from bitmosaic, so every layer can use it.
"""

from __future__ import annotations

import torch

__all__ = [
    "BitmosaicError",
    "OptionError",
    "DeviceError",
    "DataError",
    "OutputExistsError",
    "CorruptModelError",
    "NonFiniteError",
    "ScaleOverflowError",
    "OutputWriteError",
    "OutputLockedError",
    "ModelSpecError",
    "Interrupted",
    "check_finite",
]


class BitmosaicError(ValueError):
    """Base class of bitmosaic's documented errors (bad input, bad files, bad options)."""


class OptionError(BitmosaicError):
    """A method option that the method does not use, or a value it does not accept."""


class DeviceError(BitmosaicError):
    """A device or dtype that cannot be used here (e.g. ``cuda`` without a CUDA GPU)."""


class DataError(BitmosaicError, RuntimeError):
    """Calibration or evaluation text that cannot be had (no data folder, no network, ...).

    Also a ``RuntimeError``, the class these errors had before.
    """


class OutputExistsError(BitmosaicError, FileExistsError):
    """The output folder exists and may not be replaced (also a ``FileExistsError``)."""


class CorruptModelError(BitmosaicError):
    """A saved model folder is unreadable: truncated or garbage files, missing shards, bad JSON,
    tensors that do not match the model."""


class NonFiniteError(BitmosaicError):
    """A tensor holds NaN or Inf values where finite numbers are required."""


class ScaleOverflowError(BitmosaicError):
    """A layer's weights need a quantization scale larger than its storage format holds (float16)."""


class OutputWriteError(BitmosaicError, OSError):
    """An output could not be written (full disk, no permission, a file where a folder must be);
    nothing partial is left behind.  Also an ``OSError``."""


class ModelSpecError(BitmosaicError):
    """The model argument names nothing loadable (also importable from ``bitmosaic.io.sources.loading``)."""


class OutputLockedError(BitmosaicError):
    """Another bitmosaic run is writing the same output folder now (it holds the folder's lock)."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached a bitmosaic command (``signum``); a ``KeyboardInterrupt``, so every
    ``except BaseException`` / ``finally`` on the way removes its temporaries."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_CHUNK = 1 << 24  # elements checked at a time: bounds the temporary bool mask of a huge tensor


def check_finite(tensor: torch.Tensor, what: str) -> None:
    """Raise :class:`NonFiniteError` naming ``what`` when ``tensor`` has a NaN or an Inf.

    ``what`` says which tensor it is, e.g. ``"weight model.layers.3.mlp.down_proj.weight of 'x'"`` or
    ``"input of layer 5 (self_attn.q_proj)"``.  Integer and bool tensors are always finite.  Works on any
    device; the check runs in chunks, so its extra memory stays small for huge tensors.
    """
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return
    t = tensor.detach()
    # Fast path: NaN and Inf always propagate into a sum, so a finite sum proves every element
    # finite (one reduction, no bool tensor); only a non-finite sum (or an overflow) needs the
    # exact element check.  Half types are summed in float32 so that overflow stays rare.
    # A half tensor is summed a chunk at a time: ``sum(dtype=float32)`` converts its whole input
    # first (2 GB for a bf16 Llama-3 embedding).
    acc = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) or t.element_size() == 1 else None
    flat = t.reshape(-1)
    if acc is None:
        if t.numel() and bool(torch.isfinite(t.sum()).all()):
            return
    elif all(
        bool(torch.isfinite(flat[s : s + _CHUNK].sum(dtype=acc)))
        for s in range(0, flat.numel(), _CHUNK)
    ):
        return
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start : start + _CHUNK]
        if not bool(torch.isfinite(chunk.float() if chunk.element_size() == 1 else chunk).all()):
            _raise_non_finite(tensor.detach(), what)


def _raise_non_finite(t: torch.Tensor, what: str) -> None:
    if t.element_size() == 1:  # FP8: isnan/isinf have no kernels for it
        t = t.float()
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    bad = (~torch.isfinite(t)).nonzero()
    first = tuple(int(i) for i in bad[0]) if bad.numel() else ()
    where = f" (first at index {list(first)})" if first else ""
    raise NonFiniteError(
        f"{what} is not finite: {nan} NaN and {inf} Inf value(s){where} in shape {list(t.shape)}; "
        "the model or its inputs are corrupt or diverged: use a checkpoint with finite weights"
    )
