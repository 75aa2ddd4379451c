"""Mixture-of-experts layers as one ``nn.Linear`` per expert projection.

transformers 5 stores a layer's routed experts as one module with 3-D parameters (``gate_up_proj``
``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``; gpt-oss: transposed, gate/up interleaved, with biases),
and its class decorator (``transformers.integrations.moe.use_experts_implementation``) records that
layout on the instance (``is_transposed``, ``is_concatenated``, ``has_bias``) next to the rule that
combines gate and up (``_apply_gate``).  :func:`unfuse_experts` replaces each such module by a
:class:`RoutedExperts`: an ``nn.ModuleList`` of :class:`ExpertMLP`, each with its own ``gate_proj``,
``up_proj`` and ``down_proj`` linears whose weights are *views* of the fused parameters (nothing is
copied), named ``mlp.experts.<e>.gate_proj`` as the hub checkpoints of Qwen-MoE, DeepSeek and OLMoE
name them.  The calibration pipeline then sees every expert projection as a linear of its own (its
Hessian from the tokens routed to it) and a quantized kind replaces it like any other linear.

The forward is transformers' own: the tokens routed to expert ``e`` (ascending ``e``) run through it,
the result is scaled by the routing weight and added into the output; the gate/up combination is the
original module's ``_apply_gate`` on the original layout (concatenated or interleaved), so the float
model computes what it computed before, up to the summation order inside the split matmuls.

Calibration statistics: each :class:`ExpertMLP` is called as ``expert(x, w)`` with its routed rows
``x`` and their routing weights ``w``; a forward pre-hook sees both.  With :attr:`RoutedExperts.observe_all`
set, every expert is first also called as ``expert(x_all, None)`` on all of the batch's tokens (for
statistics only; its output is discarded, the routed outputs are unchanged).  With
:attr:`RoutedExperts.only` set (a statistics pass over some experts, whose output is dropped), only those
experts run.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ExpertMLP", "RoutedExperts", "unfuse_experts", "is_fused_experts"]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` whose parameters are the given tensors (views: no copy)."""
    lin = nn.Linear(1, 1, bias=bias is not None, device="meta")
    lin.in_features, lin.out_features = weight.shape[1], weight.shape[0]
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


class _GateRule:
    """How an expert combines its gate and up projections: the fused module's own ``_apply_gate`` on
    its own layout (``[gate | up]`` concatenated, or ``gate0 up0 gate1 up1 ...`` interleaved)."""

    def __init__(self, fused: nn.Module) -> None:
        self.concatenated = bool(getattr(fused, "is_concatenated", True))
        apply = getattr(type(fused), "_apply_gate", None)
        self.default = apply is None or apply.__name__ == "_default_apply_gate"
        self.shell = fused  # the stripped fused module: its act_fn / alpha / limit, no parameters

    def __call__(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if self.default:  # transformers' default: act_fn(gate) * up
            return self.shell.act_fn(g) * u
        gu = torch.cat([g, u], -1) if self.concatenated else torch.stack([g, u], -1).flatten(-2)
        return self.shell._apply_gate(gu)


class ExpertMLP(nn.Module):
    """One expert: ``down(rule(gate(x), up(x)))``; ``forward(x, w)`` with ``w`` its tokens' routing
    weights (``None``: a statistics-only call on all tokens; the weights are applied by the caller)."""

    def __init__(
        self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, rule: _GateRule
    ) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        object.__setattr__(self, "_rule", rule)  # not a child: holds no parameters

    def forward(self, x: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
        return self.down_proj(self._rule(self.gate_proj(x), self.up_proj(x)))


class RoutedExperts(nn.ModuleList):
    """A layer's routed experts, one :class:`ExpertMLP` each, called like the fused module it replaces:
    ``experts(hidden [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``."""

    def __init__(self, experts: list[ExpertMLP], fused_class: str = "") -> None:
        super().__init__(experts)
        self.fused_class = fused_class
        self.observe_all = False
        self.only: set[int] | None = None  # a statistics pass: only these experts run (the output is dropped)

    @property
    def num_experts(self) -> int:
        return len(self)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        if self.observe_all:
            for e, expert in enumerate(self):
                if self.only is None or e in self.only:
                    expert(hidden_states, None)
        n = len(self)
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=n).tolist()
        k = top_k_index.shape[-1]
        start = 0
        for e, c in enumerate(counts[:n]):  # indices >= n mask a slot out (transformers' convention)
            if c == 0:
                continue
            sel = order[start : start + c]
            start += c
            if self.only is not None and e not in self.only:
                continue
            tok, pos = sel // k, sel % k
            w = top_k_weights[tok, pos]
            y = self[e](hidden_states[tok], w) * w[:, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers 5 fused-experts module (3-D ``gate_up_proj``/``down_proj``)."""
    w = getattr(module, "down_proj", None)
    return (
        not isinstance(module, RoutedExperts)
        and isinstance(w, torch.Tensor)
        and w.ndim == 3
        and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
    )


def _split(fused: nn.Module, e: int) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
    """Expert ``e``'s gate, up and down linears as views of the fused parameters."""
    transposed = bool(getattr(fused, "is_transposed", False))
    gu, down = fused.gate_up_proj.data[e], fused.down_proj.data[e]
    if transposed:  # stored [in, out] (x @ W)
        gu, down = gu.T, down.T
    gu_b = getattr(fused, "gate_up_proj_bias", None)
    down_b = getattr(fused, "down_proj_bias", None)
    gu_b = gu_b.data[e] if isinstance(gu_b, torch.Tensor) else None
    down_b = down_b.data[e] if isinstance(down_b, torch.Tensor) else None
    if getattr(fused, "is_concatenated", True):
        i = gu.shape[0] // 2
        parts = (gu[:i], gu[i:]), (None, None) if gu_b is None else (gu_b[:i], gu_b[i:])
    else:
        parts = (gu[0::2], gu[1::2]), (None, None) if gu_b is None else (gu_b[0::2], gu_b[1::2])
    (g, u), (gb, ub) = parts
    return _linear(g, gb), _linear(u, ub), _linear(down, down_b)


def unfuse_experts(model: nn.Module) -> int:
    """Replace every fused-experts module of ``model`` by a :class:`RoutedExperts` over views of its
    parameters (module doc); the number of modules replaced (0 for a dense model, or one already done)."""
    fused = [(name, m) for name, m in model.named_modules() if is_fused_experts(m)]
    for name, m in fused:
        if getattr(m, "has_gate", True) is False:
            raise NotImplementedError(f"{name}: experts without a gate projection are not supported yet")
        rule = _GateRule(m)
        n = m.gate_up_proj.shape[0]
        experts = [ExpertMLP(*_split(m, e), rule) for e in range(n)]
        for p in list(m._parameters):  # the views hold the storage; the shell keeps no parameters
            m._parameters.pop(p)
        model.set_submodule(name, RoutedExperts(experts, type(m).__name__))
    return len(fused)
