"""SQ-format benchmark parts a4group (issue 25), a4paper and abits (issue 73), and the W(SQ) model
cache they share with ``sq_format.py`` (their own file to keep the benchmark under 500 lines).  ``b``
is ``sq_format.SQBench``."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from benchmarks.harness import write_text
from bitmosaic.formats.sq import parse_sq, weight_name
from bitmosaic.io import load_quantized, save_quantized

CACHE = Path("/tmp/bitmosaic_sq_bench")


def model_tag(args) -> str:
    """The model's part of a cached model's name ("" for SmolLM2, the default: its old names stay)."""
    return "" if args.model == "smollm2-135m" else "_" + re.sub(r"[^\w.-]+", "-", args.model)


W_SQ = {"W(SQ6)": "32-(8/4)-0.75", "W(SQ5)": "64-(8/4)-0.875", "W(SQ4.5)": "64-(8/4)-0.9375"}
A4_GROUPS = (64, 128)  # group-wise A4 (issue 25): per token, one INT4 scale per G channels


# Algorithm 1's mask forms (issue 73): ours by default (OBS saliency, masks chosen lazily per bank from
# the GPTQ-updated weights); "paper": I = W'^2 / diag(H^-1)^2 with every mask fixed before GPTQ starts
W_MASKS = {"obs-lazy": {}, "paper": {"importance": "paper", "mask_timing": "upfront"}}


def _sq_weights(b, sq: str, cache: bool = False, **opts):
    """A W(SQ) model calibrated on 16-bit activations; ``cache``: kept on disk between commands
    (one copy per ``opts``: the paper's mask form is another model)."""
    a = b.args
    tag = "".join(f"_{k}-{v}" for k, v in sorted(opts.items()))
    path = CACHE / f"sqw_{sq}_{a.nsamples}x{a.seqlen}_s{a.seed}{tag}{model_tag(a)}"
    info_path = path / "bench_info.json"
    if cache and info_path.exists():
        return load_quantized(path, load_tokenizer=False)[0].float().eval(), json.loads(info_path.read_text())
    t = time.perf_counter()
    model, rep = b.quantize("sq-weights", sq=sq, **opts)
    loss = sum(r["hessian_error"] for r in rep.layers if r.get("hessian_error") is not None)
    info = {"calib_hessian_error": loss, "quant_seconds": round(time.perf_counter() - t, 1)}
    if cache:
        save_quantized(model, path, {"method": "sq-weights", "sq": sq, **opts})
        write_text(info_path, json.dumps(info))
    return model, info


W_SQ_BANKS = ("16-(8/4)-0.875",)  # the bank swept at s = 0.875 against W(SQ5)'s 64 (A4 groups apart)


def part_a4group(b) -> None:
    """Issue 25: W4A4 and W(SQ)A4 with A4 per token and group of 64 / 128 channels (the W(SQ)
    bank swept separately: 16 and 64 at s = 0.875).  W(SQ) models are cached on disk."""
    for g in A4_GROUPS:
        name = f"W4A4 a4-g{g}"
        if b.wants(name):
            b.row("a4group", name, b.with_acts(b.base(), 4, g), "4/4")
    for sq in (*W_SQ.values(), *W_SQ_BANKS):
        fmt = parse_sq(sq)
        names = {g: f"{weight_name(fmt, 4)} {sq} a4-g{g}" for g in A4_GROUPS}
        if not any(b.wants(n) for n in names.values()):
            continue
        model, info = _sq_weights(b, sq, cache=True)
        for g, name in names.items():
            b.row("a4group", name, b.with_acts(model, 4, g), fmt.paper_weight_bits, **info)
        del model


INT_A_BITS = (5, 6, 7)  # the INT activation widths between A4 and A8 (issue 73: bits-matched baselines)


def part_abits(b) -> None:
    """Issue 73: W4A5, W4A6, W4A7 (per token, and A5/A6 per group of 128 channels) on the shared W4
    weights: the INT rows an SQ activation row is compared with at equal activation bits (scales
    counted), where W4A4 and W4A8 alone would leave the bits between them interpolated."""
    runs = [(ab, None) for ab in INT_A_BITS] + [(ab, 128) for ab in INT_A_BITS[:2]]
    for ab, g in runs:
        name = f"W4A{ab}" + (f" a{ab}-g{g}" if g else "")
        if b.wants(name):
            b.row("abits", name, b.with_acts(b.base(), ab, g), f"4/{ab}")


def part_a4paper(b) -> None:
    """Issue 73: the W(SQ)A4 rows of part a4group with Algorithm 1 as printed (``--importance paper
    --mask-timing upfront``: masks fixed up front from ``I = W'^2 / diag(H^-1)^2``), named
    ``... mask=paper``; part a4group's rows (OBS saliency, lazy masks: our default) are ours."""
    opts = W_MASKS["paper"]
    for sq in W_SQ.values():
        fmt = parse_sq(sq)
        names = {g: f"{weight_name(fmt, 4)} {sq} a4-g{g} mask=paper" for g in A4_GROUPS}
        if not any(b.wants(n) for n in names.values()):
            continue
        model, info = _sq_weights(b, sq, cache=True, **opts)
        for g, name in names.items():
            b.row("a4paper", name, b.with_acts(model, 4, g), fmt.paper_weight_bits, **info, **opts)
        del model
