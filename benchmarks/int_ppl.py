"""Integer vs simulated activation compute on SmolLM2-135M: the same quantized model evaluated twice,
once on the integer kernels (the default) and once simulated (``$BITMOSAIC_ACT_COMPUTE=sim``).

Protocol *fast*: 16 x 512 calibration tokens (WikiText-2 valid), perplexity on 20 windows of 512
(WikiText-2 raw test), plus the KL of the integer model's next-token distribution to the simulated one's
and their top-1 agreement on the first ``--kl-windows`` of those windows.  Models: SmoothQuant W8A8
(8-bit symmetric per-channel weights, alpha 0.5, RTN), GPTQ W4A8 (4-bit g128, act-order, MSE scales:
act-order runs the column-permuted path) and RTN W4A4 (4-bit g128); INT activations per-token dynamic.
Target (issue 24): W8A8 and W4A8 perplexity within 0.1% between the two paths.  Also the whole-model
wall time of the evaluation on each path.

    python benchmarks/int_ppl.py    (writes benchmarks/results/int_ppl.{json,md}; ~10 min on 2 cores)
"""

from __future__ import annotations

import copy
import os
import time

import torch

from bitmosaic.eval.fidelity import token_kl
from bitmosaic.formats.act import parse_scheme
from bitmosaic.methods import get_method
from bitmosaic.modules import QuantModule
from bitmosaic.modules.intact import ACT_COMPUTE_ENV, act_path_label
from bitmosaic.pipeline import quantize_model

from common import Bench, base_parser, write_results

RUNS = {
    "smoothquant W8A8": ("smoothquant", "W8A8", {"group_size": None, "symmetric": True, "alpha": 0.5}),
    "gptq W4A8": ("gptq", "W4A8", {"group_size": 128, "order": "act", "scale": "mse"}),
    "rtn W4A4": ("rtn", "W4A4", {"group_size": 128}),
}


def windows(ids: torch.Tensor, seqlen: int, n: int) -> list[torch.Tensor]:
    return [ids[i * seqlen : (i + 1) * seqlen].unsqueeze(0) for i in range(min(n, ids.numel() // seqlen))]


def compare(b: Bench, model) -> dict:
    """Perplexity on both paths, KL(sim || int) and top-1 agreement on the same windows."""
    out = {}
    for mode in ("int", "sim"):
        os.environ[ACT_COMPUTE_ENV] = "sim" if mode == "sim" else "auto"
        t = time.perf_counter()
        out[f"ppl_{mode}"] = b.ppl(model)
        out[f"eval_s_{mode}"] = time.perf_counter() - t
    os.environ.pop(ACT_COMPUTE_ENV, None)
    kl, agree, n = 0.0, 0, 0
    with torch.inference_mode():
        for w in windows(b.eval_ids, b.args.seqlen, b.args.kl_windows):
            y_int = model(w).logits[0, :-1].float()
            os.environ[ACT_COMPUTE_ENV] = "sim"
            y_sim = model(w).logits[0, :-1].float()
            os.environ.pop(ACT_COMPUTE_ENV, None)
            kl += float(token_kl(y_sim, y_int).sum())
            agree += int((y_sim.argmax(-1) == y_int.argmax(-1)).sum())
            n += y_int.shape[0]
    out["kl_sim_to_int"] = kl / n
    out["top1_agreement"] = agree / n
    out["ppl_rel_diff"] = abs(out["ppl_int"] - out["ppl_sim"]) / out["ppl_sim"]
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
        wbits, act = parse_scheme(scheme)
        spec = get_method(method)
        cfg = spec.make_config(**opts, bits=wbits, act=act)
        model = copy.deepcopy(b.model)
        quantize_model(model, b.calib, spec, cfg, progress=False)
        paths = sorted({
            act_path_label(m.int_act_blocker(), m.input_quant.spec)
            for m in model.modules()
            if isinstance(m, QuantModule) and m._modules.get("input_quant") is not None
        })  # fmt: skip
        row = {"name": name, "paths": paths, **compare(b, model)}
        print(row, flush=True)
        rows.append(row)
        del model
    lines = [
        "# Integer vs simulated activation compute, SmolLM2-135M (protocol: fast)",
        "",
        f"16x512 calibration, {a.max_windows} windows of {a.seqlen} (WikiText-2 test); KL and top-1 on the "
        f"first {a.kl_windows}. "
        f"`python benchmarks/int_ppl.py --runs \"{a.runs}\" --kl-windows {a.kl_windows}`",
        "",
        "| model | integer path | ppl int | ppl sim | rel diff | target < 0.1% | KL(sim‖int) | top-1 agree "
        "| eval s int | eval s sim |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        target = "met" if r["ppl_rel_diff"] < 1e-3 else "NOT met"
        target = target if "A4" not in r["name"] else f"({target}; no target)"
        lines.append(
            f"| {r['name']} | {', '.join(r['paths'])} | {r['ppl_int']:.4f} | {r['ppl_sim']:.4f} | "
            f"{100 * r['ppl_rel_diff']:.4f}% | {target} | {r['kl_sim_to_int']:.2e} | "
            f"{100 * r['top1_agreement']:.2f}% | {r['eval_s_int']:.1f} | {r['eval_s_sim']:.1f} |"
        )
    md = "\n".join(lines)
    print(md)
    write_results(a.json, "int_ppl", {"protocol": "fast", "rows": rows}, md)


if __name__ == "__main__":
    main()
