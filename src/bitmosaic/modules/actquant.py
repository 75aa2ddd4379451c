"""Activation fake-quantization at the input of a linear module.

:func:`attach_input_quant` gives any linear-like module (``nn.Linear`` during calibration, the
packed modules afterwards) an ``input_quant`` child -- an :class:`ActQuantizer` whose static
scale is a buffer, so it is saved in the state dict -- and a forward pre-hook that replaces the
input by ``Q(x)`` (simulated), unless the module runs integer activation compute for this input
(``runs_int_act``, :mod:`bitmosaic.modules.intact`): then the module quantizes inside its kernel.
The module's own forward is untouched, so every module kind gets activation quantization the same way.
See :mod:`bitmosaic.formats.act` for the numerics.
"""

from __future__ import annotations

import torch
from torch import nn

from ..formats.act import ActQuantSpec, fake_quant

__all__ = ["ActQuantizer", "attach_input_quant", "input_quant_spec"]


class ActQuantizer(nn.Module):
    def __init__(self, spec: ActQuantSpec, in_features: int) -> None:
        super().__init__()
        self.spec = spec
        if spec.static:
            size = 1 if spec.per_tensor_static else -(-in_features // spec.group_size)
            self.register_buffer("scale", torch.ones(size, dtype=torch.float32))
        else:
            self.scale = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant(x, self.spec, self.scale)

    def extra_repr(self) -> str:
        return self.spec.label


def _input_quant_hook(module: nn.Module, args: tuple):
    runs_int = getattr(module, "runs_int_act", None)
    if runs_int is not None and runs_int(args[0]):
        return None  # the module quantizes x inside its integer kernel (modules/intact.py)
    return (module.input_quant(args[0]), *args[1:])


def attach_input_quant(
    module: nn.Module, spec: ActQuantSpec, in_features: int, scale: torch.Tensor | None = None
) -> ActQuantizer:
    """Quantize ``module``'s input with ``spec`` from now on; ``scale`` for static specs."""
    if getattr(module, "input_quant", None) is not None:
        raise RuntimeError(f"{type(module).__name__} already has an input quantizer")
    q = ActQuantizer(spec, in_features)
    if spec.static and scale is not None:
        if scale.numel() != q.scale.numel():
            raise ValueError(f"static scale has {scale.numel()} values, expected {q.scale.numel()}")
        q.scale.copy_(scale.reshape(-1).float())
    module.input_quant = q
    module._input_quant_handle = module.register_forward_pre_hook(_input_quant_hook)
    return q


def input_quant_spec(module: nn.Module) -> ActQuantSpec | None:
    q = getattr(module, "input_quant", None)
    return q.spec if isinstance(q, ActQuantizer) else None
