"""Kernel weights of many same-shaped matrices over one stacked storage (issue 71: packed MoE experts).

A mixture-of-experts projection is ``E`` matrices of one shape and one format.  :func:`stack_in_place`
takes their kernel objects (a :class:`~bitmosaic.kernels.qmatmul.LowBitWeight`, a
:class:`~bitmosaic.kernels.lut.BitPlaneWeight`, an :class:`~bitmosaic.kernels.intmm.IntActWeight`, or the
module-level wrappers around them) and moves every tensor they hold -- packed codes, scales, zero-points,
row offsets, permutations, at any depth of nested kernel objects -- into one ``[E, ...]`` tensor per
field; each object's field becomes the view ``stacked[e]`` (contiguous: dimension 0 is outermost).
Nothing else changes: each object's ``matmul`` runs the same compiled kernel on the same bytes, now at an
offset inside the stack, so an expert computes bit for bit what it computed before, and the ``E`` objects
stay usable one by one.  The stack is the only copy (the objects' own tensors are dropped).

Objects can be stacked when they have the same class and structure (same non-tensor fields, tensors of
the same shape and dtype per field); otherwise :class:`NotStackable` says which field differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["NotStackable", "StackedKernels", "stack_in_place"]

_LEAVES = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


class NotStackable(ValueError):
    """Kernel objects that cannot share one stacked storage (the field that differs is named)."""


def _fields(obj, path: tuple = ()) -> list[tuple[tuple, object]]:
    """``(path, value)`` of every tensor or plain value reachable from ``obj`` through the attributes of
    bitmosaic kernel objects (nested ones included), in a fixed order."""
    out = []
    for name, v in sorted(vars(obj).items()):
        p = (*path, name)
        if torch.is_tensor(v) or isinstance(v, _LEAVES):
            out.append((p, v))
        elif isinstance(v, (tuple, list)) and all(isinstance(t, _LEAVES) for t in v):
            out.append((p, tuple(v)))
        elif type(v).__module__.startswith("bitmosaic.") and hasattr(v, "__dict__"):
            out.append((p, type(v)))
            out.extend(_fields(v, p))
        else:
            raise NotStackable(
                f"field {'.'.join(p)} of a {type(obj).__name__} ({type(v).__name__}) cannot be stacked"
            )
    return out


def _set(obj, path: tuple, value) -> None:
    for name in path[:-1]:
        obj = getattr(obj, name)
    object.__setattr__(obj, path[-1], value)  # frozen dataclasses (the bit planes) too


def _same_plain(a, b) -> bool:
    return type(a) is type(b) and a == b


def stack_in_place(objs: Sequence) -> dict[tuple, torch.Tensor]:
    """Move the tensors of ``objs`` (kernel objects of one class and structure) into one ``[E, ...]``
    tensor per field; each object's field becomes a view of its row (module doc).  Returns the stacks by
    attribute path.  Raises :class:`NotStackable` (nothing changed) when the objects differ."""
    if not objs:
        raise NotStackable("no kernel objects to stack")
    first = _fields(objs[0])
    per = [first] + [_fields(o) for o in objs[1:]]
    for e, fields in enumerate(per[1:], 1):
        if type(objs[e]) is not type(objs[0]) or [p for p, _ in fields] != [p for p, _ in first]:
            raise NotStackable(f"kernel {e} is a {type(objs[e]).__name__} of another structure than kernel 0")
        for (p, a), (_, b) in zip(first, fields, strict=True):
            if torch.is_tensor(a) != torch.is_tensor(b):
                raise NotStackable(f"field {'.'.join(p)} of kernel {e} differs in kind from kernel 0's")
            if torch.is_tensor(a):
                if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device or a.layout != b.layout:
                    raise NotStackable(
                        f"field {'.'.join(p)} of kernel {e} is {b.dtype} {tuple(b.shape)}, "
                        f"kernel 0's {a.dtype} {tuple(a.shape)}"
                    )
            elif not _same_plain(a, b):
                raise NotStackable(f"field {'.'.join(p)} of kernel {e} is {b!r}, kernel 0's {a!r}")
    tensors = [(i, p) for i, (p, a) in enumerate(first) if torch.is_tensor(a)]
    for _, p in tensors:
        if dict(first)[p].layout != torch.strided:
            raise NotStackable(f"field {'.'.join(p)} is a {dict(first)[p].layout} tensor")
    stacks = {p: torch.stack([fields[i][1] for fields in per]) for i, p in tensors}
    for p, stacked in stacks.items():  # only once every stack is made: all or nothing changes
        for e, o in enumerate(objs):
            _set(o, p, stacked[e])
    return stacks


class StackedKernels:
    """``E`` kernel objects sharing one stacked storage: ``kernels[e]`` runs expert ``e`` (module doc)."""

    def __init__(self, kernels: Sequence) -> None:
        self.kernels = list(kernels)
        self.stacks = stack_in_place(self.kernels)

    def __len__(self) -> int:
        return len(self.kernels)

    def __getitem__(self, e: int):
        return self.kernels[e]

    def kernel_name(self) -> str:
        """The ``KERNEL_NAME`` of the kernel class the experts run (kernels/select.py)."""
        k = self.kernels[0]
        w = getattr(k, "weight", k)
        return getattr(type(w), "KERNEL_NAME", type(w).__name__)

    def nbytes(self) -> int:
        """Bytes of the stacked storage (all experts)."""
        return sum(t.numel() * t.element_size() for t in self.stacks.values())
