"""Online rotation at the input of a linear module (QuaRot's online Hadamard before ``down_proj``).

:func:`attach_input_rotation` gives any linear-like module (``nn.Linear`` during calibration, the packed
modules afterwards) an ``input_rotation`` child -- an :class:`InputRotation` with no saved state --
and a forward pre-hook, put *first*, that replaces the input ``x`` by ``x @ R`` (``R`` orthogonal:
the normalised Hadamard of the input width, through a fast Walsh-Hadamard transform, or for widths
with no known Hadamard under ``--rotate random`` a random orthogonal matrix rebuilt from its seed; under
``--rotate block`` the block-diagonal Hadamard of the scale block, ``{"type": "hadamard", "block": b}``).
Any input quantizer (:mod:`.actquant`) then sees the rotated input.  Its transpose is folded into the
module's weight offline (:mod:`bitmosaic.pipeline.rotate`), so the float function is unchanged.

A saved model records, per rotated module, its :meth:`InputRotation.spec` in the quantization
config's ``"rotation"`` entry; :func:`apply_saved_rotations` re-attaches them on every load path
(:func:`bitmosaic.io.saved.finish.finish_load`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..algorithms.rotation import (
    block_hadamard_transform,
    hadamard_factor,
    hadamard_transform,
    random_orthogonal,
)

__all__ = ["InputRotation", "attach_input_rotation", "apply_saved_rotations", "carry_input_rotation",
           "input_rotation_spec", "online_spec"]  # fmt: skip


def online_spec(kind: str, n: int, seed: int, block: int | None = None) -> dict:
    """The online rotation of an ``n``-wide input for ``--rotate kind``: a Hadamard when one of order
    ``n`` is known (``kind="hadamard"`` needs one: the caller refuses otherwise), else, for
    ``kind="random"``, a random orthogonal matrix from ``seed``; ``kind="block"``: the block-diagonal
    Hadamard of order ``block``."""
    if kind == "block":
        return {"type": "hadamard", "n": int(n), "block": int(block)}
    if hadamard_factor(n) is not None:
        return {"type": "hadamard", "n": int(n)}
    return {"type": "random", "n": int(n), "seed": int(seed)}


class InputRotation(nn.Module):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        if spec.get("type") not in ("hadamard", "random") or not isinstance(spec.get("n"), int):
            raise ValueError(f"bad online rotation {spec!r}: expected {{type: hadamard|random, n: INT}}")
        self.type = spec["type"]
        self.n = spec["n"]
        self.seed = int(spec.get("seed", 0))
        self.block = spec.get("block")  # a block-diagonal Hadamard (--rotate block), else None
        if self.block is not None and (self.type != "hadamard" or self.n % int(self.block)):
            raise ValueError(f"bad online rotation {spec!r}: a block Hadamard's block must divide n")
        self._matrix: torch.Tensor | None = None  # the random kind's matrix, built on first use

    def spec(self) -> dict:
        return online_spec_of(self)

    def matrix(self, device, dtype) -> torch.Tensor:
        if self._matrix is None:
            self._matrix = random_orthogonal(self.n, self.seed, torch.float64)
        return self._matrix.to(device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.n:
            raise ValueError(f"online rotation of width {self.n} got an input of width {x.shape[-1]}")
        if self.type == "hadamard":
            return hadamard_transform(x) if self.block is None else block_hadamard_transform(x, self.block)
        return x @ self.matrix(x.device, x.dtype)

    def extra_repr(self) -> str:
        return f"{self.type}, n={self.n}" + ("" if self.block is None else f", block={self.block}")


def online_spec_of(m: InputRotation) -> dict:
    d = {"type": m.type, "n": m.n}
    if m.type == "random":
        d["seed"] = m.seed
    if m.block is not None:
        d["block"] = int(m.block)
    return d


def _input_rotation_hook(module: nn.Module, args: tuple):
    return (module.input_rotation(args[0]), *args[1:])


def attach_input_rotation(module: nn.Module, spec: dict) -> InputRotation:
    """Rotate ``module``'s input by ``spec`` from now on, before any other pre-hook."""
    if getattr(module, "input_rotation", None) is not None:
        raise RuntimeError(f"{type(module).__name__} already has an input rotation")
    r = InputRotation(spec)
    module.input_rotation = r
    module._input_rotation_handle = module.register_forward_pre_hook(_input_rotation_hook, prepend=True)
    return r


def input_rotation_spec(module: nn.Module) -> dict | None:
    r = getattr(module, "input_rotation", None)
    return r.spec() if isinstance(r, InputRotation) else None


def carry_input_rotation(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` (the packed module replacing ``old``) ``old``'s input rotation, if any."""
    spec = input_rotation_spec(old)
    if spec is not None and input_rotation_spec(new) is None:
        attach_input_rotation(new, spec)


def apply_saved_rotations(model: nn.Module, rotation: dict | None) -> int:
    """Re-attach the online rotations a saved model's ``quantization_config["rotation"]`` lists
    (``{"online": {module name: spec}}``); returns how many."""
    if not rotation:
        return 0
    online = rotation.get("online") or {}
    for name, spec in online.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"the saved rotation names {name!r}, which the model does not have") from None
        if input_rotation_spec(module) is None:
            attach_input_rotation(module, spec)
    return len(online)
