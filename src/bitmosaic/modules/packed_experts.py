"""Packed experts: one projection of all of a MoE layer's experts over one stacked storage (issue 71,
item 3), and the routed-experts module that runs only the experts each token chose.

After quantization a MoE layer holds one ``packed`` module (:class:`~bitmosaic.modules.qlinear.QuantLinear`)
per expert projection (``mlp.experts.<e>.gate_proj`` ...; modules/experts.py).  :func:`pack_experts`
turns each such layer's :class:`~bitmosaic.modules.experts.RoutedExperts` into a
:class:`PackedRoutedExperts`: for each projection, the experts' kernel weights (the codes at their
storage width, float32 scales and zero-points, act-order permutations: whatever kernel
:func:`~bitmosaic.kernels.select.select_kernel` picked for the kind) move into one ``[E, ...]`` tensor
per field (:mod:`bitmosaic.kernels.stacked`), held by a :class:`PackedExperts` module: the ``packed``
format's ``qweight [E, out, bytes]``, ``scales [E, out, G]``, ``zeros``, ``g_idx [E, in]`` stacked,
rebuilt exactly from the stacked kernel when read.  It is a run-time form, not a saved kind (it has no
``kind`` of its own, so ``KINDS`` does not list it, and nothing saves it): every kind in ``KINDS`` is
one a folder can hold and an export must take or refuse, and a folder holds the experts' own modules.

What is saved does not change: the experts' own modules stay in the model under their per-expert names
(what vLLM, the hub checkpoints and the export helpers expect); their kernels *are* the rows of the stack
(views, one copy in memory) and their saved buffers are rebuilt from them, bit for bit, when a save or an
export reads them.  A load builds the per-expert modules (``unfuse_experts``) and packs at its end
(``finish_load``); the pipeline packs each layer once it is quantized.

Forward (same signature as the module it replaces: ``hidden [T, H]``, ``top_k_index [T, K]``,
``top_k_weights [T, K]``): the token-expert pairs are sorted by expert (a stable sort: tokens in order
within an expert) and each expert that was hit runs once on its rows: at decode (one token) a GEMV per
chosen expert (the compiled decode kernel of the stacked row), at prefill one gathered matmul per hit
expert (the kernel's tiled path); experts with no tokens are never touched.  Each product is the
expert module's own kernel on the same bytes, and the sums are added in the same order, so the output
equals the per-expert path bit for bit.  An expert module whose forward is not the plain kernel (an
activation quantizer -- its integer kernel is stacked as well -- a hook, the weight cache, a device
move that dropped its kernel) runs through its own ``forward``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ..formats.accounting import bits_per_weight
from ..kernels.stacked import NotStackable, StackedKernels, stack_in_place
from .base import QuantModule
from .experts import RoutedExperts
from .qlinear import QuantLinear, packed_kwargs

__all__ = ["PackedExperts", "PackedRoutedExperts", "pack_experts", "packed_experts_report", "runs_stacked"]

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_STORAGE = ("qweight", "scales", "zeros", "g_idx")


class PackedExperts(QuantModule):
    """``num_experts`` ``packed`` linears of one shape and format, stacked (module doc).  ``forward(x, e)``
    multiplies by expert ``e``; :meth:`expert` is expert ``e`` as a ``packed`` module (views)."""

    # not a saved kind (no ``kind`` of its own, so not in ``KINDS``): a folder holds the experts' own
    # ``packed`` modules under their per-expert names; this stack is built from them at load or run time
    KERNELS: ClassVar[tuple[str, ...]] = QuantLinear.KERNELS  # each expert's kernel, chosen as QuantLinear's

    def __init__(self, in_features: int, out_features: int, *, num_experts: int, **packed) -> None:
        super().__init__(in_features, out_features, bias=False)
        with torch.device("meta"):  # validates the format; its buffers give the per-expert shapes
            one = QuantLinear(in_features, out_features, **packed)
        self.num_experts = int(num_experts)
        self.bits, self.group_size, self.symmetric = one.bits, one.group_size, one.symmetric
        self.storage_bits, self.code_offset = one.storage_bits, one.code_offset
        self._packed = {k: v for k, v in packed.items() if k != "bias"}
        for name in _STORAGE:
            t = getattr(one, name)
            stacked = None if t is None else torch.zeros(self.num_experts, *t.shape, dtype=t.dtype)
            self.register_buffer(name, stacked)
        if packed.get("bias"):
            self.bias = nn.Parameter(torch.zeros(self.num_experts, out_features), requires_grad=False)

    def layer_config(self) -> dict:
        """The experts' common ``packed`` config with their number (``kind``: the experts' kind)."""
        return {**self.expert_config(), "num_experts": self.num_experts}

    def expert_config(self) -> dict:
        """Each expert's saved ``packed`` per-layer config."""
        return {"kind": QuantLinear.kind, "in_features": self.in_features, "out_features": self.out_features,
                "bias": self.bias is not None, **self._packed}  # fmt: skip

    @classmethod
    def from_experts(cls, experts: list[QuantLinear]) -> PackedExperts:
        """The stack of ``experts`` (plain ``packed`` modules of one config, on the CPU): their kernels
        are built (``QuantModule.kernel``) and moved into the stack in place, so each module keeps
        running (and saving) as before over its row.  Raises :class:`NotStackable` when they differ."""
        if not experts or any(type(m) is not QuantLinear for m in experts):
            raise NotStackable("only plain 'packed' modules are stacked")
        cfg = experts[0].layer_config()
        for e, m in enumerate(experts):
            if m.layer_config() != cfg:
                raise NotStackable(f"expert {e}'s format {m.layer_config()} differs from expert 0's {cfg}")
            on_cpu = bool(m._kernel) or m.scales.device.type == "cpu"  # kernels live on the CPU
            if not on_cpu or m.cache_weight:
                raise NotStackable(f"expert {e} is not on the CPU or keeps a float weight")
        kernels = [m.kernel() for m in experts]
        if any(k is None for k in kernels):
            raise NotStackable("an expert has no kernel weight")
        stacked = StackedKernels(kernels)
        with torch.device("meta"):
            pe = cls(cfg["in_features"], cfg["out_features"], num_experts=len(experts), **packed_kwargs(cfg))
        pe._kernel = stacked
        pe._released = {n for n in _STORAGE if pe._buffers.get(n) is not None}
        if cfg["bias"]:  # the experts' biases become rows of the stack too
            bias = torch.stack([m.bias.detach() for m in experts])
            pe.bias = nn.Parameter(bias, requires_grad=False)
            for e, m in enumerate(experts):
                m.bias = nn.Parameter(bias[e], requires_grad=False)
        return pe

    def expert(self, e: int) -> QuantLinear:
        """Expert ``e`` as a ``packed`` module whose buffers are views of this stack's rows."""
        m = QuantLinear(self.in_features, self.out_features, bias=False, **self._packed)
        for name in _STORAGE:
            t = getattr(self, name)
            if t is not None:
                m._buffers[name] = t[e]
        if self.bias is not None:
            m.bias = nn.Parameter(self.bias[e], requires_grad=False)
        return m

    def storage_tensors(self) -> list[torch.Tensor]:
        return [t for t in (getattr(self, n) for n in _STORAGE) if t is not None]

    def bits_per_weight(self) -> float:
        return bits_per_weight(
            self.storage_tensors(), self.num_experts * self.in_features * self.out_features
        )

    def dequantize_reference(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights ``[E, out, in]`` through the ``packed`` reference path, expert by expert."""
        return torch.stack([self.expert(e).dequantize_reference(dtype) for e in range(self.num_experts)])

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.stack([self.expert(e)._dequantize(dtype) for e in range(self.num_experts)])

    def _build_kernel(self):
        """Each expert's ``packed`` kernel built from its rows, then stacked (:class:`StackedKernels`)."""
        return StackedKernels([self.expert(e)._build_kernel() for e in range(self.num_experts)])

    def _saved_from_kernel(self, k):
        """The stacked buffers rebuilt from the stacked kernel: expert by expert, as ``packed`` does."""
        per = [QuantLinear._saved_from_kernel(self, k[e]) for e in range(len(k))]
        return {n: (lambda n=n: torch.stack([p[n]() for p in per])) for n in per[0]}

    def forward(self, x: torch.Tensor, e: int) -> torch.Tensor:  # type: ignore[override]
        """``x`` times expert ``e``'s weight (plus its bias)."""
        b = None if self.bias is None else self.bias[e].to(x.dtype)
        if x.device.type == "cpu" and not _grad(x) and self.kernel() is not None:
            y = self._kernel[e](x)
            return y if b is None else y + b
        return nn.functional.linear(x, self.expert(e)._dequantize(torch.float32).to(x.dtype), b)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, {super().extra_repr()}, bits={self.bits}, group={self.group_size}"
        )


