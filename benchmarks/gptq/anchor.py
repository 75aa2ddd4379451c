"""The llm-compressor reference on SmolLM2-135M (shared/data/README.md), in its own protocol:
calibration 16 x 512 from wikitext-2 valid, eval first 20 x 512 windows of wikitext-2 raw test,
GPTQ w4/w3 g64 with static act-order; plus our MSE-scale variant.

Reference: float 34.97, llm-compressor 0.14 GPTQ w4 g64 48.53, w3 g64 153.4 (114 s, 1.36 GB).
Run: python -m benchmarks.gptq.anchor   (writes benchmarks/results/anchor.json)
"""

from __future__ import annotations

from benchmarks.harness import Bench, base_parser

REFERENCE = {"float": 34.97, "gptq w4 g64": 48.53, "gptq w3 g64": 153.4}


def main() -> None:
    p = base_parser(__doc__)
    p.set_defaults(protocol="fast")  # not nsamples/max_windows: those would override --protocol verdict
    a = p.parse_args()
    b = Bench(a)
    b.float_row()
    for bits in (4, 3):
        b.run(
            f"gptq w{bits} g64 act static", "gptq", bits=bits, group_size=64, order="act", static_groups=True
        )
        b.run(f"gptq w{bits} g64 act mse", "gptq", bits=bits, group_size=64, order="act", scale="mse")
    for row in b.rows:
        key = row["name"] if row["name"] == "float" else " ".join(row["name"].split()[:3])
        row["llm_compressor_ppl"] = REFERENCE.get(key)
    b.finish("anchor", ["ppl", "llm_compressor_ppl", "bits_per_weight", "quant_seconds"])


if __name__ == "__main__":
    main()
