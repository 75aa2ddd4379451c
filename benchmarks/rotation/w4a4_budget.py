"""Where rotated W4A4 loses on SmolLM2-135M: the error budget of issue 25's goal (GPTQ W4A4 with a
Hadamard rotation within 1.5x of float perplexity), split by what is quantized.

One QuaRot-rotated model (``--rotate hadamard``: R1, R2 per head, online Hadamards at the o_proj and
down_proj inputs), evaluated with its activation quantizers swapped between evaluations (the weights
stay as they are; activations simulated, ``$BITMOSAIC_ACT_COMPUTE=sim``, the same quantized values the
integer kernels compute):

- *float weights*: the rotated float model with activation quantizers only -- what the activations
  alone cost: A4 per token with QuaRot's clip ratio 0.9, A4 per group of 64 (clip 0.9), and that with
  8-bit activations at the inputs of one kind of linear (q/k/v, gate/up), A8 per token.
- *GPTQ W4*: 4-bit symmetric per-channel GPTQ weights (act-order, MSE scales; ``rotation.py``'s
  setting), quantized once with A4 g64 clip 0.9 activations: that setting, 8-bit activations at one
  kind of linear's inputs, other clip ratios, groups of 32 and 128, and A8 everywhere.

The *fast* protocol by default (16x512 calibration, the first 20 test windows, KL and top-1 to the
float model on the same windows).  Run: ``python -m benchmarks.rotation.w4a4_budget [--protocol fast]``
(about 10 minutes on 2 cores); writes ``results/w4a4_budget.{md,json}``.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import replace

import torch

from benchmarks.harness import Bench, base_parser, protocol_label, write_results
from bitmosaic.formats.act import ActQuantSpec
from bitmosaic.models.arch import get_arch
from bitmosaic.modules.actquant import ActQuantizer, attach_input_quant
from bitmosaic.pipeline import RunSettings, quantize_model
from bitmosaic.pipeline.recipe import Recipe
from bitmosaic.pipeline.rotate import rotate_model

G64 = ActQuantSpec("int", 4, granularity="group", group_size=64, clip_ratio=0.9)
QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
KINDS = {"q/k/v": QKV, "o_proj": ("o_proj",), "gate/up": GATE_UP, "down_proj": ("down_proj",)}


def a8_at(kind: tuple[str, ...]):
    """A4 g64 clip 0.9 everywhere but 8-bit at the inputs of the linears named ``kind``."""
    return lambda name: replace(G64, bits=8) if name.endswith(kind) else G64


FLOAT_ROWS = [
    ("A8 per token", lambda n: ActQuantSpec("int", 8)),
    ("A4 per token, clip 0.9 (QuaRot's)", lambda n: ActQuantSpec("int", 4, clip_ratio=0.9)),
    ("A4 g64, clip 0.9", lambda n: G64),
    ("A4 g64, clip 0.9; A8 at q/k/v", a8_at(QKV)),
    ("A4 g64, clip 0.9; A8 at gate/up", a8_at(GATE_UP)),
]
GPTQ_ROWS = [
    ("A4 g64, clip 0.9", lambda n: G64),
    *[(f"A4 g64, clip 0.9; A8 at {k}", a8_at(v)) for k, v in KINDS.items()],
    *[(f"A4 g64, clip {c}", lambda n, c=c: replace(G64, clip_ratio=c)) for c in (0.8, 0.85, 0.95, 1.0)],
    ("A4 g32, clip 0.9", lambda n: replace(G64, group_size=32)),
    ("A4 g128, clip 0.9", lambda n: replace(G64, group_size=128)),
    ("A8 per token", lambda n: ActQuantSpec("int", 8)),
]


def rows_of(b: Bench, model, weights: str, variants) -> list[dict]:
    quants = {
        n: m for n, m in model.named_modules() if isinstance(getattr(m, "input_quant", None), ActQuantizer)
    }
    out = []
    for label, spec_of in variants:
        for name, m in quants.items():
            m.input_quant.spec = spec_of(name)
        t = time.perf_counter()
        r = b.measure(model)
        row = {"weights": weights, "acts": label, **r, "eval_seconds": time.perf_counter() - t}
        print(f"  {weights:<14} {label:<36} ppl {r['ppl']:8.3f}  KL {r['kl_mean']:.4f}  "
              f"top-1 {r['top1_agreement']:.4f}", flush=True)  # fmt: skip
        out.append(row)
    return out


def markdown(out: dict) -> str:
    a, fl = out["args"], out["float_ppl"]
    windows = f"the first {a['max_windows']}" if a["max_windows"] else "every"
    how = f" --protocol {out['protocol']}" if out["protocol"] != "custom" else ""
    lines = [
        f"SmolLM2-135M, *{out['protocol']}* protocol (calibration {a['nsamples']}x{a['seqlen']}, seed "
        f"{a['seed']}; WikiText-2 test, {windows} windows of 512; KL and top-1 to the float model on the "
        "same windows). One Hadamard-rotated model (QuaRot: R1, R2, online Hadamards at o_proj and "
        "down_proj), its activation quantizers swapped between evaluations; activations simulated (the "
        "integer kernels' values). GPTQ W4: symmetric per channel, act-order, MSE scales, quantized once "
        f"with A4 g64 clip 0.9. Reproduce: `python -m benchmarks.rotation.w4a4_budget{how}`",
        "",
        f"Float (unrotated, unquantized): {fl:.2f}; the goal, 1.5x float: {1.5 * fl:.2f}.",
        "",
        "| weights | activations | ppl | ppl / float | KL | top-1 |",
        "|---|---|---:|---:|---:|---:|",
    ]  # fmt: skip
    for r in out["rows"]:
        lines.append(f"| {r['weights']} | {r['acts']} | {r['ppl']:.2f} | {r['ppl'] / fl:.2f} | "
                     f"{r['kl_mean']:.4f} | {r['top1_agreement']:.4f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = base_parser(__doc__)
    a = p.parse_args()
    a.fidelity = True
    os.environ["BITMOSAIC_ACT_COMPUTE"] = "sim"  # swapped specs: no integer kernel built for the first one
    b = Bench(a)
    flt = b.measure(b.model)
    model = copy.deepcopy(b.model)
    rotate_model(model, get_arch(model), "hadamard", a.seed)
    for layer in get_arch(model).layers(model):
        for m in layer.modules():
            if isinstance(m, torch.nn.Linear):
                attach_input_quant(m, G64, m.in_features)
    rows = rows_of(b, model, "float", FLOAT_ROWS)
    del model
    opts = {"bits": 4, "group_size": None, "sym": True, "order": "act", "scale": "mse", "act": G64}
    recipe = Recipe.from_options("gptq", opts, rotate="hadamard")
    model = copy.deepcopy(b.model)
    rep = quantize_model(model, b.calib, recipe, None, RunSettings(progress=b.progress, seed=a.seed))
    rows += rows_of(b, model, "GPTQ W4", GPTQ_ROWS)
    args = {k: getattr(a, k) for k in ("model", "nsamples", "seqlen", "max_windows", "seed")}
    out = {"protocol": protocol_label(a), "args": args, "float_ppl": flt["ppl"],
           "gptq_quant_seconds": rep.seconds, "rows": rows}  # fmt: skip
    write_results(a.json, "w4a4_budget", out, markdown(out))


if __name__ == "__main__":
    main()