def _grad(x: torch.Tensor) -> bool:
    """Whether a forward records an autograd graph through ``x`` (the kernels then are not used)."""
    return x.requires_grad and torch.is_grad_enabled()


def runs_stacked(m: nn.Module, k) -> bool:
    """Whether ``m``'s forward is exactly ``k(x)`` (+ bias) on a CPU ``x`` without a graph: its kernel is
    the stack's row ``k`` and nothing else acts (no activation quantizer, hook or cached float weight)."""
    return (
        m._kernel is k
        and not m._forward_hooks
        and not m._forward_pre_hooks
        and m.act_quantizer() is None
        and m._wcache is None
        and not m.cache_weight
    )


class PackedRoutedExperts(RoutedExperts):
    """A :class:`RoutedExperts` whose projections run over stacked kernels (module doc); its children --
    the per-expert modules, saved under their own names -- are the original ones."""

    def __init__(self, routed: RoutedExperts, packed: dict[str, PackedExperts]) -> None:
        super().__init__(list(routed), routed.fused_class)
        self.observe_all = routed.observe_all
        self.__dict__["packed"] = packed  # not children: the per-expert modules are the saved form

    def _apply(self, fn, recurse=True):
        self.__dict__["packed"] = {}  # a move or cast drops the experts' kernels: run them one by one
        return super()._apply(fn, recurse)

    def _proj(self, name: str, mlp: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
        m = getattr(mlp, name)
        pe = self.packed.get(name)
        if pe is not None:
            k = pe._kernel[e]
            if runs_stacked(m, k):
                y = k(x)
                return y if m.bias is None else y + m.bias.to(x.dtype)
        return m(x)

    def _expert(self, e: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        mlp = self[e]
        if mlp._forward_hooks or mlp._forward_pre_hooks:
            return mlp(x, w)
        g, u = self._proj("gate_proj", mlp, e, x), self._proj("up_proj", mlp, e, x)
        return self._proj("down_proj", mlp, e, mlp._rule(g, u))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.observe_all or not self.packed or hidden_states.device.type != "cpu" or _grad(hidden_states):
            return super().forward(hidden_states, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden_states)
        k = top_k_index.shape[-1]
        for e, sel in _by_expert(top_k_index.reshape(-1), len(self)):
            tok, pos = sel // k, sel % k
            w = top_k_weights[tok, pos]
            y = self._expert(e, hidden_states[tok], w) * w[:, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def kernel_report(self) -> dict[str, dict]:
        """Per stacked projection: the kernel its experts run (``KERNEL_NAME``, kernels/select.py), the
        number of experts, the stack's bytes, and whether the experts' integer-activation kernels are
        stacked too."""
        out = {}
        for name, pe in self.packed.items():
            first = getattr(self[0], name)
            out[name] = {
                "kernel": pe._kernel.kernel_name(),
                "experts": pe.num_experts,
                "bytes": pe._kernel.nbytes(),
                "int_act": bool(first._int_act),
            }
        return out


def _by_expert(flat: torch.Tensor, n: int):
    """``(expert, positions in flat)`` for every expert below ``n`` that ``flat`` names, ascending, the
    positions ascending (what the stable sort of :meth:`RoutedExperts.forward` gives)."""
    if flat.numel() <= 64:  # decode: a few pairs, grouped without a sort over all experts
        ids = flat.tolist()
        for e in sorted(set(ids)):
            if 0 <= e < n:
                yield e, torch.tensor([i for i, v in enumerate(ids) if v == e], dtype=torch.long)
        return
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n).tolist()
    start = 0
    for e, c in enumerate(counts[:n]):  # indices >= n mask a slot out (transformers' convention)
        if c:
            yield e, order[start : start + c]
            start += c


def _stack_int_act(mods: list[QuantModule]) -> None:
    """Stack the experts' integer-activation kernels (when every one has one) like their weights."""
    if any(m.act_quantizer() is None for m in mods):
        return
    probe = torch.empty(0, mods[0].in_features)
    if all(m.runs_int_act(probe) for m in mods):
        try:
            stack_in_place([m._int_act for m in mods])
        except NotStackable:
            pass  # each expert keeps its own


def _pack(routed: RoutedExperts) -> dict[str, PackedExperts]:
    packed = {}
    for name in PROJECTIONS:
        mods = [getattr(mlp, name, None) for mlp in routed]
        try:
            packed[name] = PackedExperts.from_experts(mods)
        except NotStackable:
            continue
        _stack_int_act(mods)
    return packed


def pack_experts(model: nn.Module) -> int:
    """Replace every :class:`RoutedExperts` of ``model`` whose expert projections are plain ``packed``
    modules of one format on the CPU by a :class:`PackedRoutedExperts` (module doc); the number of
    layers packed.  Generic: called after a layer is quantized and at the end of every load."""
    done = 0
    for name, m in list(model.named_modules()):
        if type(m) is not RoutedExperts or not name:
            continue
        packed = _pack(m)
        if packed:
            model.set_submodule(name, PackedRoutedExperts(m, packed))
            done += 1
    return done


def packed_experts_report(model: nn.Module) -> dict[str, dict]:
    """:meth:`PackedRoutedExperts.kernel_report` of every packed experts module of ``model``, by name."""
    return {n: m.kernel_report() for n, m in model.named_modules() if isinstance(m, PackedRoutedExperts)}
