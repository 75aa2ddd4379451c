"""SFMP's decode cost of reordering (issue #12; the paper reports at most 5%): ``python -m
benchmarks.sfmp.sfmp --parts decode`` runs :func:`part_decode`, which writes ``sfmp_decode.json``/``.md``
and nothing else.

Run: flock /tmp/bitmosaic-heavy.lock python -m benchmarks.sfmp.sfmp --parts decode --decode-point 3.0 \\
       --threads 1
"""

from __future__ import annotations

import copy
import json
import time

from benchmarks.harness import RESULTS, write_text
from bitmosaic.data import calibration_samples
from bitmosaic.methods import get_method
from bitmosaic.pipeline import RunSettings, quantize_model


def _decode_rate(model, prompt, new_tokens: int) -> float:
    """Greedy decode tokens/s at batch 1: the new tokens after the first (whose time includes the
    prompt's prefill) over their wall time, stamped by a logits processor (called once per token)."""
    import torch

    stamps: list[float] = []

    def clock(input_ids, scores):
        stamps.append(time.perf_counter())
        return scores

    with torch.inference_mode():
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, logits_processor=[clock], pad_token_id=0,
        )  # fmt: skip
    if out.shape[1] - prompt.shape[1] != new_tokens or len(stamps) != new_tokens:
        raise RuntimeError(f"generated {out.shape[1] - prompt.shape[1]} tokens, asked for {new_tokens}")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def decode_reorder_cost(
    model, calib, prompt, salience, *, bpw, group_size, new_tokens=64, repeats=7, progress=False
) -> dict:
    """Greedy decode speed of SFMP with reordering (rows and columns, gate/up folded into down_proj)
    against no reordering (``--no-row-reorder --no-col-reorder``), both built here from ``model`` with
    the same Fisher ``salience`` and timed in this process, interleaved (A B B A ...), median of
    ``repeats``.  The reordered model gets ``bpw``; the other the same average code bits ``b`` (so
    the two differ only by the permutations, not by how many blocks are wide).  The blocks are cheap
    min-max ones (``n_grid=1``, no clip search): decode speed does not depend on the codes' values,
    only on the widths, so the blocks' quality does not matter here (perplexity is measured by the
    other parts)."""
    import statistics

    from bitmosaic.modules.base import prepare_kernels, resident_bytes

    spec = get_method("sfmp")
    cheap = {"group_size": group_size, "n_grid": 1, "clip_search": False, "fisher_cache": None}
    runs, b = {}, None
    for name, extra in (
        ("reorder", {"bpw": bpw}),
        ("no-reorder", {"row_reorder": False, "col_reorder": False}),
    ):
        if b is not None:
            extra["avg_bits"] = b
        m = copy.deepcopy(model)
        cfg = spec.make_config(**cheap, **extra)
        settings = RunSettings(progress=progress)
        rep = quantize_model(m, calib, spec, cfg, settings, inputs={"salience": salience})
        alloc = rep.calibration["allocation"]
        b = alloc["b"] if b is None else b
        prepare_kernels(m)
        _decode_rate(m, prompt, 4)  # warm-up: kernels, caches
        runs[name] = {
            "model": m, "bits_per_weight": rep.bits_per_weight, "b_target": alloc["b"],
            "b_reached": alloc["b_reached"], "permutations_folded": rep.calibration["permutations_folded"],
            "resident_mb": resident_bytes(m) / 2**20, "rates": [],
        }  # fmt: skip
    names = list(runs)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            runs[name]["rates"].append(_decode_rate(runs[name]["model"], prompt, new_tokens))
            if progress:
                print(f"  repeat {r + 1}/{repeats} {name}: {runs[name]['rates'][-1]:.2f} tok/s", flush=True)
    for v in runs.values():
        del v["model"]
        v["tok_s"] = statistics.median(v["rates"])
    ratio = runs["reorder"]["tok_s"] / runs["no-reorder"]["tok_s"]
    return {"variants": runs, "ratio_reorder_vs_none": ratio, "decode_cost_pct": 100 * (1 - ratio)}


def part_decode(a) -> None:
    """SmolLM2-135M at one point: the reorder / no-reorder decode speed, to ``sfmp_decode.{json,md}``."""
    import torch

    from bitmosaic.io import load_model
    from bitmosaic.pipeline.fisher import fisher_salience, salience_linear_names

    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = load_model(a.model, dtype=torch.float32)
    calib = calibration_samples(tok, "wikitext2", a.nsamples, a.seqlen, a.seed, data_dir=a.data_dir)
    sal, finfo = fisher_salience(model, calib, salience_linear_names(model), cache_dir="auto")
    prompt = calib[:1, : a.prompt_tokens]
    bpw, group = float(a.decode_point), a.decode_group
    res = decode_reorder_cost(
        model, calib, prompt, sal, bpw=bpw, group_size=group, new_tokens=a.new_tokens, repeats=a.repeats,
        progress=True,
    )  # fmt: skip
    res.update(
        model=a.model, point=a.decode_point, group_size=group, prompt_tokens=prompt.shape[1],
        new_tokens=a.new_tokens, repeats=a.repeats, threads=torch.get_num_threads(), fisher=finfo,
    )  # fmt: skip
    lines = [
        f"## Decode cost of reordering (SFMP, {a.model}, BPW {bpw:g}, g{group}, batch 1, "
        f"{prompt.shape[1]}-token prompt + {a.new_tokens} new tokens, {res['threads']} thread(s), "
        f"median of {a.repeats})",
        "",
        "| variant | bpw | b reached | MLP folds | resident MB | decode tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, v in res["variants"].items():
        lines.append(
            f"| {name} | {v['bits_per_weight']:.3f} | {v['b_reached']:.3f} | {v['permutations_folded']} "
            f"| {v['resident_mb']:.1f} | {v['tok_s']:.2f} |"
        )
    lines += [
        "",
        f"Reorder / no-reorder decode speed: {res['ratio_reorder_vs_none']:.3f} "
        f"(cost {res['decode_cost_pct']:.1f}%; the paper reports at most 5%).  Blocks are min-max "
        "(n_grid=1, no clip search): speed depends on the widths, not on the codes.",
    ]
    md = "\n".join(lines) + "\n"
    print(md)
    write_text(RESULTS / "sfmp_decode.md", md)
    write_text(RESULTS / "sfmp_decode.json", json.dumps({"benchmark": "sfmp_decode", **res}, indent=2))


