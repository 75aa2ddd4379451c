"""Lattice-guided quantizers on SmolLM2-135M (Babai paper §5): perplexity vs bits for RTN, GPTQ
(g128, MSE scales, act-order), HRTN and HPTQ at ~2.1/3.1/4.1 bits, SSQR at 1-5% outliers, and the
per-order Babai bound table (natural / act-order / min-pivot, summed per layer kind).

Run: python -m benchmarks.lattice.lattice [--quick]     (writes benchmarks/results/lattice.json)
"""

from __future__ import annotations

from collections import defaultdict

from benchmarks.harness import Bench, base_parser

KINDS = {
    "q_proj": "QKV",
    "k_proj": "QKV",
    "v_proj": "QKV",
    "o_proj": "O",
    "gate_proj": "GateUp",
    "up_proj": "GateUp",
    "down_proj": "Down",
}


def bound_table(row: dict) -> dict:
    """Sum bound, no-clip error and trace(D) per layer kind and order (paper Table 2 layout)."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    for layer in row["layers"]:
        kind = KINDS.get(layer["name"].rsplit(".", 1)[-1], "other")
        for order, vals in layer["order_bounds"].items():
            for k, v in vals.items():
                out[order][kind][k] += v
    return {o: {k: dict(v) for k, v in kinds.items()} for o, kinds in out.items()}


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="3-bit points only (for a short run)")
    p.add_argument("--bits", default=None, help="comma list of bit-widths to run (default 2,3,4)")
    p.add_argument("--skip-ssqr", action="store_true")
    p.add_argument("--skip-bounds", action="store_true")
    a = p.parse_args()
    b = Bench(a)
    b.float_row()
    bits_list = [3] if a.quick else [int(x) for x in (a.bits or "2,3,4").split(",")]
    targets = [(bits, bits + 0.125) for bits in bits_list]
    act = {"order": "act"}
    for bits, target in targets:
        b.run(f"rtn w{bits} g128 mse", "rtn", bits=bits, group_size=128, scale="mse")
        b.run(f"gptq w{bits} g128 mse act", "gptq", bits=bits, group_size=128, scale="mse", **act)
        b.run(f"hrtn {target}", "hrtn", target_bits=target)
        b.run(f"hptq {target}", "hptq", target_bits=target, **act)
    for rate in () if a.skip_ssqr else (0.01, 0.03, 0.05):
        b.run(f"ssqr w3 g128 {rate:.0%}", "ssqr", bits=3, group_size=128, outlier_rate=rate, **act)
    name = "lattice" if not a.bits else f"lattice_w{'_'.join(map(str, bits_list))}"
    if a.skip_bounds:
        b.finish(name, ["ppl", "bits_per_weight", "quant_seconds"])
        return
    # Bound table: one more no-clip analysis pass (same static MSE scales for every order).
    import copy

    from bitmosaic.methods import get_method
    from bitmosaic.pipeline import RunSettings, quantize_model

    model = copy.deepcopy(b.model)
    spec = get_method("gptq")
    rep = quantize_model(
        model,
        b.calib,
        spec,
        spec.make_config(bits=3, group_size=128, order="act"),
        RunSettings(progress=b.progress, analyze_orders=("natural", "act", "min-pivot")),
    )
    table = bound_table(rep.to_dict())
    print("\nBabai bound / measured no-clip error / trace(D), summed per layer kind (w3 g128, MSE scales):")
    for order, kinds in table.items():
        cells = "  ".join(
            f"{k}: {v['bound']:.3g}/{v['noclip_error']:.3g}/{v['trace_D']:.3g}"
            for k, v in sorted(kinds.items())
        )
        print(f"  {order:<10} {cells}")
    b.finish(name, ["ppl", "bits_per_weight", "quant_seconds"], extra={"bound_table": table})


if __name__ == "__main__":
    main()
