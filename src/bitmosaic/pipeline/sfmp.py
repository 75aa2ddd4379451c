"""SFMP at model level: the Fisher salience + global allocation step run before calibration, the
exact folding of permutations between neighbouring SFMP linears (gate/up -> down_proj), and the
bits accounting a saved SFMP model records and ``bitmosaic inspect`` shows (issue #12): the target
and the ``b`` reached, the candidate widths, group and block, and bits per weight split into
weights, scales/zeros, permutations and bit map."""

from __future__ import annotations

import torch
from torch import nn

from ..algorithms.sfmp import BlockPlan
from ..models.arch import ArchSpec, get_arch
from ..modules.sfmp import SFMPLinear, fold_permutations
from .fisher import fisher_salience, salience_linear_names

__all__ = [
    "allocate_with_salience", "fold_model_permutations", "sfmp_run_info", "sfmp_saved_info",
    "stored_sfmp_summary", "summarize_sfmp",
]  # fmt: skip


def allocate_with_salience(model, calib, method, config, arch: ArchSpec, *, salience=None,
                           salience_tokens=None, progress=True, calib_cache=None) -> dict:  # fmt: skip
    """Fisher salience of every decoder linear on the *float* model (before any AWQ scaling; from
    ``salience`` when given, else from ``salience_tokens`` or ``calib``, the first
    ``config.fisher_samples`` samples), then the method's global ``allocate``.  Returns the summary
    (with ``fisher``: cost in seconds, samples, cache key).  The salience is cached where
    ``config.fisher_cache`` says; when that is ``"auto"`` and ``calib_cache``
    (:class:`~bitmosaic.pipeline.calib_cache.CalibCache`) is given, in that cache (or nowhere when it
    is off)."""
    names = salience_linear_names(model, arch)
    info: dict = {"given": True}
    if salience is None:
        tokens = calib if salience_tokens is None else salience_tokens
        n = getattr(config, "fisher_samples", None)
        if n is not None:
            if n > tokens.shape[0]:
                raise ValueError(
                    f"fisher_samples={n} but only {tokens.shape[0]} calibration samples were given; "
                    "pass more samples (--nsamples) or salience_tokens"
                )
            tokens = tokens[:n]
        where = getattr(config, "fisher_cache", "auto")
        if where == "auto" and calib_cache is not None:
            where = calib_cache
        salience, info = fisher_salience(model, tokens, names, cache_dir=where, progress=progress)
    missing = [n for n in names if n not in salience]
    if missing:
        raise ValueError(f"the salience lacks {len(missing)} linears, e.g. {missing[0]}")
    for n in names:
        want = tuple(model.get_submodule(n).weight.shape)
        if tuple(salience[n].shape) != want:
            raise ValueError(
                f"the salience of {n} is {tuple(salience[n].shape)}, its weight {want}: pass one "
                "[out, in] tensor per linear (e.g. from bitmosaic.pipeline.fisher.fisher_salience)"
            )
    summary = method.allocate({n: salience[n] for n in names}, config)
    summary["fisher"] = info
    return summary


def fold_model_permutations(model: nn.Module, arch: ArchSpec | None = None) -> int:
    """Fold gate/up's output un-permutation and down_proj's input gather into one gather per
    producer, in every decoder layer where all three are SFMP linears (exact).  Returns how many
    layers were folded.  Only the MLP: q/k/v must be un-permuted before RoPE and the heads, and the
    attention output mixes v's channels per head."""
    arch = arch or get_arch(model)
    if arch.smooth_prev is None or len(arch.sequential) < 2:
        return 0
    producers, consumer = arch.sequential[-2], arch.sequential[-1]
    if len(consumer) != 1 or arch.smooth_prev[-1] not in producers:
        return 0
    folded = 0
    for layer in arch.layers(model):
        mods = [layer.get_submodule(n) for n in (*producers, consumer[0])]
        if all(isinstance(m, SFMPLinear) for m in mods):
            folded += fold_permutations(mods[:-1], mods[-1])
    return folded


