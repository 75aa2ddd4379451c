"""SpinQuant's learned rotations (``--rotate spinquant``; Liu et al., "SpinQuant: LLM quantization
with learned rotations", 2024): R1 (the residual stream's) and each layer's R2 (the value/output
heads') are learned on the calibration data, starting from QuaRot's Hadamard ones, by Cayley SGD on
the orthogonal group (Sec. 3.2; :func:`~bitmosaic.algorithms.rotation.cayley_step`), minimising the
next-token cross-entropy of the model whose linears see quantized activations.  The online
Hadamards (R3/R4 in the paper's terms: ``o_proj``'s and ``down_proj``'s inputs here) stay fixed.

As the paper does when a Hessian-based solver quantizes the weights afterwards (Sec. 4.1:
"W16A4"), the weights stay in 16/32 bits while the rotations are learned; the activations are
fake-quantized by the run's own activation quantizer with a straight-through gradient (a static
quantizer is learned against its dynamic form of the same granularity -- per token for a per-tensor
one -- since its scales are calibrated only after the rotation).  ``batch`` calibration samples per
step (the paper: 8 sequences of 2048 tokens, 100 steps, lr 1.5), cycling through them in order.  The
learning runs on the run's device (the whole float model is moved there for it and back after).

The learning is generic: it rotates whatever :func:`~bitmosaic.pipeline.rotate.rotated_state` rotates
and knows no method.  Cost: ``steps`` forward and backward passes of the whole float model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call
from tqdm.auto import tqdm

from ..algorithms.rotation import cayley_step
from ..formats.act import ActQuantSpec, fake_quant
from ..models.arch import ArchSpec

__all__ = ["learn_rotation", "dynamic_form", "on_device"]


def dynamic_form(act: ActQuantSpec) -> ActQuantSpec:
    """The dynamic quantizer a static ``act`` is learned against (per tensor -> per token)."""
    if not act.static:
        return act
    gran = "token" if act.granularity == "tensor" else act.granularity
    return dataclasses.replace(act, static=False, granularity=gran)


def _ste_hook(spec: ActQuantSpec):
    def hook(module: nn.Module, args: tuple):
        x = args[0]
        return (x + (fake_quant(x, spec) - x).detach(), *args[1:])

    return hook


@contextlib.contextmanager
def on_device(model: nn.Module, arch: ArchSpec, device: torch.device | str | None):
    """The whole ``model`` on ``device`` (``None``: where it is) for the block, back home after."""
    home = model.get_submodule(arch.rotation.embed).weight.device
    dev = torch.device(device) if device is not None else home
    if dev != home:
        model.to(dev)
    try:
        yield
    finally:
        if dev != home:
            model.to(home)


def learn_rotation(
    model: nn.Module,
    arch: ArchSpec,
    start: tuple[torch.Tensor, list[torch.Tensor]],
    calib: torch.Tensor,
    act: ActQuantSpec,
    spec,
    rotated_state: Callable[..., dict[str, torch.Tensor]],
    progress: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
    """Learn R1 (``Q1``, ``[d, d]``) and the per-layer R2 (``R2``) from ``start = (Q1, R2)`` for a model
    that :func:`~bitmosaic.pipeline.rotate.prepare_rotation` prepared (``spec``: a
    :class:`~bitmosaic.pipeline.rotate.RotationSpec` with ``steps``, ``lr`` and ``batch``;
    ``rotated_state``: the rotation's differentiable parametrisation,
    :func:`~bitmosaic.pipeline.rotate.rotated_state`), where the model is (:func:`on_device` puts it
    where it should learn).  Returns the learned matrices (float64, orthogonal to rounding, on
    ``Q1``'s device) and
    ``{"steps", "lr", "batch", "cycle", "losses", "loss_first", "loss_last"}``: ``losses`` the
    cross-entropy of each step's samples before its step (``loss_first``/``loss_last`` the first and
    the last), ``cycle`` the steps after which the samples repeat (steps ``t`` and ``t + cycle`` see the
    same samples, so a descent shows as ``losses[t + cycle] < losses[t]``); the model's parameters are
    unchanged (the caller folds the result in)."""
    Q1, R2 = start
    dev = model.get_submodule(arch.rotation.embed).weight.device
    base = {n: p.detach() for n, p in model.named_parameters()}
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    Q = Q1.to(device=dev, dtype=torch.float32).clone().requires_grad_(True)
    R = [r.to(device=dev, dtype=torch.float32).clone().requires_grad_(True) for r in R2]
    quant = dynamic_form(act)
    hooks = []
    for layer in arch.layers(model):
        for name in arch.layer_linear_names(layer):
            hooks.append(layer.get_submodule(name).register_forward_pre_hook(_ste_hook(quant)))
    losses: list[float] = []
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        n, b = calib.shape[0], spec.batch
        for step in tqdm(range(spec.steps), desc="spinquant", unit="step", disable=not progress):
            ids = calib[[(step * b + i) % n for i in range(b)]].to(dev)
            params = rotated_state(model, arch, Q, R, base)
            logits = functional_call(model, params, (ids,)).logits
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            gQ, *gR = torch.autograd.grad(loss, [Q, *R])
            with torch.no_grad():
                Q = cayley_step(Q, gQ, spec.lr).requires_grad_(True)
                R = [cayley_step(r, g, spec.lr).requires_grad_(True) for r, g in zip(R, gR, strict=True)]
            losses.append(float(loss.detach()))
    finally:
        for h in hooks:
            h.remove()
        for name, p in model.named_parameters():
            p.requires_grad_(grads[name])
    cycle = calib.shape[0] // math.gcd(calib.shape[0], spec.batch)
    info = {"steps": spec.steps, "lr": spec.lr, "batch": spec.batch, "cycle": cycle, "losses": losses,
            "loss_first": losses[0], "loss_last": losses[-1]}  # fmt: skip
    out = Q1.device
    return Q.detach().double().to(out), [r.detach().double().to(out) for r in R], info
