"""SSQR against GPTQ on SmolLM2-135M (issue #9 §5, issue #25 §2): does SSQR beat GPTQ at equal bits?

Rows (act-order, MSE scales, g128 unless named):

- the Babai paper's GPTQ baseline (§3 and App. D.2: act-order, MSE scales "statically computed ...
  before any weight updates", g128, clipping) at 3 and 4 bits: ``gptq w{3,4} g128 act mse static``,
  the same static contiguous groups SSQR's Algorithm 9 fits; Table 3 compares SSQR-1%..5% with it;
- ours: GPTQ w3 with dynamic act-order groups (our 3-bit default) at g128, g64 and g32, whose extra
  scale bits bring it to the bits SSQR spends on its outliers;
- SSQR w3 with the paper's static groups (Algorithm 9) and with GPTQ's dynamic groups x the global
  multiplier, each at 1% and 3% outliers.

Columns: the stored bits per weight (``bits_per_weight``: what the saved model holds, zeros and
``g_idx`` included) and the paper's count (``paper_bpw``: symmetric, no zero, no ``g_idx``, 32 bits
per outlier; :func:`bitmosaic.formats.accounting.paper_storage_bits`, Table 3's 4.125 / 4.445);
perplexity, and with ``--fidelity`` KL and top-1 to the float model from the same pass; for SSQR the
per-layer no-clip overflow rate at alpha = 1 (the MSE scales before the search) as mean and max; and
per SSQR row, in how many layers its Hessian-weighted error is below each GPTQ row's.

Rows accumulate in the output JSON across ``--only`` runs of the same protocol (a row run again is
replaced; a different protocol starts the file afresh).

Run: python -m benchmarks.lattice.ssqr_groups --protocol fast --fidelity [--only NAME,NAME]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from benchmarks.harness import RESULTS, Bench, base_parser, protocol_label, write_text
from bitmosaic.formats.accounting import paper_storage_bits

ACT = {"order": "act", "scale": "mse"}
COLUMNS = ["ppl", "kl_mean", "top1_agreement", "bits_per_weight", "paper_bpw", "overflow_a1_mean",
           "overflow_a1_max", "outlier_rate", "hessian_error", "quant_seconds"]  # fmt: skip


def row_specs(rates: list[float]) -> list[tuple[str, str, dict]]:
    """(name, method, options) of every row, in the table's order."""
    static = {"group_size": 128, "static_groups": True, **ACT}
    specs = [(f"gptq w{b} g128 act mse static", "gptq", {"bits": b, **static}) for b in (3, 4)]
    specs += [
        (f"gptq w3 g{g} act mse", "gptq", {"bits": 3, "group_size": g, "static_groups": False, **ACT})
        for g in (128, 64, 32)
    ]  # fmt: skip
    for rate in rates:
        for groups in ("static", "dynamic"):
            opts = {"bits": 3, "group_size": 128, "outlier_rate": rate, "order": "act", "groups": groups}
            specs.append((f"ssqr w3 g128 {rate:.0%} {groups}", "ssqr", opts))
    return specs


def layer_stats(row: dict) -> dict:
    """The paper's bits per weight over the row's linears, SSQR's overflow at alpha = 1 (mean, max
    over layers) and its outlier density over all weights."""
    layers, opts = row["layers"], row["options"]
    n = sum(r["shape"][0] * r["shape"][1] for r in layers)
    bits, g = opts["bits"], opts["group_size"]
    paper = sum(paper_storage_bits(*r["shape"], bits, g, r.get("outliers", 0)) for r in layers)
    out = {"paper_bpw": paper / n}
    over = [r["overflow_rate_alpha1"] for r in layers if "overflow_rate_alpha1" in r]
    if over:
        out.update(overflow_a1_mean=sum(over) / len(over), overflow_a1_max=max(over))
        out["outlier_rate"] = sum(r["outliers"] for r in layers) / n
    return out


def layer_wins(rows: list[dict]) -> dict[str, dict[str, str]]:
    """Per SSQR row and GPTQ row: the layers where SSQR's Hessian-weighted error is lower, of all."""
    wins = {}
    for s in (r for r in rows if r["method"] == "ssqr"):
        for g in (r for r in rows if r["method"] == "gptq"):
            pairs = list(zip(s["layers"], g["layers"], strict=True))
            if any(a["name"] != b["name"] for a, b in pairs):
                continue
            won = sum(a["hessian_error"] < b["hessian_error"] for a, b in pairs)
            wins.setdefault(s["name"], {})[g["name"]] = f"{won} of {len(pairs)}"
    return wins


def earlier_rows(path, args) -> list[dict]:
    """The rows of an earlier run written to ``path`` with the same protocol settings (else none)."""
    if not path.is_file():
        return []
    old = json.loads(path.read_text())
    keys = ("model", "nsamples", "seqlen", "max_windows", "seed", "fidelity")
    if any(old.get("args", {}).get(k) != getattr(args, k, None) for k in keys):
        print(f"{path.name}: earlier rows have other settings; starting afresh", file=sys.stderr)
        return []
    return old.get("rows", [])


def markdown(rows: list[dict], wins: dict, args, label: str) -> str:
    head = "| config | " + " | ".join(COLUMNS) + " |"
    windows = "every window" if args.max_windows is None else f"first {args.max_windows} windows"
    lines = [
        f"# SSQR vs GPTQ on {args.model} ({label} protocol: calib {args.nsamples}x{args.seqlen}, "
        f"seed {args.seed}, WikiText-2 {windows})",
        "",
        "`bits_per_weight`: stored (zeros, g_idx included); `paper_bpw`: the Babai paper's count (symmetric, "
        "no zero, no g_idx, 32 bits per outlier); `overflow_a1_*`: per-layer share of weights off the 3-bit "
        "grid after no-clip GPTQ on the MSE scales (alpha = 1), mean and max over layers.",
        "",
        head,
        "|" + " --- |" * (len(COLUMNS) + 1),
    ]  # fmt: skip
    for r in rows:
        cells = [f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in COLUMNS]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    lines += ["", "Layers where SSQR's Hessian-weighted error is below the GPTQ row's:", ""]
    for s, per in wins.items():
        lines.append(f"- {s}: " + "; ".join(f"{g} {w}" for g, w in per.items()))
    names = ",".join(r["name"] for r in rows)
    cmd = f"python -m benchmarks.lattice.ssqr_groups --protocol {label} --fidelity --only '{names}'"
    return "\n".join(lines + ["", f"Reproduce (rows accumulate, so a few rows per run also do): `{cmd}`"])


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--rates", default="0.01,0.03", help="comma list of SSQR outlier rates")
    a = p.parse_args()
    path = RESULTS / "ssqr_groups.json" if a.json is None else Path(a.json)
    specs = row_specs([float(r) for r in a.rates.split(",")])
    b = Bench(a)
    b.float_row()
    for name, method, opts in specs:
        row = b.run(name, method, **opts)
        if row is not None:
            row.update(layer_stats(row))
    order = ["float"] + [s[0] for s in specs]
    fresh = {r["name"] for r in b.rows}
    kept = [r for r in earlier_rows(path, a) if r["name"] not in fresh]
    b.rows = sorted(kept + b.rows, key=lambda r: order.index(r["name"]) if r["name"] in order else math.inf)
    wins = layer_wins([r for r in b.rows if "layers" in r])
    b.finish("ssqr_groups", COLUMNS, extra={"layer_wins": wins})
    write_text(path.with_suffix(".md"), markdown(b.rows, wins, a, protocol_label(a)))


if __name__ == "__main__":
    main()
