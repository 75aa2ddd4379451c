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
  slice (``safe_open(...).get_slice``), so the 3-D tensor of all experts is never materialised.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ExpertSource", "expert_source"]

_EXPERT = re.compile(r"^(?P<pre>.*)\.mlp\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                     r"\.(?P<kind>weight|bias)$")  # fmt: skip
_ROUTER = re.compile(r"^(?P<pre>.*)\.mlp\.gate\.(?P<kind>weight|bias)$")
_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


@dataclass(frozen=True)
class ExpertSource:
    """Tensor ``name`` of the checkpoint; with ``index``, its ``[index]`` slice; with ``half`` (0 or 1),
    the first or second half of that slice's rows."""

    name: str
    index: int | None = None
    half: int | None = None


def expert_source(key: str, stored) -> ExpertSource | None:
    """Where ``stored`` (the checkpoint's tensor names) holds the tensor a model names ``key`` (module
    doc), or ``None`` when it holds no such tensor under another name."""
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
    fused = f"{pre}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
    fused += "_bias" if kind == "bias" else ""
    if fused not in stored:
        return None
    return ExpertSource(fused, e, None if proj == "down_proj" else int(proj == "up_proj"))
