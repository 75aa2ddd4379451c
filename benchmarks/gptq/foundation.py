"""Foundation numbers on SmolLM2-135M: float vs RTN vs GPTQ at 3 and 4 bits, group 128.

Run: python -m benchmarks.gptq.foundation   (writes benchmarks/results/foundation.json)
"""

from __future__ import annotations

from benchmarks.harness import Bench, base_parser


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--group-size", type=int, default=128)
    a = p.parse_args()
    b = Bench(a)
    b.float_row()
    g = a.group_size
    for bits in (4, 3):
        b.run(f"rtn w{bits} g{g}", "rtn", bits=bits, group_size=g)
        b.run(f"gptq w{bits} g{g}", "gptq", bits=bits, group_size=g)
        b.run(f"gptq w{bits} g{g} act mse", "gptq", bits=bits, group_size=g, order="act", scale="mse")
    b.finish("foundation", ["ppl", "bits_per_weight", "mean_rel_out_error", "quant_seconds"])


if __name__ == "__main__":
    main()
