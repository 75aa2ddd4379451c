"""Models: the declarative per-architecture maps (decoder layers, true-sequential linear groups, the ops
smoothing factors fold into).  Loading and saving live in :mod:`bitmosaic.io`, the calibration
pipeline in :mod:`bitmosaic.pipeline`."""

from .arch import ARCHS, ArchSpec, UnknownArchitectureError, get_arch, register_arch

__all__ = ["ARCHS", "ArchSpec", "UnknownArchitectureError", "get_arch", "register_arch"]
