"""Integer vs simulated activation compute on SmolLM2-135M: the same quantized model evaluated on the
integer kernels (the default), simulated (``$BITMOSAIC_ACT_COMPUTE=sim``), and simulated with a 1e-6
relative jitter on every quantized layer's input (the noise float32 rounding alone makes); and weight-only
models with and without run-time INT8 activations (``--runtime-act int8``, what llama.cpp does).

Protocol *fast*: 16 x 512 calibration tokens (WikiText-2 valid), perplexity on 20 windows of 512
(WikiText-2 raw test), KL to the float model and between the paths, with top-1 agreement, on the first
``--kl-windows`` of those windows.  Models: SmoothQuant W8A8 (8-bit symmetric per-channel weights, alpha
0.5, RTN), GPTQ W4A8 (4-bit g128, act-order, MSE scales: act-order runs the column-permuted path), RTN
W4A4 (4-bit g128), GPTQ W4/W3 g128 weight-only; INT activations per-token dynamic.  Target (issue 24):
W8A8 and W4A8 perplexity within 0.1% between the two paths -- compare it with the jitter column: a
quantized model amplifies float32-rounding differences (a value that lands on the other side of a
rounding boundary moves a whole quantization step downstream), so the integer path, whose per-layer
outputs equal the simulated ones to ~1e-6, is judged by its KL to the float model against the simulated
path's.  Also the whole-model wall time of the evaluation on each path.

    python benchmarks/int_ppl.py    (writes benchmarks/results/int_ppl.{json,md}; ~10 min on 2 cores)
"""

from __future__ import annotations

import contextlib
import copy
import os
import time

import torch

from bitmosaic.eval.fidelity import token_kl
from bitmosaic.formats.act import parse_scheme
from bitmosaic.methods import get_method
from bitmosaic.modules import QuantModule
from bitmosaic.modules.intact import ACT_COMPUTE_ENV, act_path_label, set_runtime_activations
from bitmosaic.pipeline import quantize_model

from common import Bench, base_parser, write_results

RUNS = {
    "smoothquant W8A8": ("smoothquant", "W8A8", {"group_size": None, "sym": True, "alpha": 0.5}),
    "gptq W4A8": ("gptq", "W4A8", {"group_size": 128, "order": "act", "scale": "mse"}),
    "rtn W4A4": ("rtn", "W4A4", {"group_size": 128}),
    # weight-only models with run-time INT8 activations (--runtime-act int8, what llama.cpp does) against
    # the same model weight-only: "int" is the run-time path, "ref" the weight-only one
    "gptq W4 + runtime A8": ("gptq", "W4A16", {"group_size": 128, "order": "act", "scale": "mse"}),
    "gptq W3 + runtime A8": ("gptq", "W3A16", {"group_size": 128, "order": "act", "scale": "mse"}),
    # the same with one scale per block of 32 channels (--runtime-act q8_0, llama.cpp's Q8_0 activations)
    "gptq W4 + runtime Q8_0": ("gptq", "W4A16", {"group_size": 128, "order": "act", "scale": "mse"}),
    "gptq W3 + runtime Q8_0": ("gptq", "W3A16", {"group_size": 128, "order": "act", "scale": "mse"}),
}


def runtime_mode(name: str) -> str | None:
    """The ``--runtime-act`` choice a row runs on its integer path (``None``: the model's own quantizer)."""
    return "q8_0" if "runtime Q8_0" in name else "int8" if "runtime A8" in name else None


JITTER = 1e-6  # relative noise on every quantized layer's input: the float32-rounding noise floor


