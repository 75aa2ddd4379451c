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
path's.  Each row also gives ``ppl_int / ppl_ref - 1`` with a 95% interval over the windows (every
window's mean-NLL difference is one paired sample): on 20 windows that interval is wider than 0.1%, so the
target is judged on the whole test set.  Also the whole-model wall time of the evaluation on each path.

    python -m benchmarks.waq.int_ppl    (writes benchmarks/results/int_ppl.{json,md}; ~10 min on 2 cores)
    python -m benchmarks.waq.int_ppl --runs "smoothquant W8A8,gptq W4A8" --max-windows 0 \
        --no-jitter --json benchmarks/results/int_ppl_full.json    (every test window: 13-16 min a row)
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import time

import torch

from benchmarks.harness import Bench, base_parser, protocol_label, write_results
from bitmosaic.data import bos_token_id
from bitmosaic.eval.fidelity import token_kl
from bitmosaic.eval.perplexity import eval_windows, window_nll
from bitmosaic.formats.act import parse_scheme
from bitmosaic.methods import get_method
from bitmosaic.modules import QuantModule
from bitmosaic.modules.intact import ACT_COMPUTE_ENV, act_path_label, set_runtime_activations
from bitmosaic.pipeline import RunSettings, quantize_model

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
    # 16 bits per token, two int8 halves on the integer kernel (--runtime-act int16)
    "gptq W4 + runtime A16": ("gptq", "W4A16", {"group_size": 128, "order": "act", "scale": "mse"}),
}


def runtime_mode(name: str) -> str | None:
    """The ``--runtime-act`` choice a row runs on its integer path (``None``: the model's own quantizer)."""
    if "runtime A16" in name:
        return "int16"
    return "q8_0" if "runtime Q8_0" in name else "int8" if "runtime A8" in name else None


MODES = ("int", "ref", "jitter")
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


def paired_ratio(nll_int: torch.Tensor, nll_ref: torch.Tensor) -> dict:
    """ppl_int / ppl_ref - 1 with a 95% interval from the windows: each window's mean-NLL difference is
    one paired sample (the windows share their text), so the interval is how far the whole test set's
    ratio could sit from 0 given how much it moves window to window (normal approximation)."""
    d = (nll_int - nll_ref).double()
    mean, se = float(d.mean()), float(d.std()) / math.sqrt(d.numel()) if d.numel() > 1 else math.inf
    return {
        "ppl_ratio_minus_1": math.expm1(mean),
        "ppl_ratio_ci95": [math.expm1(mean - 1.96 * se), math.expm1(mean + 1.96 * se)],
    }


def compare(b: Bench, model, runtime: str | None, modes: tuple[str, ...] = MODES) -> dict:
    """Perplexity on the paths ``modes`` (:func:`path`; ``int`` and ``ref`` always); KL to the float model,
    and between the paths, with top-1 agreement, on the first ``--kl-windows`` windows."""
    out, nll = {}, {}
    ids = eval_windows(b.eval_ids, b.args.seqlen, b.args.max_windows, bos_token_id(b.tok))
    scored = ids.shape[1] - 1  # predicted tokens per window
    for mode in modes:
        with path(model, mode, runtime), torch.inference_mode():
            t = time.perf_counter()
            nll[mode] = torch.cat([window_nll(model, w.unsqueeze(0))[0] for w in ids]) / scored
            out[f"ppl_{mode}"] = math.exp(float(nll[mode].mean()))  # what perplexity() gives, batch 1
            out[f"eval_s_{mode}"] = time.perf_counter() - t
    out.update(paired_ratio(nll["int"], nll["ref"]))
    pairs = {"float_int": ("float", "int"), "float_ref": ("float", "ref"), "ref_int": ("ref", "int"),
             "ref_jitter": ("ref", "jitter")}  # fmt: skip
    pairs = {k: v for k, v in pairs.items() if v[1] in modes}
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
    if "jitter" in modes:
        out["ppl_rel_diff_jitter"] = abs(out["ppl_jitter"] - out["ppl_ref"]) / out["ppl_ref"]
    return out


