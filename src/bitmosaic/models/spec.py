"""The layer-map types (:class:`ArchSpec`, :class:`RotationMap`); the maps themselves and what their
fields mean are in :mod:`bitmosaic.models.arch` (dense and multimodal) and :mod:`bitmosaic.models.moe`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["ArchSpec", "RotationMap", "LLAMA_ROTATION", "UnknownArchitectureError"]


class UnknownArchitectureError(ValueError):
    pass


@dataclass(frozen=True)
class RotationMap:
    """Where a residual-stream rotation R1, the per-head value/output rotation R2 and the online
    Hadamards go (names relative to the model, or to a decoder layer for ``norms`` ... ``online``)."""

    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    head: str = "lm_head"
    # (pre-norm, the linears reading its output): its scale is folded into them, then R1 on their inputs
    norms: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    )
    writers: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")  # R1ᵀ on their outputs
    value: str | None = "self_attn.v_proj"  # R2 per head on its output rows ...
    value_tail: bool = False  # ... only its last kv_heads·head_dim rows (a fused q|k|v projection)
    attn_out: str | None = "self_attn.o_proj"  # ... and on these input columns
    # an online Hadamard at the input: QuaRot's down_proj and, across the heads, o_proj (Sec. 4, step 1c)
    online: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")
    refuse: str | None = None  # why this architecture cannot be rotated (None: it can)
    # names a layer may lack (a dense layer's MLP, an MoE layer's router or shared expert); any name in
    # ``norms``/``writers``/``online`` may be an experts wildcard ``mlp.experts.*.down_proj``
    optional: tuple[str, ...] = ()
    # (config attribute, why): refused when the model's config sets it (not None / False)
    refuse_when: tuple[tuple[str, str], ...] = ()

    def layer_norms(self, layer: nn.Module) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """``norms`` for one decoder layer, each reader list expanded as :meth:`ArchSpec.groups` does."""
        return tuple((norm, self._names(layer, readers)) for norm, readers in self.norms)

    def layer_writers(self, layer: nn.Module) -> tuple[str, ...]:
        return self._names(layer, self.writers)

    def layer_online(self, layer: nn.Module) -> tuple[str, ...]:
        return self._names(layer, self.online)

    def _names(self, layer: nn.Module, names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(n for name in names for n in _expand(layer, name, name in self.optional))


LLAMA_ROTATION = RotationMap()


@dataclass(frozen=True)
class ArchSpec:
    layers_path: str
    sequential: tuple[tuple[str, ...], ...]
    skipped: tuple[str, ...] = ("lm_head", "embed_tokens")
    smooth_prev: tuple[str | None, ...] | None = None
    norm_offset: float = 0.0
    rotation: RotationMap | None = LLAMA_ROTATION

    # names a layer may lack (e.g. a dense MLP in a mixture-of-experts model's first layers)
    optional: tuple[str, ...] = ()

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.layers_path)

    def linear_names(self) -> list[str]:
        """The map's names (an experts wildcard ``mlp.experts.*.down_proj`` unexpanded)."""
        return [name for group in self.sequential for name in group]

    def groups(self, layer: nn.Module) -> tuple[tuple[str, ...], ...]:
        """``sequential`` for one decoder layer: a ``*`` stands for each index of the module list
        before it (the experts of a :class:`~bitmosaic.modules.experts.RoutedExperts`), and names the
        layer lacks are dropped when they are ``optional`` or expert wildcards (a group may then be
        empty; the indices stay those of ``sequential``)."""
        return tuple(tuple(n for name in group for n in _expand(layer, name, name in self.optional))
                     for group in self.sequential)  # fmt: skip

    def expert_group(self, index: int) -> bool:
        """Whether group ``index`` holds expert projections (a ``*`` name)."""
        return any("*" in name for name in self.sequential[index])

    def layer_linear_names(self, layer: nn.Module) -> list[str]:
        return [name for group in self.groups(layer) for name in group]


def _expand(layer: nn.Module, name: str, optional: bool) -> list[str]:
    if "*" not in name:
        if optional and not _has(layer, name):
            return []
        return [name]
    head, tail = name.split(".*.", 1)
    if not _has(layer, head):
        return []
    container = layer.get_submodule(head)
    if not isinstance(container, nn.ModuleList):
        raise UnknownArchitectureError(
            f"{head} is not a list of experts ({type(container).__name__}); unfuse the experts first "
            "(bitmosaic.modules.experts.unfuse_experts(model))"
        )
    return [f"{head}.{i}.{tail}" for i in range(len(container))]


def _has(layer: nn.Module, name: str) -> bool:
    try:
        layer.get_submodule(name)
    except AttributeError:
        return False
    return True
