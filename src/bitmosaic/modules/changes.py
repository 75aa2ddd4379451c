"""A per-model counter of changes to how its modules compute, for caches that must not outlive them.

A compiled decode step (:mod:`bitmosaic.modules.decode`) skips dynamo's ~12,000 guards on a model's modules
(about 3 ms a token on SmolLM2), so it cannot see a module switch paths by itself; the functions that
switch them at run time -- :func:`~bitmosaic.modules.head.set_runtime_head`,
:func:`~bitmosaic.modules.intact.set_runtime_activations`,
:func:`~bitmosaic.modules.base.set_weight_cache` -- call :func:`mark_changed`, and the compiled step
compiles again when :func:`changes` differs from the count it was compiled at.
"""

from __future__ import annotations

from torch import nn

__all__ = ["mark_changed", "changes"]

_ATTR = "_bitmosaic_changes"


def mark_changed(model: nn.Module) -> None:
    """Record that some module of ``model`` now computes differently (a new run-time path)."""
    model.__dict__[_ATTR] = model.__dict__.get(_ATTR, 0) + 1


def changes(model: nn.Module) -> int:
    """How many times :func:`mark_changed` was called on ``model``."""
    return model.__dict__.get(_ATTR, 0)
