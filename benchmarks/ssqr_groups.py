"""SSQR's grouping on SmolLM2-135M (issue #9 §5): does SSQR beat GPTQ at matched bits once both use the
same grouping and scale choice?

Rows (w3 g128, act-order, MSE scales): GPTQ; SSQR with the paper's static groups (Algorithm 9) and
with GPTQ's act-order dynamic groups x the global multiplier, each at 1% and 3% outliers; and GPTQ at
g64 and g32, whose extra scale bits bring it to the bits per weight SSQR spends on its outliers.

Run: python benchmarks/ssqr_groups.py        (writes benchmarks/results/ssqr_groups.json)
"""

from __future__ import annotations

from common import Bench, base_parser


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--rates", default="0.01,0.03", help="comma list of SSQR outlier rates")
    a = p.parse_args()
    b = Bench(a)
    b.float_row()
    act = {"order": "act", "scale": "mse"}
    for g in (128, 64, 32):
        b.run(f"gptq w3 g{g} act mse", "gptq", bits=3, group_size=g, **act)
    for rate in (float(r) for r in a.rates.split(",")):
        for groups in ("static", "dynamic"):
            b.run(
                f"ssqr w3 g128 {rate:.0%} {groups}",
                "ssqr",
                bits=3,
                group_size=128,
                outlier_rate=rate,
                order="act",
                groups=groups,
            )
    b.finish("ssqr_groups", ["ppl", "bits_per_weight", "quant_seconds", "hessian_error"])


if __name__ == "__main__":
    main()
