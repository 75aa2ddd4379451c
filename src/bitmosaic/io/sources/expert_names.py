"""Where a checkpoint keeps the tensors of an unfused mixture-of-experts layer (issue 71, item 4).

A streamed run builds the model on ``meta`` and unfuses its experts
(:func:`~bitmosaic.modules.experts.unfuse_experts`) before reading anything, so each decoder layer asks
for ``mlp.experts.<e>.gate_proj.weight`` and the like.  Checkpoints in the wild store them in one of
three ways, and :func:`expert_source` says which tensor (and which part of it) holds a wanted one:

* the hub's per-expert tensors, named as asked (Qwen-MoE, OLMoE, DeepSeek): read directly;
* Mixtral's hub names: ``block_sparse_moe.experts.<e>.w1`` (gate), ``w3`` (up), ``w2`` (down) and the
  router ``block_sparse_moe.gate`` (transformers' own renaming, ``conversion_mapping.py``);
* transformers 5's fused tensors ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows first, then up)
  and ``mlp.experts.down_proj`` ``[E, H, I]``: expert ``e``'s rows are read through the memory map's
  slice (``safe_open(...).get_slice``), so the 3-D tensor of all experts is never materialised;
* gpt-oss's fused tensors, whose layout its experts class declares (transformers'
  ``use_experts_implementation(is_concatenated=False, is_transposed=True, has_bias=True)``, read off the
  model by :func:`fused_layouts`): ``gate_up_proj`` ``[E, H, 2I]`` with gate and up *interleaved* along the
  last dimension (gate ``[..., 0::2]``, up ``[..., 1::2]``), ``gate_up_proj_bias`` ``[E, 2I]`` interleaved
  alike, ``down_proj`` ``[E, I, H]``, ``down_proj_bias`` ``[E, H]``: expert ``e``'s ``[H, 2I]`` is read,
  transposed, and its gate or up rows taken; or the hub's MXFP4 form of the same weights,
  ``gate_up_proj_blocks`` ``[E, 2I, H/32, 16]`` (two FP4 E2M1 codes a byte, low nibble first) with
  ``gate_up_proj_scales`` ``[E, 2I, H/32]`` (E8M0) and ``down_proj_blocks`` ``[E, H, I/32, 16]``: rows are
  the output features (the transpose of the bf16 layout, as transformers' ``convert_moe_packed_tensors``
  decodes them), so only expert ``e``'s gate (even) or up (odd) rows are read, then decoded exactly.

Any other fused layout (experts without a gate, FP8 fused experts) is refused in one line by the reader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ExpertSource", "FusedLayout", "expert_source", "fused_layouts"]

_EXPERT = re.compile(r"^(?P<pre>.*)\.mlp\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                     r"\.(?P<kind>weight|bias)$")  # fmt: skip
_ROUTER = re.compile(r"^(?P<pre>.*)\.mlp\.gate\.(?P<kind>weight|bias)$")
_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


@dataclass(frozen=True)
class FusedLayout:
    """How a fused-experts class stores its 3-D parameters: ``transposed`` ``[E, in, out]`` (``x @ W``)
    rather than ``[E, out, in]``, and gate/up ``interleaved`` along the output features rather than
    concatenated (transformers' ``is_transposed`` and ``not is_concatenated``)."""

    transposed: bool = False
    interleaved: bool = False


@dataclass(frozen=True)
class ExpertSource:
    """Tensor ``name`` of the checkpoint; with ``index``, its ``[index]`` slice, ``transposed`` when
    stored ``[in, out]``; with ``half`` (0 gate, 1 up), that projection's output features of it: the
    first or second half, or with ``interleaved`` the even or odd ones.  With ``scales``, ``name`` holds
    MXFP4 blocks (rows the output features) and ``scales`` their E8M0 exponents."""

    name: str
    index: int | None = None
    half: int | None = None
    transposed: bool = False
    interleaved: bool = False
    scales: str | None = None


def fused_layouts(model) -> dict[str, FusedLayout]:
    """The layout of each fused-experts module of ``model`` (before unfusing; on ``meta`` is fine), by
    module name, from the attributes transformers' experts decorator sets on it."""
    from ...modules.experts import is_fused_experts

    return {
        name: FusedLayout(bool(getattr(m, "is_transposed", False)), not getattr(m, "is_concatenated", True))
        for name, m in model.named_modules()
        if is_fused_experts(m)
    }


def _layout(layouts: dict[str, FusedLayout] | None, experts: str) -> FusedLayout:
    """The layout of module ``experts``; a name the model does not have: the model's one layout, if one."""
    layouts = layouts or {}
    if experts in layouts:
        return layouts[experts]
    kinds = set(layouts.values())
    return kinds.pop() if len(kinds) == 1 else FusedLayout()


def expert_source(key: str, stored, layouts: dict[str, FusedLayout] | None = None) -> ExpertSource | None:
    """Where ``stored`` (the checkpoint's tensor names) holds the tensor a model names ``key`` (module
    doc), or ``None`` when it holds no such tensor under another name; ``layouts``: the model's fused
    layouts (:func:`fused_layouts`; none: transformers' default ``[E, 2I, H]``, concatenated)."""
    m = _ROUTER.match(key)
    if m is not None:
        alt = f"{m['pre']}.block_sparse_moe.gate.{m['kind']}"
        return ExpertSource(alt) if alt in stored else None
    m = _EXPERT.match(key)
    if m is None:
        return None
    pre, e, proj, kind = m["pre"], int(m["e"]), m["proj"], m["kind"]
    alt = f"{pre}.block_sparse_moe.experts.{e}.{_MIXTRAL[proj]}.{kind}"
    if alt in stored:
        return ExpertSource(alt)
    lay = _layout(layouts, f"{pre}.mlp.experts")
    fused = f"{pre}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
    half = None if proj == "down_proj" else int(proj == "up_proj")
    if kind == "bias":  # [E, out]: one expert's is a vector, never transposed
        fused += "_bias"
        return ExpertSource(fused, e, half, interleaved=lay.interleaved) if fused in stored else None
    if fused in stored:
        return ExpertSource(fused, e, half, lay.transposed, lay.interleaved)
    blocks, scales = fused + "_blocks", fused + "_scales"
    if blocks in stored and scales in stored:  # MXFP4: rows are the output features (the bf16 layout's T)
        return ExpertSource(blocks, e, half, not lay.transposed, lay.interleaved, scales)
    return None