def windows(ids: torch.Tensor, seqlen: int, n: int) -> list[torch.Tensor]:
    ids = ids.reshape(-1)  # the test set as one token stream (Bench keeps it as a 1 x N batch)
    return [ids[i * seqlen : (i + 1) * seqlen].unsqueeze(0) for i in range(min(n, ids.numel() // seqlen))]


@contextlib.contextmanager
def path(model, mode: str, runtime: str | None):
    """``int``: the integer path (for a ``runtime`` row: run-time INT8 activations); ``ref``: the simulated
    path (for a ``runtime`` row: weight-only); ``jitter``: ``ref`` with every quantized layer's input
    multiplied by ``1 + 1e-6 N(0, 1)`` (fixed seed): how far float32 rounding alone moves ``ref``."""
    hooks = []
    if runtime:
        set_runtime_activations(model, runtime if mode == "int" else "none")
    else:
        os.environ[ACT_COMPUTE_ENV] = "auto" if mode == "int" else "sim"
    if mode == "jitter":
        g = torch.Generator().manual_seed(0)

        def jitter(mod, args):
            x = args[0]
            return (x * (1 + JITTER * torch.randn(x.shape, generator=g).to(x.dtype)), *args[1:])

        quantized = [m for m in model.modules() if isinstance(m, QuantModule)]
        hooks = [m.register_forward_pre_hook(jitter, prepend=True) for m in quantized]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        os.environ.pop(ACT_COMPUTE_ENV, None)
        if runtime:
            set_runtime_activations(model, "none")


def compare(b: Bench, model, runtime: str | None) -> dict:
    """Perplexity on the three paths (:func:`path`); KL to the float model, and between the paths, with
    top-1 agreement, on the first ``--kl-windows`` windows."""
    out = {}
    modes = ("int", "ref", "jitter")
    for mode in modes:
        with path(model, mode, runtime):
            t = time.perf_counter()
            out[f"ppl_{mode}"] = b.ppl(model)
            out[f"eval_s_{mode}"] = time.perf_counter() - t
    pairs = {"float_int": ("float", "int"), "float_ref": ("float", "ref"), "ref_int": ("ref", "int"),
             "ref_jitter": ("ref", "jitter")}  # fmt: skip
    kl, agree, n = dict.fromkeys(pairs, 0.0), dict.fromkeys(pairs, 0), 0
    with torch.inference_mode():
        for w in windows(b.eval_ids, b.args.seqlen, b.args.kl_windows):
            y = {"float": b.model(w).logits[0, :-1].float()}
            for mode in modes:
                with path(model, mode, runtime):
                    y[mode] = model(w).logits[0, :-1].float()
            for k, (p, q) in pairs.items():
                kl[k] += float(token_kl(y[p], y[q]).sum())
                agree[k] += int((y[p].argmax(-1) == y[q].argmax(-1)).sum())
            n += y["float"].shape[0]
    for k in pairs:
        out[f"kl_{k}"] = kl[k] / n
        out[f"top1_{k}"] = agree[k] / n
    out["ppl_rel_diff"] = abs(out["ppl_int"] - out["ppl_ref"]) / out["ppl_ref"]
    out["ppl_rel_diff_jitter"] = abs(out["ppl_jitter"] - out["ppl_ref"]) / out["ppl_ref"]
    return out


def main() -> None:
    p = base_parser(__doc__)
    p.set_defaults(nsamples=16, max_windows=20)
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--kl-windows", type=int, default=20, help="windows for KL and top-1 (the first N)")
    a = p.parse_args()
    b = Bench(a)
    rows = []
    for name in a.runs.split(","):
        method, scheme, opts = RUNS[name]
        runtime = runtime_mode(name)
        wbits, act = parse_scheme(scheme)
        spec = get_method(method)
        cfg = spec.make_config(**opts, bits=wbits, act=act)
        model = copy.deepcopy(b.model)
        quantize_model(model, b.calib, spec, cfg, progress=False)
        if runtime:
            set_runtime_activations(model, runtime)
        paths = sorted({
            act_path_label(m.int_act_blocker(), m.act_quantizer().spec)
            for m in model.modules()
            if isinstance(m, QuantModule) and m.act_quantizer() is not None
        })  # fmt: skip
        if runtime:
            set_runtime_activations(model, "none")
        row = {"name": name, "paths": paths, **compare(b, model, runtime)}
        print(row, flush=True)
        rows.append(row)
        del model
    lines = [
        "# Integer vs simulated activation compute, SmolLM2-135M (protocol: fast)",
        "",
        f"16x512 calibration, {a.max_windows} windows of {a.seqlen} (WikiText-2 test); KL (nats per token) "
        f"and top-1 agreement on the first {a.kl_windows}. `int`: the integer path; `ref`: the simulated "
        "path (runtime rows: the same model weight-only); `jitter`: `ref` with every quantized layer's "
        f"input multiplied by 1 + {JITTER:g} N(0,1), the noise float32 rounding alone makes. "
        f'`python benchmarks/int_ppl.py --runs "{a.runs}" --kl-windows {a.kl_windows}`',
        "",
        "| model | integer path | ppl int | ppl ref | rel diff | ppl jitter | jitter rel diff "
        "| KL(float‖int) | KL(float‖ref) | top-1 float/int | top-1 float/ref | KL(ref‖int) | KL(ref‖jitter) "
        "| top-1 ref/int | top-1 ref/jitter | eval s int | eval s ref |",
        "|" + "---|" * 17,
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {', '.join(r['paths'])} | {r['ppl_int']:.3f} | {r['ppl_ref']:.3f} | "
            f"{100 * r['ppl_rel_diff']:.3f}% | {r['ppl_jitter']:.3f} | "
            f"{100 * r['ppl_rel_diff_jitter']:.3f}% | "
            f"{r['kl_float_int']:.4f} | {r['kl_float_ref']:.4f} | {100 * r['top1_float_int']:.2f}% | "
            f"{100 * r['top1_float_ref']:.2f}% | {r['kl_ref_int']:.4f} | {r['kl_ref_jitter']:.4f} | "
            f"{100 * r['top1_ref_int']:.2f}% | {100 * r['top1_ref_jitter']:.2f}% | {r['eval_s_int']:.1f} | "
            f"{r['eval_s_ref']:.1f} |"
        )
    md = "\n".join(lines)
    print(md)
    write_results(a.json, "int_ppl", {"protocol": "fast", "jitter": JITTER, "rows": rows}, md)


if __name__ == "__main__":
    main()
