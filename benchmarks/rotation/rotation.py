"""QuaRot rotations (``--rotate``) against W4A4 collapse on SmolLM2-135M, *fast* protocol: calibration
16x512 (WikiText-2 validation, seed 0), perplexity on the first 20 windows of 512 tokens of the
WikiText-2 test set, with KL(float || quantized) and top-1 agreement on the same windows.

Weights: 4-bit symmetric per-channel (QuaRot's and ``benchmarks/mosaic/mosaic.py``'s setting; GPTQ with
act-order and MSE scales); activations INT, symmetric, dynamic: per token (``A4``, ``A8``) or in
groups of 64 channels (``A4g64``).  Each config runs without and with ``--rotate hadamard``.
``A4c0.9`` clips the activation scales at 0.9 of the maximum (QuaRot's setting); ``A16`` quantizes
weights only.  SQ-format rows: W(SQ5) weights (64-(8/4)-0.875) with A4 activations, and A(SQ)
activations (16-(8/4)-0.5, per-bank scales) with W4 weights, both g128 GPTQ underneath.  The rotation
is QuaRot's: R1 on the residual stream, R2 per head, online Hadamards at the inputs of o_proj and
down_proj.  The activation grids are those of the integer kernels; whether the matmul runs in
integers (CPU) or on fake-quantized float inputs gives the same quantized values.

``--device cuda`` quantizes and evaluates on a GPU; ``--protocol verdict`` is 128x512 calibration and
the whole test set (write it with ``--json``: rows of another protocol are refused in one file).

Rows accumulate in ``benchmarks/results/rotation.json`` (a config already there is skipped unless
``--redo``), so the whole table can be built over several short runs; ``--budget-min M`` starts no
new config after M minutes.  The Markdown table is rewritten from every row each time.

``+spinquant`` rows learn R1 and each layer's R2 from the Hadamard ones (SpinQuant, Cayley SGD, 100 steps
of one calibration sample, lr 1.5; ``+spinquant:batch=8``: 8 samples a step, the paper's batch) against
the row's activation quantizer, weights in float, on ``--device``; the row keeps the first and last
step's loss.
Run: python -m benchmarks.rotation.rotation --protocol fast [--only NAME,NAME] [--budget-min 9]
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.harness import RESULTS, Bench, base_parser, protocol_label, write_results
from bitmosaic.algorithms.rtn import rtn_quantize
from bitmosaic.formats.act import ActQuantSpec
from bitmosaic.formats.grid import IntGrid
from bitmosaic.models.arch import get_arch
from bitmosaic.pipeline import RunSettings, quantize_model
from bitmosaic.pipeline.recipe import Recipe
from bitmosaic.pipeline.rotate import rotate_model

ACTS = {
    "A16": None,  # weights only: what the weights alone cost
    "A4": ActQuantSpec("int", 4),
    "A4c0.9": ActQuantSpec("int", 4, clip_ratio=0.9),  # QuaRot's activation clip ratio
    "A4g64": ActQuantSpec("int", 4, granularity="group", group_size=64),
    "A4g128": ActQuantSpec("int", 4, granularity="group", group_size=128),  # MosaicQuant's A4
    "A4g64c0.9": ActQuantSpec("int", 4, granularity="group", group_size=64, clip_ratio=0.9),
    "A8": ActQuantSpec("int", 8),
    "A(SQ)": None,  # SQ-format's own activations (sq-acts)
}
W4 = {"bits": 4, "group_size": None, "sym": True}
WIDE_ALPHAS = tuple(round(0.05 * i, 2) for i in range(21))  # issue 25's α grid for MosaicQuant
GPTQ = {**W4, "order": "act", "scale": "mse"}
METHODS = {
    "rtn": ("rtn", W4),
    "gptq": ("gptq", GPTQ),
    "gptq-g128": ("gptq", {**GPTQ, "group_size": 128}),
    # SQ-format (its W4A4-class settings of benchmarks/sq/sq_format.py): W(SQ5) = 64-(8/4)-0.875 weights
    # with the run's activations; A(SQ) = 16-(8/4)-0.5 activations with per-bank scales and W4 weights
    "sq-weights": ("sq-weights", {"bits": 4, "group_size": 128, "solver": "gptq", "sq": "64-(8/4)-0.875"}),
    "sq-acts": ("sq-acts", {"bits": 4, "group_size": 128, "solver": "gptq", "sq": "16-(8/4)-0.5",
                            "act_scale": "bank"}),  # fmt: skip
    "smoothquant+gptq": (
        "smoothquant",
        {**W4, "alpha": None, "solver": "gptq", "order": "act", "scale": "mse"},
    ),
    "mosaic": ("mosaic", {}),  # the paper's: RTN dense base; its A4 is per group of 128 (App. C.1)
    "mosaic-gptq": ("mosaic", {"solver": "gptq"}),  # ours: a GPTQ dense base
    # the same with issue 25's α search: 0-1 in steps of 0.05 plus no smoothing (a rotation has already
    # spread the outliers that the paper's 0.3-1.0 grid must still smooth)
    "mosaic-gptq-wide": ("mosaic", {"solver": "gptq", "alpha_grid": WIDE_ALPHAS, "try_no_smooth": True}),
    # the same GPTQ base with its per-row clip searched (rotation alone's GPTQ uses MSE scales; the
    # paper's absmax grid spends a rotated, near-Gaussian row's 4 bits on its extremes)
    "mosaic-gptq-clip": ("mosaic", {"solver": "gptq", "clip_search": True}),
}
# (method label, activations, rotation), most telling first: a budget-cut run keeps these
CONFIGS = [
    ("gptq", "A4", "hadamard"),
    ("gptq", "A4", "none"),
    ("gptq", "A4c0.9", "hadamard"),
    ("gptq", "A16", "hadamard"),
    ("gptq", "A16", "none"),
    ("rtn", "A16", "hadamard"),
    ("rtn", "A16", "none"),
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
    ("gptq", "A4g64c0.9", "hadamard"),
    ("gptq", "A4", "random"),
    ("gptq-g128", "A4", "hadamard"),
    ("gptq-g128", "A4", "none"),
    ("sq-weights", "A4", "hadamard"),
    ("sq-weights", "A4", "none"),
    ("sq-acts", "A(SQ)", "hadamard"),
    ("sq-acts", "A(SQ)", "none"),
    ("smoothquant+gptq", "A4", "hadamard"),
    ("smoothquant+gptq", "A4", "none"),
    ("mosaic", "A4", "hadamard"),
    ("mosaic", "A4", "none"),
    ("gptq", "A4g128", "hadamard"),  # rotation alone with MosaicQuant's activations
    ("mosaic-gptq", "A4", "hadamard"),
    ("mosaic-gptq", "A4", "none"),
    ("mosaic-gptq-wide", "A4", "hadamard"),
    ("mosaic-gptq-clip", "A4", "hadamard"),
    ("mosaic-gptq-clip", "A4", "none"),
    # SpinQuant: R1/R2 learned from the Hadamard start (100 Cayley SGD steps, lr 1.5) against the A4
    ("gptq", "A4", "spinquant"),
    ("gptq", "A4g64", "spinquant"),
    # the paper's batch (8 samples a step; its samples are 2048 tokens, ours the run's 512) on the best
    # Hadamard row's activations and on QuaRot/SpinQuant's own per-token A4
    ("gptq", "A4g64c0.9", "spinquant:batch=8"),
    ("gptq", "A4", "spinquant:batch=8"),
    ("gptq", "A4g64c0.9", "spinquant:lr=0.1,batch=8"),  # a smaller step (the loss rose at lr 1.5)
]


DIAG_LAYERS = (2, 10, 20, 28)
DIAG_LINEARS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@torch.no_grad()
def rtn_output_error(b: Bench) -> list[dict]:
    """Why RTN weights lose with a rotation here: per linear, ``||X (Q(W) - W)ᵀ|| / ||X Wᵀ||`` with ``Q``
    4-bit symmetric per-channel min-max RTN and ``X`` its inputs on two calibration samples, in the
    float model and in the rotated one (norm scales folded, R1, online Hadamards); and per pre-norm,
    its scale on the 5 residual channels of largest mean magnitude over its median scale."""
    rotated = copy.deepcopy(b.model)
    rotate_model(rotated, get_arch(rotated), "hadamard", b.args.seed)
    norms: dict[str, float] = {}  # measured on the float model only (the rotated norms are scale-free)
    pre = []
    for li in DIAG_LAYERS:
        layer = b.model.model.layers[li]
        for n in ("input_layernorm", "post_attention_layernorm"):
            norm = layer.get_submodule(n)

            def scale_at_outliers(mod, args, key=f"layer {li} {n}"):
                h = args[0].reshape(-1, args[0].shape[-1]).abs().mean(0)  # the residual stream
                g, top = mod.weight.abs().float(), h.topk(5).indices
                norms[key] = float(g[top].mean() / g.median())

            pre.append(norm.register_forward_pre_hook(scale_at_outliers))
    grid = IntGrid(4, symmetric=True)
    errs: dict[str, dict[str, float]] = {}
    for kind, model in (("none", b.model), ("hadamard", rotated)):
        hooks = []
        for li in DIAG_LAYERS:
            for n in DIAG_LINEARS:
                lin = model.model.layers[li].get_submodule(n)
                name = f"layer {li} {n.rsplit('.', 1)[-1]}"

                def hook(mod, args, out, key=name, kind=kind):
                    x = args[0].reshape(-1, args[0].shape[-1]).float()  # after an online rotation
                    W = mod.weight.float()
                    dW = rtn_quantize(W, grid, None, "minmax").dequantize() - W
                    errs.setdefault(key, {})[kind] = float((x @ dW.T).norm() / (x @ W.T).norm())

                hooks.append(lin.register_forward_hook(hook))
        model(torch.cat([s.reshape(1, -1) for s in b.calib[:2]]))
        for h in hooks + pre:
            h.remove()
        pre = []
    rows = [{"linear": k, **v} for k, v in errs.items()]
    return rows + [{"norm": k, "scale_at_top5_over_median": v} for k, v in norms.items()]


def name_of(label: str, act: str, rotate: str) -> str:
    return f"{label} W4{act}" + ("" if rotate == "none" else f" +{rotate}")


def evaluate(b: Bench, model) -> dict:
    return b.measure(model)  # perplexity, KL and top-1 (the run sets --fidelity)


def where(device: str) -> str:
    """The device a row ran on, as the table names it (GPU and CPU float rounding differ a little)."""
    if device == "cpu":
        return "cpu"
    import torch

    return f"{device} ({torch.cuda.get_device_name()})"


def run(b: Bench, label: str, act: str, rotate: str, max_tokens: int) -> dict:
    method, opts = METHODS[label]
    opts = opts if method == "sq-acts" else {**opts, "act": ACTS[act]}
    if method in ("smoothquant", "mosaic", "sq-weights", "sq-acts"):
        opts["max_tokens"] = max_tokens
    recipe = Recipe.from_options(method, opts, rotate=rotate)
    model = copy.deepcopy(b.model)
    settings = RunSettings(progress=b.progress, seed=b.args.seed, device=b.args.device)
    rep = quantize_model(model, b.calib, recipe, None, settings)
    t = time.perf_counter()
    row = {"name": name_of(label, act, rotate), "method": label, "acts": act, "rotate": rotate,
           "bits_per_weight": rep.bits_per_weight, "quant_seconds": rep.seconds, **evaluate(b, model),
           "eval_seconds": time.perf_counter() - t, "device": where(b.args.device)}  # fmt: skip
    learned = rep.calibration.get("rotation", {}).get("learned")
    if learned:  # a learned rotation: its steps, rate, batch and the first/last step's loss
        row["learned"] = learned
    print(f"  {row['name']:<32} ppl {row['ppl']:9.3f}  KL {row['kl_mean']:.4f}  "
          f"top-1 {row['top1_agreement']:.4f}  quant {rep.seconds:6.1f}s", flush=True)  # fmt: skip
    return row


def _descent(learned: dict) -> str:
    """The training cross-entropy over the first and the last pass through the same samples, where the
    run recorded every step's (``losses``, ``cycle``); else only the first and last step's, which are
    of different samples and so say little."""
    losses, c = learned.get("losses"), learned.get("cycle")
    if losses and c and len(losses) >= 2 * c:
        k = len(losses) // c * c  # the last whole pass
        first, last = sum(losses[:c]) / c, sum(losses[k - c : k]) / c
        return f"training loss over the same {c} batches {first:.3f} (first pass) -> {last:.3f} (last)"
    return (f"first step's loss {learned['loss_first']:.3f}, last step's {learned['loss_last']:.3f} "
            "(different samples; no per-step record)")  # fmt: skip


def protocol(args: dict) -> str:
    return protocol_label(SimpleNamespace(**args, fidelity=True))  # every row has KL and top-1


def markdown(rows: list[dict], args, diag: list[dict] | None = None) -> str:
    flt = next((r for r in rows if r["name"] == "float"), None)
    f = flt["ppl"] if flt else float("nan")
    windows = f"the first {args['max_windows']} windows" if args["max_windows"] else "every window"
    how = f"--protocol {protocol(args)}" if protocol(args) != "custom" else (
        f"--nsamples {args['nsamples']} --max-windows {args['max_windows'] or 0}")  # fmt: skip
    lines = [
        f"{args['model']}, *{protocol(args)}* protocol: calibration {args['nsamples']}x{args['seqlen']} "
        f"(seed {args['seed']}), WikiText-2 test perplexity on {windows} of "
        f"{args['seqlen']}, KL and top-1 against the float model on the same windows. W4 symmetric "
        "per-channel (gptq-g128, SQ-format: groups of 128); A4/A8 per-token dynamic, A4c0.9 with "
        "QuaRot's clip ratio, A4g64 dynamic per group of 64 channels, A16 none, A(SQ) SQ-format's "
        "16-(8/4)-0.5; MosaicQuant's A4 is per group of 128 (the paper's setting, App. C.1), its dense "
        "base RTN (the paper's) or GPTQ (mosaic-gptq, ours). Rotation: R1, R2 per head, online Hadamard "
        "at o_proj and down_proj inputs."
        " Reproduce: "
        f"`python -m benchmarks.rotation.rotation {how}` (add `--device cuda` on a GPU)",
        "",
        "| config | rotate | ppl | ppl / float | KL | top-1 | bits/weight | quant s | where |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["name"] == "float":
            lines.append(f"| float | none | {r['ppl']:.2f} | 1.00 | 0 | 1 | 32 | | |")
            continue
        if r["name"] == "float +hadamard":
            lines.append(f"| float | hadamard | {r['ppl']:.2f} | {r['ppl'] / f:.4f} | {r['kl_mean']:.1e} | "
                         f"{r['top1_agreement']:.4f} | 32 | | |")  # fmt: skip
            continue
        lines.append(
            f"| {r['method']} W4{r['acts']} | {r['rotate']} | {r['ppl']:.2f} | {r['ppl'] / f:.2f} | "
            f"{r['kl_mean']:.4f} | {r['top1_agreement']:.4f} | {r['bits_per_weight']:.3f} | "
            f"{r['quant_seconds']:.0f} | {r.get('device', 'cpu')} |"
        )
    goals = [r for r in rows if r["name"].startswith("gptq W4A4") and r.get("rotate", "none") != "none"]
    if goals and flt:
        best = min(goals, key=lambda r: r["ppl"])
        met = "met" if best["ppl"] <= 1.5 * f else "not met"
        lines += ["", f"Goal (GPTQ W4A4 with a rotation, Hadamard or learned, within 1.5x of float = "
                  f"{1.5 * f:.2f}): best rotated GPTQ W4A4 row {best['name']} {best['ppl']:.2f} "
                  f"({best['ppl'] / f:.2f}x): **{met}**."]  # fmt: skip
    learned = [r for r in rows if r.get("learned")]
    if learned:
        lines += ["", "Learned rotations (SpinQuant, Cayley SGD from the Hadamard start): " + "; ".join(
            f"{r['name']}: {r['learned']['steps']} steps of {r['learned'].get('batch', 1)} sample(s), lr "
            f"{r['learned']['lr']:g}, {_descent(r['learned'])}" for r in learned) + "."]  # fmt: skip
    for r in rows:  # "NAME @DEVICE": the same config run again on another device, for same-device pairs
        base, at, dev = r["name"].partition(" @")
        other = next((x for x in rows if x["name"] == base), None) if at else None
        if other:
            lines += ["", f"The same config on two devices: {base} {other['ppl']:.2f} on "
                      f"{other.get('device', 'cpu')}, {r['ppl']:.2f} on {dev} (GPTQ's act-order and MSE "
                      "decisions follow float rounding; here they differ by "
                      f"{abs(other['ppl'] / r['ppl'] - 1):.1%}): compare rows of one device."]  # fmt: skip
    if diag:
        lines += ["", "Why RTN weights lose with a rotation here (`--diagnose`): relative output error "
                  "||X (Q(W) - W)ᵀ|| / ||X Wᵀ|| of 4-bit symmetric per-channel min-max RTN on two "
                  "calibration samples. gate/up_proj lose, the others gain. Our reading, from the second "
                  "table: the MLP's pre-norm scale is small on the few residual channels that are largest, "
                  "the attention's is not; folded into gate/up and rotated, that structure spreads over "
                  "every weight, and a quantizer that does not see the inputs (RTN) pays, while GPTQ "
                  "gains.", "",
                  "| linear | no rotation | hadamard |", "|---|---|---|"]  # fmt: skip
        lines += [f"| {d['linear']} | {d['none']:.4f} | {d['hadamard']:.4f} |" for d in diag if "linear" in d]
        lines += ["", "| pre-norm | its scale on the 5 largest residual channels / its median scale |",
                  "|---|---|"]  # fmt: skip
        lines += [f"| {d['norm']} | {d['scale_at_top5_over_median']:.2f} |" for d in diag if "norm" in d]
    return "\n".join(lines)


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--redo", action="store_true", help="run configs already in the JSON again")
    p.add_argument("--budget-min", type=float, default=None, help="start no config after this many minutes")
    p.add_argument("--max-tokens", type=int, default=1024, help="smoothing search token sample")
    p.add_argument("--diagnose", action="store_true", help="(re)measure RTN's per-linear output error")
    a = p.parse_args()
    a.fidelity = True  # every row has KL and top-1
    t0 = time.perf_counter()
    path = RESULTS / "rotation.json" if a.json is None else a.json
    keys = ("model", "nsamples", "seqlen", "max_windows", "seed")
    path = Path(path)
    old = json.loads(path.read_text()) if path.exists() and not a.redo else {}
    if old and any(old["args"][k] != getattr(a, k) for k in keys):
        theirs = {k: old["args"][k] for k in keys}
        raise SystemExit(f"error: {path} holds rows of other settings ({theirs}); use --json FILE or --redo")
    rows = {r["name"]: r for r in old.get("rows", [])}
    diag = old.get("rtn_output_error")
    sep = ";" if a.only and ";" in a.only else ","  # ';' where a name holds commas (spinquant:lr=X,batch=B)
    wanted = [c for c in CONFIGS if a.only is None or name_of(*c) in a.only.split(sep)]
    todo = [c for c in wanted if a.redo or name_of(*c) not in rows]
    b = Bench(a)

    def save() -> None:
        order = ["float", "float +hadamard"] + [name_of(*c) for c in CONFIGS]
        # then rows of another device for a same-device comparison ("NAME @cpu"), kept as they are
        out = [rows[n] for n in order if n in rows] + [r for n, r in rows.items() if n not in order]
        args = {k: getattr(a, k) for k in keys}
        out = {"protocol": protocol(args), "args": args, "rows": out, "rtn_output_error": diag}
        write_results(path, "rotation", out, markdown(out["rows"], args, diag))

    if diag is None or a.diagnose:
        diag = rtn_output_error(b)
        save()
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
    save()  # the tables again (also when nothing was left to run)


if __name__ == "__main__":
    main()