@torch.no_grad()
def permutation_report(model: nn.Module) -> dict[str, dict]:
    """Per SFMP linear: average code bits and the bits-per-weight breakdown."""
    return {
        n: {"code_bits": m.code_bits(), **m.bits_breakdown()}
        for n, m in model.named_modules()
        if isinstance(m, SFMPLinear)
    }


# -- what a saved SFMP model records and what ``inspect`` shows (issue #12: the bits accounting) --

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


def summarize_sfmp(records: dict[str, dict]) -> dict:
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


def _module_record(m: SFMPLinear) -> dict:
    return _layer_record(m.layer_config(), m.bit_map, m.part_bits())


def sfmp_run_info(report) -> dict:
    """What an SFMP run *asked for and planned* (from its :class:`RunReport`): the budget given
    (``avg_bits`` / ``bpw`` / ``budget_mb``), the target ``b`` it gave, the measured overhead, the
    candidate widths ``floor(b)``/``ceil(b)``, the configured group and block, the reordering, solver,
    rank and the Fisher salience's cost.  ``{}`` for a run without a global allocation."""
    alloc = report.calibration.get("allocation")
    if not alloc:
        return {}
    cfg = report.config
    keys = ("avg_bits", "bpw", "budget_mb")
    fisher = {k: alloc.get("fisher", {}).get(k) for k in ("seconds", "samples", "cached", "given")}
    return {
        "budget": {k: cfg.get(k) for k in keys if cfg.get(k) is not None},
        "b_target": alloc["b"],
        "bpw_target": alloc["bpw_target"],
        "overhead_bpw": alloc["overhead_bpw"],
        "candidate_widths": sorted({alloc["low"], alloc["high"]}),
        "b_planned": alloc["b_reached"],
        "group_size": cfg.get("group_size"),
        "block": [cfg.get("block_rows"), cfg.get("block_cols") or cfg.get("group_size")],
        **{k: cfg.get(k) for k in ("row_reorder", "col_reorder", "solver", "rank")},
        "fisher": {k: v for k, v in fisher.items() if v is not None},
    }


def sfmp_saved_info(model: nn.Module, run: dict | None = None) -> dict:
    """The ``quantization_config`` fields of a model holding SFMP linears (``{}`` when it holds none):
    ``bits`` is ``None`` (there is no single width) and ``sfmp`` records what SFMP used: ``run``
    (:func:`sfmp_run_info`) updated with what the modules themselves hold (:func:`summarize_sfmp`:
    ``b_reached``, bits per weight by part, widths, groups, blocks)."""
    recs = {n: _module_record(m) for n, m in model.named_modules() if isinstance(m, SFMPLinear)}
    if not recs:
        return {}
    measured = summarize_sfmp(recs)
    measured.pop("per_linear_b")  # per layer: derivable from the saved bit maps
    return {"bits": None, "sfmp": {**(run or {}), **measured}}


def stored_sfmp_summary(path, modules: dict) -> dict | None:
    """:func:`summarize_sfmp` of the SFMP linears of a saved folder (``modules``: its per-layer table),
    read from the safetensors headers and the (small) bit maps; ``None`` when it has none.  Works for
    saves made before ``sfmp_saved_info`` existed."""
    from pathlib import Path

    from safetensors import SafetensorError, safe_open

    from ..errors import CorruptModelError
    from ..io.serialization import _dtype_bits

    names = {n for n, lc in modules.items() if lc.get("kind") == "sfmp"}
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
                    bits[mod][part] = bits[mod].get(part, 0) + n * _dtype_bits(sl.get_dtype())
                    if leaf == "bit_map":
                        maps[mod] = st.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise CorruptModelError(f"weights file {f} cannot be read ({e}); save the model again") from None
    lacking = sorted(names - set(maps))
    if lacking:
        raise CorruptModelError(f"{path}: SFMP layer {lacking[0]} has no saved bit_map; save the model again")
    return summarize_sfmp({n: _layer_record(modules[n], maps[n], bits[n]) for n in sorted(names)})
