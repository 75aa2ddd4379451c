"""Microscaling formats at 4 and 8 bits on SmolLM2-135M (issue 75): which 4-bit file is better -- INT4 g32,
INT4 g16, MXFP4 or NVFP4 -- with RTN or GPTQ, weight-only (A16) or with 4-bit activations of the same
format (A4), without a rotation, with QuaRot's global Hadamard (``--rotate hadamard``) or with the block
Hadamard of the scale block (``--rotate block``); and FP8 block / MXFP8 W8A8 against INT8 W8A8.

Weights: RTN and GPTQ (act-order, static groups) with MSE-searched scales; MXFP4/NVFP4/MXFP8/FP8-block
scales are searched in their own encoding (E8M0, E4M3 over the FP32 tensor scale, FP32), the INT grids
are symmetric with fp16 group scales.  Activations (A4, dynamic): INT4 per token-group of the weights'
group (32 / 16); MXFP4 E2M1 with an E8M0 scale per 32; NVFP4 E2M1 with an E4M3 scale per 16 over a
*calibrated* FP32 tensor scale (llm-compressor's choice).  W8A8: FP8 block's inputs E4M3 per token-group
of 128 (dynamic), MXFP8's E4M3 with E8M0 per 32, INT8 per-token dynamic over per-channel INT8 weights.
``bits/weight`` counts every stored bit of the linears (elements and scales).

Rows accumulate in ``benchmarks/results/microscaling.json`` (a row already there is skipped unless
``--redo``), so the table is built over several short runs (``--only NAME,NAME``, ``--budget-min M``);
the Markdown is rewritten from every row each time.  Rows of another protocol go to another file
(``--json``).  Run: python -m benchmarks.microscaling --protocol fast [--only ...] [--budget-min 4]
(``--protocol verdict``: 128x512 calibration, every test window).
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.harness import RESULTS, Bench, base_parser, protocol_label, write_results
from bitmosaic.eval.bootstrap import bootstrap_ratio
from bitmosaic.formats.act import ActQuantSpec
from bitmosaic.pipeline import RunSettings, quantize_model
from bitmosaic.pipeline.recipe import Recipe


# format -> (weight options, activation quantizer of its A4/A8 rows)
def _int4(g: int) -> tuple[dict, ActQuantSpec]:
    return {"bits": 4, "group_size": g, "sym": True}, ActQuantSpec(
        "int", 4, granularity="group", group_size=g
    )


FORMATS = {
    "INT4-g32": _int4(32),
    "INT4-g16": _int4(16),
    "MXFP4": ({"wfmt": "mxfp4"}, ActQuantSpec.microscaled("mxfp4")),
    "NVFP4": ({"wfmt": "nvfp4"}, ActQuantSpec.microscaled("nvfp4")),
    "FP8-block": ({"wfmt": "fp8-block"}, ActQuantSpec("e4m3", 8, granularity="group", group_size=128)),
    "MXFP8": ({"wfmt": "mxfp8"}, ActQuantSpec.microscaled("mxfp8")),
    "INT8": ({"bits": 8, "group_size": None, "sym": True}, ActQuantSpec("int", 8)),
}  # fmt: skip
FOUR = ("INT4-g32", "INT4-g16", "MXFP4", "NVFP4")
EIGHT = ("FP8-block", "MXFP8", "INT8")
METHODS = {"rtn": {"scale": "mse"}, "gptq": {}}  # GPTQ's defaults: act-order, MSE scales, static groups
ROTATIONS = ("none", "hadamard", "block")


def _configs() -> list[tuple[str, str, str, str]]:
    """(format, method, acts, rotation), most telling first: a budget-cut run keeps these."""
    out = [(f, m, a, "none") for a in ("A16", "A4") for m in METHODS for f in FOUR]
    out += [(f, "gptq", "A4", r) for r in ("block", "hadamard") for f in FOUR]
    out += [(f, "rtn", a, r) for a in ("A16", "A4") for r in ("block", "hadamard") for f in FOUR]
    out += [(f, "gptq", "A16", r) for r in ("block", "hadamard") for f in FOUR]
    out += [(f, m, "A8", "none") for m in METHODS for f in EIGHT]
    return out


CONFIGS = _configs()


def name_of(fmt: str, method: str, acts: str, rotate: str) -> str:
    w = "W8" if fmt in EIGHT else "W4"
    return f"{fmt} {method} {w}{acts}" + ("" if rotate == "none" else f" +{rotate}")


def recipe_of(fmt: str, method: str, acts: str, rotate: str) -> Recipe:
    wopts, act = FORMATS[fmt]
    opts = {**METHODS[method], **wopts, "act": None if acts == "A16" else act}
    return Recipe.from_options(method, opts, rotate=rotate)


def run(b: Bench, fmt: str, method: str, acts: str, rotate: str) -> dict:
    model = copy.deepcopy(b.model)
    settings = RunSettings(progress=b.progress, seed=b.args.seed, device=b.args.device)
    rep = quantize_model(model, b.calib, recipe_of(fmt, method, acts, rotate), None, settings)
    t = time.perf_counter()
    rot = rep.calibration.get("rotation", {}).get("kind", "none")
    row = {"name": name_of(fmt, method, acts, rotate), "format": fmt, "method": method, "acts": acts,
           "rotate": rotate, "rotation": rot, "bits_per_weight": rep.bits_per_weight,
           "quant_seconds": rep.seconds, **b.measure(model), "eval_seconds": time.perf_counter() - t,
           "device": b.args.device}  # fmt: skip
    print(f"  {row['name']:<34} ppl {row['ppl']:9.3f}  KL {row['kl_mean']:.4f}  top-1 "
          f"{row['top1_agreement']:.4f}  bpw {row['bits_per_weight']:.3f}  "
          f"quant {rep.seconds:6.1f}s")  # fmt: skip
    return row


# ---- the report ---------------------------------------------------------------------------------

PUBLISHED = (
    "Published orderings. (1) NVFP4 is more accurate than MXFP4 at 4 bits: its E4M3 scale follows each "
    "block's range where MXFP4's power-of-two E8M0 scale wastes up to a binade, and its block is 16, not "
    "32 (NVIDIA's NVFP4 introduction; Egiazarian et al. 2025, *Bridging the Gap Between Promise and "
    "Performance for Microscaling FP4 Quantization*). (2) A global Hadamard rotation does not combine "
    "well with power-of-two block scales: it spreads an outlier over every block, so each block's scale "
    "is set by mixed-in energy, while a block-wise Hadamard of the scale block keeps the mixing inside "
    "the block and helps MXFP4 (BRQ, *Block Rotation is All You Need for MXFP4 Quantization*; "
    "Egiazarian et al.'s micro-rotated GPTQ, MR-GPTQ: GPTQ with block-wise Hadamards and format-aware "
    "scales, which closes most of MXFP4's gap to NVFP4); for NVFP4 the same work reports small or no "
    "gains from rotation. (3) Fine-grained INT4 with good scales is competitive with FP4 of the same "
    "block (Chen et al. 2025, *INT v.s. FP*), once the scale's bits are counted."
)


def _cell(rows: dict, f: float, key: str) -> str:
    r = rows.get(key)
    return "" if r is None else f"{r['ppl']:.2f} ({r['kl_mean']:.3f})"


def published_checks(rows: dict) -> list[str]:
    """Where the measured rows agree or disagree with the published orderings (only rows present)."""
    out = []

    def ppl(f, m, a, r):
        x = rows.get(name_of(f, m, a, r))
        return None if x is None else x["ppl"]

    def iv(a: tuple, b: tuple) -> str:
        """The ratio a / b with its paired bootstrap 95% interval over the windows (``""`` without them)."""
        ra, rb = rows.get(name_of(*a)), rows.get(name_of(*b))
        if not (ra and rb and ra.get("window_nll") and rb.get("window_nll")):
            return ""
        lo, hi = bootstrap_ratio(ra["window_nll"], rb["window_nll"])
        noise = " within noise" if lo <= 1 <= hi else ""
        return f", ratio {ra['ppl'] / rb['ppl']:.3f} [{lo:.3f}, {hi:.3f}]{noise}"

    for m in METHODS:
        for a in ("A16", "A4"):
            nv, mx = ppl("NVFP4", m, a, "none"), ppl("MXFP4", m, a, "none")
            if nv is not None and mx is not None:
                agree = "as published" if nv < mx else "**differs from the published order**"
                out.append(f"NVFP4 vs MXFP4, {m} W4{a}: {nv:.2f} vs {mx:.2f} ({agree}"
                           f"{iv(('NVFP4', m, a, 'none'), ('MXFP4', m, a, 'none'))}).")  # fmt: skip
    for f in ("MXFP4", "NVFP4", "INT4-g32"):
        for m, a in (("gptq", "A4"), ("rtn", "A16"), ("gptq", "A16")):
            none, glob, blk = (ppl(f, m, a, r) for r in ROTATIONS)
            if none is not None and (glob, blk) != (None, None):  # the rotations run so far
                names = ("none", "global Hadamard", "block Hadamard")
                have = [(k, v) for k, v in zip(names, (none, glob, blk), strict=True) if v is not None]
                best = min(have, key=lambda t: t[1])[0] if len(have) == 3 else None
                ratio = "" if blk is None else iv((f, m, a, "block"), (f, m, a, "none"))
                ratio = "block / none" + ratio if ratio else ""
                cells = ", ".join(f"{k} {v:.2f}" for k, v in have)
                why = "; ".join(filter(None, [f"best: {best}" if best else "", ratio]))
                out.append(f"{f} {m} W4{a}: {cells}" + (f" ({why})" if why else "") + ".")
    for m, a in (("rtn", "A16"), ("gptq", "A16"), ("gptq", "A4")):
        i32, mx = ppl("INT4-g32", m, a, "none"), ppl("MXFP4", m, a, "none")
        if i32 is not None and mx is not None:
            out.append(f"INT4 g32 vs MXFP4 (same block), {m} W4{a}: {i32:.2f} vs {mx:.2f}"
                       f"{iv(('INT4-g32', m, a, 'none'), ('MXFP4', m, a, 'none'))}.")  # fmt: skip
    return out


def _bpw(rows: list[dict], fmt: str) -> str:
    bpw = next((r["bits_per_weight"] for r in rows if r.get("format") == fmt), None)
    return "" if bpw is None else f"{bpw:.3f}"


def _pivots(rows: list[dict], by: dict, f: float) -> list[str]:
    """The 4-bit table (setting x format) and the 8-bit one, each cell ``ppl (KL)``."""
    lines = ["## 4 bits: perplexity (KL) per setting and format", "",
             "| setting | " + " | ".join(FOUR) + " |", "|---|" + "---|" * len(FOUR),
             "| bits/weight | " + " | ".join(_bpw(rows, x) for x in FOUR) + " |"]  # fmt: skip
    for a in ("A16", "A4"):
        for m in METHODS:
            for r in ROTATIONS:
                label = f"{m} W4{a}" + ("" if r == "none" else f" +{r}")
                lines.append(
                    f"| {label} | " + " | ".join(_cell(by, f, name_of(x, m, a, r)) for x in FOUR) + " |"
                )
    lines += ["", f"Float: {f:.2f}. An empty cell: not run yet (`--only` that row).", "",
              "## 8 bits, W8A8", "", "| format | bits/weight | rtn W8A8 | gptq W8A8 |",
              "|---|---|---|---|"]  # fmt: skip
    for fmt in EIGHT:
        cells = " | ".join(_cell(by, f, name_of(fmt, m, "A8", "none")) for m in METHODS)
        lines.append(f"| {fmt} | {_bpw(rows, fmt)} | {cells} |")
    return lines


def markdown(rows: list[dict], args: dict) -> str:
    by = {r["name"]: r for r in rows}
    f = by["float"]["ppl"] if "float" in by else float("nan")
    windows = f"the first {args['max_windows']} windows" if args["max_windows"] else "every window"
    prot = protocol_label(SimpleNamespace(**args, fidelity=True))
    setup = __doc__.split("\n\n")[1].replace("\n", " ")
    lines = [
        f"{args['model']}, *{prot}* protocol: calibration {args['nsamples']}x{args['seqlen']} (seed "
        f"{args['seed']}), WikiText-2 test perplexity on {windows} of {args['seqlen']}, KL(float || "
        f"quantized) and top-1 agreement on the same windows. {setup}",
        "",
        f"Reproduce: `python -m benchmarks.microscaling --protocol {prot}` (rows accumulate; `--only` "
        "picks rows).",
        "",
        *_pivots(rows, by, f),
        "",
        "## Every row",
        "",
        "| row | rotation | bits/weight | ppl | ppl / float | KL | top-1 | quant s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["name"] != "float":
            lines.append(
                f"| {r['name']} | {r['rotation']} | {r['bits_per_weight']:.3f} | {r['ppl']:.2f} | "
                f"{r['ppl'] / f:.3f} | {r['kl_mean']:.4f} | {r['top1_agreement']:.4f} | "
                f"{r['quant_seconds']:.0f} |"
            )
    lines += ["", "## Against the published orderings", "", PUBLISHED, "", "Ours (rows present):", ""]
    lines += [f"- {c}" for c in published_checks(by)] or ["- (no comparable rows yet)"]
    return "\n".join(lines)


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--redo", action="store_true", help="run rows already in the JSON again")
    p.add_argument("--budget-min", type=float, default=None, help="start no row after this many minutes")
    a = p.parse_args()
    a.fidelity = True  # every row has KL and top-1
    t0 = time.perf_counter()
    path = Path(a.json) if a.json else RESULTS / "microscaling.json"
    keys = ("model", "nsamples", "seqlen", "max_windows", "seed")
    old = json.loads(path.read_text()) if path.exists() and not a.redo else {}
    if old and any(old["args"][k] != getattr(a, k) for k in keys):
        theirs = {k: old["args"][k] for k in keys}
        raise SystemExit(f"error: {path} holds rows of other settings ({theirs}); use --json FILE or --redo")
    rows = {r["name"]: r for r in old.get("rows", [])}
    names = [name_of(*c) for c in CONFIGS]
    only = None if a.only is None else a.only.split(",")
    unknown = [n for n in only or [] if n not in names and n != "float"]
    if unknown:
        raise SystemExit(f"error: --only names no row: {', '.join(unknown)} (rows: {'; '.join(names)})")
    todo = [
        c for c in CONFIGS if (only is None or name_of(*c) in only) and (a.redo or name_of(*c) not in rows)
    ]
    b = Bench(a)
    args = {k: getattr(a, k) for k in keys}

    def save() -> None:
        out = [rows[n] for n in ["float", *names] if n in rows]
        out_d = {"protocol": protocol_label(a), "args": args, "rows": out}
        write_results(path, "microscaling", out_d, markdown(out, args))

    if "float" not in rows or (a.redo and (only is None or "float" in only)):
        rows["float"] = {"name": "float", **b.measure(b.model)}
        save()
    for c in todo:
        if a.budget_min is not None and time.perf_counter() - t0 > 60 * a.budget_min:
            left = ", ".join(name_of(*x) for x in todo[todo.index(c) :])
            print(f"budget of {a.budget_min} min spent; left: {left}")
            break
        rows[name_of(*c)] = run(b, *c)
        save()
    save()


if __name__ == "__main__":
    main()
