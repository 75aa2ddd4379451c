"""QuaRot rotations (``--rotate``) against W4A4 collapse on SmolLM2-135M, *fast* protocol: calibration
16x512 (WikiText-2 validation, seed 0), perplexity on the first 20 windows of 512 tokens of the
WikiText-2 test set, with KL(float || quantized) and top-1 agreement on the same windows.

Weights: 4-bit symmetric per-channel (QuaRot's and ``benchmarks/mosaic.py``'s setting; GPTQ with
act-order and MSE scales); activations INT, symmetric, dynamic: per token (``A4``, ``A8``) or in
groups of 64 channels (``A4g64``).  Each config runs without and with ``--rotate hadamard``.
Activation quantization is simulated (fake-quantized inputs, float32 matmuls).

Rows accumulate in ``benchmarks/results/rotation.json`` (a config already there is skipped unless
``--redo``), so the whole table can be built over several short runs; ``--budget-min M`` starts no
new config after M minutes.  The Markdown table is rewritten from every row each time.

Run: python benchmarks/rotation.py --nsamples 16 --max-windows 20 [--only NAME,NAME] [--budget-min 9]
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

from bitmosaic.data import bos_token_id
from bitmosaic.eval.perplexity import perplexity
from bitmosaic.formats.act import ActQuantSpec
from bitmosaic.methods import get_method
from bitmosaic.models.arch import get_arch
from bitmosaic.pipeline import quantize_model
from bitmosaic.pipeline.rotate import rotate_model

from common import RESULTS, Bench, base_parser, write_results

ACTS = {
    "A4": ActQuantSpec("int", 4),
    "A4g64": ActQuantSpec("int", 4, granularity="group", group_size=64),
    "A8": ActQuantSpec("int", 8),
}
W4 = {"bits": 4, "group_size": None, "sym": True}
METHODS = {
    "rtn": ("rtn", W4),
    "gptq": ("gptq", {**W4, "order": "act", "scale": "mse"}),
    "smoothquant+gptq": (
        "smoothquant",
        {**W4, "alpha": None, "solver": "gptq", "order": "act", "scale": "mse"},
    ),
    "mosaic": ("mosaic", {}),
}
# (method label, activations, rotation), most telling first: a budget-cut run keeps these
CONFIGS = [
    ("gptq", "A4", "hadamard"),
    ("gptq", "A4", "none"),
    ("rtn", "A4", "hadamard"),
    ("rtn", "A4", "none"),
    ("gptq", "A8", "hadamard"),
    ("gptq", "A8", "none"),
    ("rtn", "A8", "hadamard"),
    ("rtn", "A8", "none"),
    ("gptq", "A4g64", "hadamard"),
    ("gptq", "A4g64", "none"),
    ("rtn", "A4g64", "hadamard"),
    ("rtn", "A4g64", "none"),
    ("gptq", "A4", "random"),
    ("smoothquant+gptq", "A4", "hadamard"),
    ("smoothquant+gptq", "A4", "none"),
    ("mosaic", "A4", "hadamard"),
    ("mosaic", "A4", "none"),
]


def name_of(label: str, act: str, rotate: str) -> str:
    return f"{label} W4{act}" + ("" if rotate == "none" else f" +{rotate}")


def evaluate(b: Bench, model) -> dict:
    a = b.args
    r = perplexity(model, b.eval_ids, a.seqlen, max_windows=a.max_windows, progress=False,
                   bos_token_id=bos_token_id(b.tok), reference=b.model)  # fmt: skip
    return {k: r.get(k) for k in ("ppl", "kl_mean", "top1_agreement", "windows")}


def run(b: Bench, label: str, act: str, rotate: str, max_tokens: int) -> dict:
    method, opts = METHODS[label]
    opts = {**opts, "act": ACTS[act]}
    if method in ("smoothquant", "mosaic"):
        opts["max_tokens"] = max_tokens
    spec = get_method(method)
    cfg = spec.make_config(**opts)
    model = copy.deepcopy(b.model)
    rep = quantize_model(model, b.calib, spec, cfg, progress=False, rotate=rotate, seed=b.args.seed)
    t = time.perf_counter()
    row = {"name": name_of(label, act, rotate), "method": label, "acts": act, "rotate": rotate,
           "bits_per_weight": rep.bits_per_weight, "quant_seconds": rep.seconds, **evaluate(b, model),
           "eval_seconds": time.perf_counter() - t}  # fmt: skip
    print(f"  {row['name']:<32} ppl {row['ppl']:9.3f}  KL {row['kl_mean']:.4f}  "
          f"top-1 {row['top1_agreement']:.4f}  quant {rep.seconds:6.1f}s", flush=True)  # fmt: skip
    return row


def markdown(rows: list[dict], args) -> str:
    flt = next((r for r in rows if r["name"] == "float"), None)
    f = flt["ppl"] if flt else float("nan")
    lines = [
        f"{args['model']}, *fast* protocol: calibration {args['nsamples']}x{args['seqlen']} "
        f"(seed {args['seed']}), WikiText-2 test perplexity on the first {args['max_windows']} windows of "
        f"{args['seqlen']}, KL and top-1 against the float model on the same windows. W4 symmetric "
        "per-channel; A4/A8 per-token dynamic, A4g64 dynamic per group of 64 channels (simulated)."
        " Reproduce: "
        f"`python benchmarks/rotation.py --nsamples {args['nsamples']} --max-windows {args['max_windows']}`",
        "",
        "| config | rotate | ppl | ppl / float | KL | top-1 | bits/weight | quant s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["name"] == "float":
            lines.append(f"| float | none | {r['ppl']:.2f} | 1.00 | 0 | 1 | 32 | |")
            continue
        if r["name"] == "float +hadamard":
            lines.append(f"| float | hadamard | {r['ppl']:.2f} | {r['ppl'] / f:.4f} | {r['kl_mean']:.1e} | "
                         f"{r['top1_agreement']:.4f} | 32 | |")  # fmt: skip
            continue
        lines.append(
            f"| {r['method']} W4{r['acts']} | {r['rotate']} | {r['ppl']:.2f} | {r['ppl'] / f:.2f} | "
            f"{r['kl_mean']:.4f} | {r['top1_agreement']:.4f} | {r['bits_per_weight']:.3f} | "
            f"{r['quant_seconds']:.0f} |"
        )
    goal = next((r for r in rows if r["name"] == name_of("gptq", "A4", "hadamard")), None)
    if goal and flt:
        met = "met" if goal["ppl"] <= 1.5 * f else "not met"
        lines += ["", f"Goal (GPTQ W4A4 with rotation within 1.5x of float): {goal['ppl']:.2f} vs "
                  f"{1.5 * f:.2f} = 1.5 x {f:.2f}: **{met}**."]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--only", default=None, help="comma list of config names (default: every config)")
    p.add_argument("--redo", action="store_true", help="run configs already in the JSON again")
    p.add_argument("--budget-min", type=float, default=None, help="start no config after this many minutes")
    p.add_argument("--max-tokens", type=int, default=1024, help="smoothing search token sample")
    a = p.parse_args()
    t0 = time.perf_counter()
    path = RESULTS / "rotation.json" if a.json is None else a.json
    keys = ("model", "nsamples", "seqlen", "max_windows", "seed")
    path = Path(path)
    old = json.loads(path.read_text()) if path.exists() and not a.redo else {}
    if old and any(old["args"][k] != getattr(a, k) for k in keys):
        theirs = {k: old["args"][k] for k in keys}
        raise SystemExit(f"error: {path} holds rows of other settings ({theirs}); use --json FILE or --redo")
    rows = {r["name"]: r for r in old.get("rows", [])}
    wanted = [c for c in CONFIGS if a.only is None or name_of(*c) in a.only.split(",")]
    todo = [c for c in wanted if a.redo or name_of(*c) not in rows]
    b = Bench(a)

    def save() -> None:
        order = ["float", "float +hadamard"] + [name_of(*c) for c in CONFIGS]
        out = [rows[n] for n in order if n in rows]
        args = {k: getattr(a, k) for k in keys}
        write_results(path, "rotation", {"protocol": "fast", "args": args, "rows": out}, markdown(out, args))

    if "float" not in rows or a.redo:
        rows["float"] = {"name": "float", **evaluate(b, b.model)}
        print(f"  float ppl {rows['float']['ppl']:.3f}", flush=True)
        save()
    if "float +hadamard" not in rows or a.redo:  # the rotation alone changes nothing (float32 rounding)
        model = copy.deepcopy(b.model)
        rotate_model(model, get_arch(model), "hadamard", a.seed)
        rows["float +hadamard"] = {"name": "float +hadamard", **evaluate(b, model)}
        del model
        r = rows["float +hadamard"]
        print(f"  float +hadamard ppl {r['ppl']:.3f} KL {r['kl_mean']:.2e} top-1 {r['top1_agreement']:.4f}")
        save()
    for c in todo:
        if a.budget_min is not None and time.perf_counter() - t0 > 60 * a.budget_min:
            left = ", ".join(name_of(*x) for x in todo[todo.index(c) :])
            print(f"budget of {a.budget_min} min spent; left: {left}")
            break
        rows[name_of(*c)] = run(b, *c, a.max_tokens)
        save()


if __name__ == "__main__":
    main()
