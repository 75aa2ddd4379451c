"""Weight-activation quantization baselines on SmolLM2-135M: RTN / GPTQ / SmoothQuant / AWQ at
W4A16, W8A8, W4A8 (INT8 and FP8 E4M3 activations) and W4A4.

Settings: 4-bit weights asymmetric g128, 8-bit weights symmetric per-channel; INT activations
symmetric per-token dynamic; FP8 activations per-tensor static (calibrated max).  GPTQ uses
act-order + MSE scales, SmoothQuant searches alpha per group (RTN weights, as in the paper; a
"+gptq" row adds GPTQ weights), AWQ searches its scales and clipping.  Activation quantization
is simulated (fake quantization, float32 matmul; see ``bitmosaic.formats.act``).

Run: python -m benchmarks.waq.waq   (writes benchmarks/results/waq.json; ~35 min on 2 cores)
"""

from __future__ import annotations

from benchmarks.harness import RESULTS, Bench, base_parser
from bitmosaic.formats.act import parse_scheme

SCHEMES = ("W4A16", "W8A8", "W4A8", "W4A8-FP8", "W4A4")
METHODS = {
    "rtn": ("rtn", {}),
    "gptq": ("gptq", {"order": "act", "scale": "mse"}),
    "smoothquant": ("smoothquant", {"alpha": None}),
    "awq": ("awq", {}),
    "smoothquant+gptq": (
        "smoothquant",
        {"alpha": None, "solver": "gptq", "order": "act", "scale": "mse"},
    ),
}


def weight_options(bits: int) -> dict:
    return {"group_size": None, "sym": True} if bits == 8 else {"group_size": 128}


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--methods", default="rtn,gptq,smoothquant,awq")
    p.add_argument(
        "--extra", default="smoothquant+gptq:W4A8,smoothquant+gptq:W4A4", help="method:scheme pairs"
    )
    p.add_argument("--max-tokens", type=int, default=1024, help="smoothquant alpha-search token sample")
    a = p.parse_args()
    b = Bench(a)
    b.partial_path = RESULTS / "waq.partial.json"
    if (row := b.float_row()) is not None:
        row["scheme"] = "float"
    runs = [(m, s) for s in a.schemes.split(",") for m in a.methods.split(",")]
    runs += [tuple(x.split(":")) for x in a.extra.split(",") if x]
    for label, scheme in runs:
        method, opts = METHODS[label]
        wbits, act = parse_scheme(scheme)
        opts = {**opts, **weight_options(wbits), "bits": wbits, "act": act}
        if method == "smoothquant":
            opts["max_tokens"] = a.max_tokens
        row = b.run(f"{label} {scheme}", method, **opts)
        row["scheme"], row["label"] = scheme, label
        row.pop("layers", None)  # keep the JSON small: per-layer reports are in `bitmosaic quantize --json`
    labels = list(dict.fromkeys(r["label"] for r in b.rows if "label" in r))
    schemes = list(dict.fromkeys(r["scheme"] for r in b.rows if "label" in r))
    table = {lab: {r["scheme"]: r["ppl"] for r in b.rows if r.get("label") == lab} for lab in labels}
    print(f"\nperplexity (float {b.rows[0]['ppl']:.2f})")
    print(f"{'method':<20}" + "".join(f"{s:>12}" for s in schemes))
    for lab in labels:
        print(f"{lab:<20}" + "".join(f"{table[lab].get(s, float('nan')):>12.2f}" for s in schemes))
    b.finish("waq", ["scheme", "ppl", "bits_per_weight", "quant_seconds"], extra={"table": table})


if __name__ == "__main__":
    main()
