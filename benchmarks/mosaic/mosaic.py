"""MosaicQuant on SmolLM2-135M: perplexity against its baselines, the ablations, the budget sweep
and the block-size sensitivity (issue #13).

Parts (``--parts``, comma-separated):

* ``main``: W16A16; W4A16 RTN / GPTQ / AWQ (asymmetric g128, their usual setting); W4A8 and W4A4
  for RTN, SmoothQuant (alpha searched, RTN weights), GPTQ (act-order + MSE) and MosaicQuant, all
  four with the paper's configuration (App. C.1): per-channel symmetric 4-bit weights, per-token
  dynamic INT8 (A8) or per-group-128 INT4 with a partial last group (A4) activations.
* ``ablation`` (W4A4, 10% budget, 64x64 blocks unless the row says otherwise): no sparse branch
  with alpha re-searched / alpha kept from the full method (searched with the 10% residual), and
  selection by magnitude, residual norm, random, Δ-Hessian with a GPTQ dense base (our extension);
  the channel selections are the ``channel`` part.  It also measures ``mosaic W4A4`` (main's full
  method: Δ-Hessian, 64x64 blocks), so that its claims compare rows of one run (one protocol, one
  device); ``thin`` does the same.  Parts of one process measure that row once.
* ``oracle``: selection by the exact greedy oracle (every layer: the incremental oracle is cheap,
  but it also runs inside the alpha search, so this row is the slowest).
* ``sweep``: budgets 2.5, 5, 15, 20% (0 and 10% come from ``ablation``/``main``).
* ``blocks``: 32x32 and 128x128 blocks (64x64 is ``main``).
* ``search`` (issue 25): the alpha search over 0-1 in steps of 0.05 plus no smoothing (the
  SmoothQuant baseline's grid; ``main`` searches 0.3-1.0 in steps of 0.1), at W4A4 and W4A8.
* ``base`` (issue 73): main's W4A8 MosaicQuant taken apart -- with a GPTQ dense base, without the
  sparse branch (alpha still searched), without smoothing (the residual on RTN alone, and on GPTQ) --
  and RTN W4A8 with MSE instead of min-max scales: which part loses to GPTQ W4A8 on Gemma-3-270m.
* ``thin`` (issue 25): thin residual blocks 8x128, 16x64 and 1x128 at the 10% budget, with their
  index overhead in the bits per weight.
* ``gqa`` (issue 73): main's MosaicQuant rows with ``o_proj`` left unsmoothed under grouped-query
  attention (``fold_o_proj=False``, the method before issue 73; main's rows now fold its factors,
  shared by the query heads of a key-value head, into ``v_proj``).
* ``channel`` (issue 25): channel-level compensation at the same element budget as 10% of 64x64
  blocks, residual stored as dense columns (bits per weight = what is stored): the paper's baseline
  (§3 Observation 1, Fig. 5: outlier channels by the float input's ``max|X_j|``) and ours (columns
  by summed Δ-Hessian; it replaces the ``ablation`` part's ``channel`` row, which stored every
  64x64 block a chosen column crossed).

``--only`` runs some rows of a part; they join the part's earlier rows of the same settings in its
JSON and table (``common.merged_rows``; each row records its own options).

Activation quantization is simulated (fake-quantized inputs, float32 matmul).  Layer-level
distortion (heatmaps, distortion vs budget per criterion) is ``benchmarks/mosaic/mosaic_layers.py``;
CPU latency and memory overhead of the sparse branch is ``benchmarks/mosaic/mosaic_kernel.py``.

Run: flock /tmp/bitmosaic-heavy.lock python -m benchmarks.mosaic.mosaic --parts main --nsamples 16 \\
       --max-windows 20
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from benchmarks.harness import RESULTS, Bench, base_parser, write_text
from bitmosaic.formats.act import ActQuantSpec

A8 = ActQuantSpec("int", 8)
A4 = ActQuantSpec("int", 4, granularity="group", group_size=128)
PAPER_W = {"bits": 4, "group_size": None, "sym": True}
REFERENCE = "mosaic W4A4"  # main's W4A4 MosaicQuant row (10%, 64x64 blocks, Δ-Hessian): the comparator


def part_runs(part: str, max_tokens: int) -> list[tuple[str, str, str, dict]]:
    sq = {"alpha": None, "max_tokens": max_tokens, **PAPER_W}
    gptq = {"order": "act", "scale": "mse", **PAPER_W}
    mos = {"max_tokens": max_tokens}
    if part == "main":
        runs = [
            ("rtn W4A16 g128", "W4A16", "rtn", {}),
            ("gptq W4A16 g128", "W4A16", "gptq", {"order": "act", "scale": "mse"}),
            ("awq W4A16 g128", "W4A16", "awq", {}),
        ]
        for scheme, act in (("W4A8", A8), ("W4A4", A4)):
            runs += [
                (f"rtn {scheme}", scheme, "rtn", {**PAPER_W, "act": act}),
                (f"smoothquant {scheme}", scheme, "smoothquant", {**sq, "act": act}),
                (f"gptq {scheme}", scheme, "gptq", {**gptq, "act": act}),
                (f"mosaic {scheme}", scheme, "mosaic", {**mos, "act": act}),
            ]
        return runs
    w4a4 = {**mos, "act": A4}
    # main's full method, measured again inside the parts whose claims compare against it, so each
    # such run (a verdict run on one device, say) holds its own comparator; once per process
    ref = [(REFERENCE, "W4A4", "mosaic", w4a4)]
    if part == "ablation":  # most telling first: a run cut short keeps these
        return ref + [
            ("no sparse, alpha re-searched", "W4A4", "mosaic", {**w4a4, "budget_frac": 0.0}),
            ("Δ-Hessian, GPTQ base (ours)", "W4A4", "mosaic", {**w4a4, "solver": "gptq"}),
            ("random", "W4A4", "mosaic", {**w4a4, "selection": "random"}),
            ("magnitude", "W4A4", "mosaic", {**w4a4, "selection": "magnitude"}),
            ("residual norm", "W4A4", "mosaic", {**w4a4, "selection": "residual-norm"}),
            ("no sparse, alpha kept", "W4A4", "mosaic", {**w4a4, "budget_frac": 0.0, "search_budget": 0.1}),
        ]
    if part == "oracle":
        return [("oracle (greedy, exact)", "W4A4", "mosaic", {**w4a4, "selection": "oracle"})]
    if part == "sweep":
        fracs = (0.025, 0.05, 0.15, 0.2)
        return [(f"budget {b:g}", "W4A4", "mosaic", {**w4a4, "budget_frac": b}) for b in fracs]
    if part == "blocks":
        return [(f"block {b}", "W4A4", "mosaic", {**w4a4, "block": b}) for b in ("32x32", "128x128")]
    if part == "search":
        wide = {"alpha_grid": tuple(round(0.05 * i, 2) for i in range(21)), "try_no_smooth": True}
        return [
            ("alpha 0-1/0.05 + none", "W4A4", "mosaic", {**w4a4, **wide}),
            ("alpha 0-1/0.05 + none W4A8", "W4A8", "mosaic", {**mos, "act": A8, **wide}),
        ]
    if part == "channel":
        return [
            ("channel (paper: outlier max|X|)", "W4A4", "mosaic", {**w4a4, "selection": "channel-act"}),
            ("channel (ours: Δ-Hessian columns)", "W4A4", "mosaic", {**w4a4, "selection": "channel"}),
        ]
    if part == "gqa":  # issue 73: main's rows as before, o_proj left unsmoothed under GQA (main folds it now)
        off = {"fold_o_proj": False}
        return [
            ("mosaic W4A8 o_proj unsmoothed", "W4A8", "mosaic", {**mos, "act": A8, **off}),
            ("mosaic W4A4 o_proj unsmoothed", "W4A4", "mosaic", {**w4a4, **off}),
        ]
    if part == "base":  # issue 73 item 3: which part of MosaicQuant W4A8 loses to GPTQ W4A8 (Gemma-3-270m)
        a8 = {**mos, "act": A8}
        off = {"smooth": False}
        return [
            ("mosaic W4A8 GPTQ base", "W4A8", "mosaic", {**a8, "solver": "gptq"}),
            ("mosaic W4A8 no sparse", "W4A8", "mosaic", {**a8, "budget_frac": 0.0}),
            ("mosaic W4A8 no smoothing", "W4A8", "mosaic", {**a8, **off}),
            ("mosaic W4A8 GPTQ base no smoothing", "W4A8", "mosaic", {**a8, "solver": "gptq", **off}),
            ("rtn W4A8 mse", "W4A8", "rtn", {**PAPER_W, "act": A8, "scale": "mse"}),
        ]
    if part == "thin":
        return ref + [
            (f"block {b}", "W4A4", "mosaic", {**w4a4, "block": b}) for b in ("8x128", "16x64", "1x128")
        ]
    parts = "main, ablation, oracle, sweep, blocks, search, thin, channel, gqa, base"
    raise SystemExit(f"unknown part {part!r}; use {parts}")


def _summary(row: dict) -> dict:
    layers = row.pop("layers", [])
    out = {}
    rec = [r["recovered"] for r in layers if "recovered" in r]
    if rec:
        out["mean_recovered"] = sum(rec) / len(rec)
        out["blocks_fraction"] = sum(r["blocks_selected"] for r in layers) / sum(
            r["blocks_total"] for r in layers
        )
    alphas = [r["transform"]["alpha"] for r in layers if r.get("transform", {}).get("alpha") is not None]
    if alphas:
        out["mean_alpha"] = sum(alphas) / len(alphas)
        out["alphas"] = alphas
    none = sum(1 for r in layers if "no smoothing" in str(r.get("transform", {}).get("reason", "")))
    if none:
        out["no_smoothing_linears"] = none  # linears whose group's search kept s = 1
    return out


def write_table(path: Path, cols: list[str], a, part: str) -> None:
    """The Markdown table beside the JSON at ``path``: every row the JSON holds (an ``--only`` run's
    joined to the earlier ones), with the command that reproduces it."""
    rows = json.loads(path.read_text())["rows"]
    lines = [f"| config | {' | '.join(cols)} |", "|---" * (len(cols) + 1) + "|"]
    for r in rows:
        cells = [f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols]
        lines.append(f"| {r['name'].replace('|', chr(92) + '|')} | {' | '.join(cells)} |")
    windows = "every window" if a.max_windows is None else f"the first {a.max_windows} windows"
    flags = f"--nsamples {a.nsamples} --max-windows {a.max_windows}"
    flags = f"--protocol {a.protocol}" if a.protocol else flags
    flags += f" --seed {a.seed}" if a.seed else ""
    head = (
        f"{a.model}, calib {a.nsamples}x{a.seqlen} seed {a.seed}, WikiText-2 ppl on {windows} of "
        f"{a.seqlen}; `python -m benchmarks.mosaic.mosaic --parts {part} {flags}` (a row alone: "
        "`--only NAME`)\n\n"
    )
    write_text(path.with_suffix(".md"), head + "\n".join(lines) + "\n")


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--parts", default="main")
    p.add_argument("--max-tokens", type=int, default=1024, help="alpha-search token sample")
    a = p.parse_args()
    parts = a.parts.split(",")
    if a.json and len(parts) > 1:
        p.error("--json names one file: give one part with it (e.g. --parts main)")
    out_json = a.json
    b = Bench(a)
    measured: dict[str, dict] = {}  # the reference row, shared by the parts of one process that carry it
    b.offer(n for part in parts for n, *_ in part_runs(part, a.max_tokens))
    for part in parts:
        b.rows = []
        b.partial_path = RESULTS / f"mosaic_{part}.partial.json"
        if part == "main":
            if (row := b.float_row()) is not None:
                row["scheme"] = "W16A16"
        for name, scheme, method, opts in part_runs(part, a.max_tokens):
            if not b.wants(name):
                continue
            if name in measured:  # same name, same options, same process: the same model
                b._add(copy.deepcopy(measured[name]))
                continue
            row = b.run(name, method, **opts)
            row["scheme"] = scheme
            row.update(_summary(row))
            if name == REFERENCE:
                measured[name] = copy.deepcopy(row)
            if "mean_recovered" in row:
                print(
                    f"      recovered {row['mean_recovered']:.3f}  mean alpha {row.get('mean_alpha')}",
                    flush=True,
                )
        cols = ["scheme", "ppl", "bits_per_weight", "mean_recovered", "mean_alpha", "quant_seconds"]
        if a.fidelity:  # KL and top-1 to the float model, from the same pass
            cols[2:2] = ["kl_mean", "top1_agreement"]
        b.args.json = out_json or str(RESULTS / f"mosaic_{part}.json")
        b.finish(f"mosaic_{part}", cols)  # with --only: joined to the part's earlier rows (common.py)
        write_table(Path(b.args.json), cols, a, part)
        (RESULTS / f"mosaic_{part}.partial.json").unlink(missing_ok=True)
        print(json.dumps({"part": part, "rows": len(b.rows)}))


if __name__ == "__main__":
    main()