def main() -> None:
    p = base_parser(__doc__)
    p.set_defaults(protocol="fast")  # not nsamples/max_windows: those would override --protocol verdict
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--kl-windows", type=int, default=20, help="windows for KL and top-1 (the first N)")
    p.add_argument(
        "--no-jitter", action="store_true",
        help="leave out the jitter path (a third of the time; its noise floor is in int_ppl.md)",
    )  # fmt: skip
    a = p.parse_args()
    modes = MODES[:2] if a.no_jitter else MODES
    b = Bench(a)
    rows = []
    for name in a.runs.split(","):
        method, scheme, opts = RUNS[name]
        runtime = runtime_mode(name)
        wbits, act = parse_scheme(scheme)
        spec = get_method(method)
        cfg = spec.make_config(**opts, bits=wbits, act=act)
        model = copy.deepcopy(b.model)
        quantize_model(model, b.calib, spec, cfg, RunSettings(progress=b.progress))
        if runtime:
            set_runtime_activations(model, runtime)
        paths = sorted({
            act_path_label(m.int_act_blocker(), m.act_quantizer().spec)
            for m in model.modules()
            if isinstance(m, QuantModule) and m.act_quantizer() is not None
        })  # fmt: skip
        if runtime:
            set_runtime_activations(model, "none")
        row = {"name": name, "paths": paths, **compare(b, model, runtime, modes)}
        print(row, flush=True)
        rows.append(row)
        del model
    label = protocol_label(a)
    windows_ = "every window" if a.max_windows is None else f"{a.max_windows} windows"
    cmd = f'`python -m benchmarks.waq.int_ppl --runs "{a.runs}" --kl-windows {a.kl_windows}'
    if label != "fast":
        cmd += f" --nsamples {a.nsamples} --max-windows {a.max_windows or 0}"
    cmd += " --no-jitter`" if a.no_jitter else "`"
    lines = [
        f"# Integer vs simulated activation compute, SmolLM2-135M (protocol: {label})",
        "",
        f"{a.nsamples}x{a.seqlen} calibration, {windows_} of {a.seqlen} (WikiText-2 test); KL (nats per "
        f"token) and top-1 agreement on the first {a.kl_windows}. `int`: the integer path; `ref`: the "
        "simulated path (runtime rows: the same model weight-only); `jitter`: `ref` with every quantized "
        f"layer's input multiplied by 1 + {JITTER:g} N(0,1), the noise float32 rounding alone makes. " + cmd,
        "",
        "| model | integer path | ppl int | ppl ref | rel diff | int/ref - 1, 95% CI | ppl jitter "
        "| jitter rel diff | KL(float‖int) | KL(float‖ref) | top-1 float/int | top-1 float/ref | KL(ref‖int) "
        "| KL(ref‖jitter) | top-1 ref/int | top-1 ref/jitter | eval s int | eval s ref |",
        "|" + "---|" * 18,
    ]

    def cell(r: dict, key: str, spec: str, scale: float = 1.0, unit: str = "") -> str:
        if key == "ci":  # the 95% interval of ppl_int / ppl_ref - 1 over the windows
            lo, hi = r.get("ppl_ratio_ci95", (math.nan, math.nan))
            return f"[{100 * lo:+.3f}%, {100 * hi:+.3f}%]"
        return "n/a" if key not in r else f"{scale * r[key]:{spec}}{unit}"  # n/a: the path was left out

    pct = (".2f", 100, "%")
    cols = [("ppl_int", ".3f"), ("ppl_ref", ".3f"), ("ppl_rel_diff", ".3f", 100, "%"), ("ci", ""),
            ("ppl_jitter", ".3f"), ("ppl_rel_diff_jitter", ".3f", 100, "%"), ("kl_float_int", ".4f"),
            ("kl_float_ref", ".4f"), ("top1_float_int", *pct), ("top1_float_ref", *pct),
            ("kl_ref_int", ".4f"),
            ("kl_ref_jitter", ".4f"), ("top1_ref_int", *pct), ("top1_ref_jitter", *pct),
            ("eval_s_int", ".1f"), ("eval_s_ref", ".1f")]  # fmt: skip
    for r in rows:
        cells = [r["name"], ", ".join(r["paths"]), *(cell(r, *c) for c in cols)]
        lines.append("| " + " | ".join(cells) + " |")
    md = "\n".join(lines)
    print(md)
    out = {"protocol": label, "nsamples": a.nsamples, "max_windows": a.max_windows, "jitter": JITTER}
    out["rows"] = rows
    write_results(a.json, "int_ppl", out, md)


if __name__ == "__main__":
    main()
