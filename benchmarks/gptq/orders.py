"""Quantization orders on SmolLM2-135M: natural vs act-order vs GAR vs min-pivot (GPTQ, g128).

Run: python -m benchmarks.gptq.orders [--bits 3] [--max-windows 40]
Prints perplexity, total Hessian error, the summed no-clip Babai bound and time per order, and
writes benchmarks/results/orders.json.
"""

from __future__ import annotations

from benchmarks.harness import Bench, base_parser


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--orders", default="natural,act,gar,min-pivot")
    a = p.parse_args()
    b = Bench(a)
    b.float_row()
    for order in a.orders.split(","):
        b.run(
            f"gptq w{a.bits} g{a.group_size} {order}",
            "gptq",
            bits=a.bits,
            group_size=a.group_size,
            order=order,
        )
    b.finish(f"orders_w{a.bits}", ["ppl", "bits_per_weight", "hessian_error", "babai_bound", "quant_seconds"])


if __name__ == "__main__":
    main()
