"""What the SFMP kind means at model level: the exact folding of permutations between neighbouring
SFMP linears (gate/up -> down_proj) after a run or a load, and the bits accounting a saved SFMP model
records and ``bitmosaic inspect`` shows: the ``b`` reached, the widths, group and block, and bits
per weight split into weights, scales/zeros, permutations and bit map (SFMP §4.3-4.5)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..algorithms.sfmp import BlockPlan
from ..errors import CorruptModelError
from ..formats.accounting import dtype_name_bits

__all__ = ["fold_permutations", "fold_model_permutations", "saved_summary", "stored_summary", "summarize"]


def fold_model_permutations(model: nn.Module, arch) -> int:
    """Fold gate/up's output un-permutation and down_proj's input gather into one gather per
    producer, in every decoder layer where all three are SFMP linears (exact).  Returns how many
    layers were folded.  Only the MLP: q/k/v must be un-permuted before RoPE and the heads, and the
    attention output mixes v's channels per head.  ``arch``: the model's architecture map."""
    if arch is None or arch.smooth_prev is None or len(arch.sequential) < 2:
        return 0
    folded = 0
    for layer in arch.layers(model):
        producers, consumer = arch.groups(layer)[-2:]
        if len(consumer) != 1 or arch.smooth_prev[-1] not in producers:
            continue  # e.g. a layer's experts: many down projections
        mods = [layer.get_submodule(n) for n in (*producers, consumer[0])]
        if all(getattr(m, "kind", None) == KIND for m in mods):
            folded += fold_permutations(mods[:-1], mods[-1])
    return folded


KIND = "sfmp"  # the kind of modules/sfmp.py's SFMPLinear (which imports this file, not the reverse)


def fold_permutations(producers: list, consumer) -> bool:
    """Let ``producers`` (gate/up) emit their outputs in ``consumer``'s (down_proj's) column order,
    so ``consumer`` skips its input gather: ``y_p[..., inv(row_perm_p)][..., col_perm_c]`` is one
    gather ``y_p[..., inv(row_perm_p)[col_perm_c]]``.  Exact (pure index composition).  Returns
    whether anything was folded (nothing when the consumer keeps its natural column order)."""
    if consumer.col_perm is None or not consumer._gather_input:
        return False
    if getattr(consumer, "input_rotation", None) is not None:  # rotated online between the two: no fold
        return False
    cp = consumer.col_perm.long()
    for p in producers:  # the kernels (of W̃) stay valid: they read the gathers at call time
        p._emit, p._out_index, p._wcache = cp, None, None
    consumer._gather_input, consumer._wcache = False, None
    return True


PARTS = ("weights", "scales_zeros", "permutations", "bit_map")
_PART_OF = {
    "qweight": "weights", "scales": "scales_zeros", "zeros": "scales_zeros",
    "row_perm": "permutations", "col_perm": "permutations", "bit_map": "bit_map",
}  # fmt: skip


def _layer_record(lc: dict, bit_map: torch.Tensor, part_bits: dict[str, int]) -> dict:
    """One SFMP linear from its per-layer config (geometry), bit map and stored bits per part."""
    N, K = int(lc["out_features"]), int(lc["in_features"])
    plan = BlockPlan(N, K, int(lc["block_rows"]), int(lc["block_cols"]), int(lc["group_size"]), None, None,
                     bit_map)  # fmt: skip
    return {
        "weights": N * K,
        "code_bits": plan.average_bits(),
        "widths": {int(v) for v in bit_map.unique().tolist()},
        "group_size": int(lc["group_size"]),
        "block": f"{int(lc['block_rows'])}x{int(lc['block_cols'])}",
        "parts": {p: part_bits.get(p, 0) for p in PARTS},
    }


def summarize(records: dict[str, dict]) -> dict:
    """Totals over SFMP linears (``name -> _layer_record``): ``b_reached`` (average code bits, the
    paper's ``b``), bits per weight by part and in all, the widths present, group sizes, block shapes
    and each linear's ``b``."""
    n = sum(r["weights"] for r in records.values())
    parts = {p: sum(r["parts"][p] for r in records.values()) / n for p in PARTS}
    return {
        "linears": len(records),
        "b_reached": sum(r["code_bits"] * r["weights"] for r in records.values()) / n,
        "bits_per_weight": sum(parts.values()),
        "bits_per_weight_parts": parts,
        "widths_used": sorted(set().union(*(r["widths"] for r in records.values()))),
        "group_sizes": sorted({r["group_size"] for r in records.values()}),
        "block_shapes": sorted({r["block"] for r in records.values()}),
        "per_linear_b": {name: r["code_bits"] for name, r in records.items()},
    }


def saved_summary(model: nn.Module, run: dict | None = None) -> dict:
    """The ``quantization_config`` fields of a model holding SFMP linears (``{}`` when it holds none):
    ``bits`` is ``None`` (there is no single width) and ``sfmp`` records what SFMP used: ``run`` (what
    the run asked for and planned) updated with what the modules themselves hold (:func:`summarize`:
    ``b_reached``, bits per weight by part, widths, groups, blocks)."""
    recs = {
        n: _layer_record(m.layer_config(), m.bit_map, m.part_bits())
        for n, m in model.named_modules()
        if getattr(m, "kind", None) == KIND
    }
    if not recs:
        return {}
    measured = summarize(recs)
    measured.pop("per_linear_b")  # per layer: derivable from the saved bit maps
    return {"bits": None, "sfmp": {**(run or {}), **measured}}


def stored_summary(path, modules: dict) -> dict | None:
    """:func:`summarize` of the SFMP linears of a saved folder (``modules``: its per-layer table), read
    from the safetensors headers and the (small) bit maps; ``None`` when it has none."""
    from safetensors import SafetensorError, safe_open

    names = {n for n, lc in modules.items() if lc.get("kind") == KIND}
    if not names:
        return None
    bits: dict[str, dict[str, int]] = {n: {} for n in names}
    maps: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as st:
                for key in st.keys():
                    mod, _, leaf = key.rpartition(".")
                    if mod not in names or leaf not in _PART_OF:
                        continue
                    sl = st.get_slice(key)
                    n = 1
                    for d in sl.get_shape():
                        n *= d
                    part = _PART_OF[leaf]
                    bits[mod][part] = bits[mod].get(part, 0) + n * dtype_name_bits(sl.get_dtype())
                    if leaf == "bit_map":
                        maps[mod] = st.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise CorruptModelError(f"weights file {f} cannot be read ({e}); save the model again") from None
    lacking = sorted(names - set(maps))
    if lacking:
        raise CorruptModelError(f"{path}: SFMP layer {lacking[0]} has no saved bit_map; save the model again")
    return summarize({n: _layer_record(modules[n], maps[n], bits[n]) for n in sorted(names)})
