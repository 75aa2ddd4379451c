"""SFMP (issue #12) on SmolLM2-135M: perplexity at matched memory against uniform GPTQ and AWQ.

Pairings (the paper's Table 3, plus 2.5/3.5/4.25): at each point the uniform baselines are run
first and SFMP gets the *smaller* of their two *measured* totals of bits per weight (``bpw``: codes +
scales/zeros + permutations + bit map all counted; GPTQ's act-order ``g_idx`` makes it store more than
AWQ), so SFMP never stores more bits than either baseline (checked on every SFMP row):

=====  ==========================  ==========
point  uniform GPTQ / AWQ          SFMP group
=====  ==========================  ==========
2.5    w2 g64                      g128
3.0    w3 per-channel              g128
3.25   w3 g128                     g256
3.5    w3 g64                      g128
4.0    w4 per-channel              g128
4.25   w4 g128                     g256
=====  ==========================  ==========

Parts: ``main`` (the table above, SFMP with AWQ and with GPTQ blocks), ``reorder`` (none / row /
column / both), ``blocks`` (m_b in {32, 64, 512} at n_b = 128, n_b in {64, 128, 256}), ``fisher``
(Fisher from fewer/more samples).  The Fisher salience is computed once per token set and cached.
Results accumulate in ``benchmarks/results/sfmp.partial.json`` (a re-run skips rows already there;
an SFMP row whose budget no longer matches its baselines runs again), so the parts can run one at a
time under the shared lock; ``--report`` prints the tables, writes ``sfmp.json``/``sfmp.md`` and the
allocation PNG.

Part ``decode`` (on its own: it writes ``sfmp_decode.json``/``.md``, nothing else) measures the
end-to-end decode cost of reordering (the paper reports at most 5%): see :func:`decode_reorder_cost`.

Run: flock /tmp/bitmosaic-heavy.lock python benchmarks/sfmp.py --parts main --points 2.5 --nsamples 16
     flock /tmp/bitmosaic-heavy.lock python benchmarks/sfmp.py --parts decode --decode-point 3.0 --threads 1
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

from bitmosaic.data import calibration_samples
from bitmosaic.methods import get_method
from bitmosaic.pipeline import quantize_model

from common import RESULTS, Bench, base_parser, write_text

PAIRS = {  # point -> (uniform bits, uniform group or None, sfmp group)
    "2.5": (2, 64, 128),
    "3.0": (3, None, 128),
    "3.25": (3, 128, 256),
    "3.5": (3, 64, 128),
    "4.0": (4, None, 128),
    "4.25": (4, 128, 256),
}
PARTIAL = RESULTS / "sfmp.partial.json"
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class SFMPBench(Bench):
    def __init__(self, args):
        super().__init__(args)
        self.partial_path = PARTIAL
        self.done = {}
        if PARTIAL.is_file():
            self.done = {r["name"]: r for r in json.loads(PARTIAL.read_text())["rows"]}
        self.rows = list(self.done.values())

    def get(self, name):
        return self.done.get(name)

    def sfmp(self, name: str, fisher_tokens=None, **options) -> dict:
        old = self.done.get(name)
        if old is not None and old["options"].get("bpw") == options.get("bpw"):
            return old
        if old is not None:  # run for another budget (before baselines were matched by the minimum)
            print(f"  {name}: saved row had bpw {old['options'].get('bpw')}, now {options.get('bpw')}: rerun")
            self.rows.remove(old)
        spec = get_method("sfmp")
        cfg = spec.make_config(**options)
        model = copy.deepcopy(self.model)
        inputs = {"salience_tokens": fisher_tokens}
        rep = quantize_model(model, self.calib, spec, cfg, progress=False, method_inputs=inputs)
        t = time.perf_counter()
        alloc = rep.calibration["allocation"]
        row = {
            "name": name,
            "method": "sfmp",
            "options": cfg.to_dict(),
            "bits_per_weight": rep.bits_per_weight,
            "b_target": alloc["b"],
            "b_reached": alloc["b_reached"],
            "overhead_bpw": alloc["overhead_bpw"],
            "fisher_seconds": alloc["fisher"].get("seconds"),
            "fisher_cached": alloc["fisher"].get("cached"),
            "fisher_samples": alloc["fisher"].get("samples"),
            "quant_seconds": rep.seconds,
            "per_linear_bits": alloc["per_linear"],
            "breakdown": _breakdown(rep.layers),
            "ppl": self.ppl(model),
        }
        row["eval_seconds"] = time.perf_counter() - t
        del model
        if cfg.bpw is not None and row["bits_per_weight"] > cfg.bpw + 1e-9:
            raise RuntimeError(  # the allocation keeps b_reached <= b, and the overhead is measured
                f"{name}: SFMP stores {row['bits_per_weight']:.6f} bits per weight, over its budget "
                f"{cfg.bpw:.6f}: the comparison would not be at matched memory (a bug; not recorded)"
            )
        self.done[name] = self._add(row)
        return row

    def uniform(self, name: str, method: str, **options) -> dict:
        if name in self.done:
            return self.done[name]
        row = self.run(name, method, **options)
        row.pop("layers", None)
        self.done[name] = row
        self._add_partial()
        return row

    def _add_partial(self):
        rows = [{k: v for k, v in r.items() if k != "layers"} for r in self.rows]
        write_text(PARTIAL, json.dumps({"partial": True, "rows": rows}, indent=2))


def _breakdown(layers) -> dict:
    n = sum(r["shape"][0] * r["shape"][1] for r in layers)
    keys = layers[0]["bits_breakdown"].keys()
    return {k: sum(r["bits_breakdown"][k] * r["shape"][0] * r["shape"][1] for r in layers) / n for k in keys}


def _gname(g):
    return "ch" if g is None else f"g{g}"


def _baselines(p: str) -> tuple[str, str]:
    bits, ug, _ = PAIRS[p]
    return f"{p} gptq w{bits}{_gname(ug)}", f"{p} awq w{bits}{_gname(ug)}"


def matched_bpw(b: SFMPBench, p: str) -> float:
    """SFMP's budget at point ``p``: the SMALLER measured total bpw of the two uniform baselines, so
    SFMP never stores more bits than either (GPTQ's act-order ``g_idx`` makes it the larger one)."""
    rows = [b.get(n) for n in _baselines(p)]
    if None in rows:
        raise SystemExit(f"point {p}: run --parts main first (the uniform baselines set SFMP's budget)")
    return min(r["bits_per_weight"] for r in rows)


def part_main(b: SFMPBench, points, solvers):
    for p in points:
        bits, ug, sg = PAIRS[p]
        base = {"bits": bits, "group_size": ug}
        b.uniform(_baselines(p)[0], "gptq", **base)
        b.uniform(_baselines(p)[1], "awq", **base)
        bpw = matched_bpw(b, p)
        for s in solvers:
            b.sfmp(f"{p} sfmp-{s} g{sg}", bpw=bpw, group_size=sg, solver=s)


def part_reorder(b: SFMPBench, points, solvers):
    """none / row / column (both = the main row) for each solver."""
    for p in points:
        bpw = matched_bpw(b, p)
        sg = PAIRS[p][2]
        for s in solvers:
            for label, r, c in (("none", False, False), ("row", True, False), ("col", False, True)):
                b.sfmp(
                    f"{p} sfmp-{s} g{sg} reorder={label}", bpw=bpw, group_size=sg, solver=s,
                    row_reorder=r, col_reorder=c,
                )  # fmt: skip


def part_blocks(b: SFMPBench, points):
    """m_b in {32, 64, 512} at n_b = 128, and n_b in {64, 128, 256} at m_b = 512 (n_b is the group
    size: a block is m_b rows by one group).  The (512, 128) cell is shared by both sweeps, and the
    main row at the same point and group size is that cell again, so it is copied, not rerun."""
    for p in points:
        bpw = matched_bpw(b, p)
        main = b.get(f"{p} sfmp-awq g{PAIRS[p][2]}")
        for mb, nb in ((32, 128), (64, 128), (512, 128), (512, 64), (512, 256)):
            name = f"{p} sfmp-awq g{nb} mb={mb} nb={nb}"
            reuse = main is not None and main["options"].get("bpw") == bpw
            if reuse and mb == 512 and nb == PAIRS[p][2] and b.get(name) is None:
                b.done[name] = b._add({**main, "name": name, "copied_from": main["name"]})
                continue
            b.sfmp(name, bpw=bpw, group_size=nb, block_rows=mb)


def part_fisher(b: SFMPBench, points, samples):
    for p in points:
        bpw = matched_bpw(b, p)
        sg = PAIRS[p][2]
        for n in samples:
            name = f"{p} sfmp-awq g{sg} fisher={n}"
            if b.get(name) is not None and b.get(name)["options"].get("bpw") == bpw:
                continue  # done at this budget (sfmp() reruns a row made for another one)
            toks = calibration_samples(
                b.tok, "wikitext2", n, b.args.seqlen, b.args.seed + 1, data_dir=b.args.data_dir
            )
            # no cache: the row's fisher_seconds is the estimation's cost, not a load
            b.sfmp(name, fisher_tokens=toks, bpw=bpw, group_size=sg, fisher_samples=n, fisher_cache=None)


def _decode_rate(model, prompt, new_tokens: int) -> float:
    """Greedy decode tokens/s at batch 1: the new tokens after the first (whose time includes the
    prompt's prefill) over their wall time, stamped by a logits processor (called once per token)."""
    import torch

    stamps: list[float] = []

    def clock(input_ids, scores):
        stamps.append(time.perf_counter())
        return scores

    with torch.inference_mode():
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, logits_processor=[clock], pad_token_id=0,
        )  # fmt: skip
    if out.shape[1] - prompt.shape[1] != new_tokens or len(stamps) != new_tokens:
        raise RuntimeError(f"generated {out.shape[1] - prompt.shape[1]} tokens, asked for {new_tokens}")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def decode_reorder_cost(
    model, calib, prompt, salience, *, bpw, group_size, new_tokens=64, repeats=7, progress=False
) -> dict:
    """Greedy decode speed of SFMP with reordering (rows and columns, gate/up folded into down_proj)
    against no reordering (``--no-row-reorder --no-col-reorder``), both built here from ``model`` with
    the same Fisher ``salience`` and timed in this process, interleaved (A B B A ...), median of
    ``repeats``.  The reordered model gets ``bpw``; the other the same average code bits ``b`` (so
    the two differ only by the permutations, not by how many blocks are wide).  The blocks are cheap
    min-max ones (``n_grid=1``, no clip search): decode speed does not depend on the codes' values,
    only on the widths, so the blocks' quality does not matter here (perplexity is measured by the
    other parts)."""
    import statistics

    from bitmosaic.modules.base import prepare_kernels, resident_bytes

    spec = get_method("sfmp")
    cheap = {"group_size": group_size, "n_grid": 1, "clip_search": False, "fisher_cache": None}
    runs, b = {}, None
    for name, extra in (
        ("reorder", {"bpw": bpw}),
        ("no-reorder", {"row_reorder": False, "col_reorder": False}),
    ):
        if b is not None:
            extra["avg_bits"] = b
        m = copy.deepcopy(model)
        cfg = spec.make_config(**cheap, **extra)
        rep = quantize_model(m, calib, spec, cfg, progress=progress, method_inputs={"salience": salience})
        alloc = rep.calibration["allocation"]
        b = alloc["b"] if b is None else b
        prepare_kernels(m)
        _decode_rate(m, prompt, 4)  # warm-up: kernels, caches
        runs[name] = {
            "model": m, "bits_per_weight": rep.bits_per_weight, "b_target": alloc["b"],
            "b_reached": alloc["b_reached"], "permutations_folded": rep.calibration["permutations_folded"],
            "resident_mb": resident_bytes(m) / 2**20, "rates": [],
        }  # fmt: skip
    names = list(runs)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            runs[name]["rates"].append(_decode_rate(runs[name]["model"], prompt, new_tokens))
            if progress:
                print(f"  repeat {r + 1}/{repeats} {name}: {runs[name]['rates'][-1]:.2f} tok/s", flush=True)
    for v in runs.values():
        del v["model"]
        v["tok_s"] = statistics.median(v["rates"])
    ratio = runs["reorder"]["tok_s"] / runs["no-reorder"]["tok_s"]
    return {"variants": runs, "ratio_reorder_vs_none": ratio, "decode_cost_pct": 100 * (1 - ratio)}


def part_decode(a) -> None:
    """SmolLM2-135M at one point: the reorder / no-reorder decode speed, to ``sfmp_decode.{json,md}``."""
    import torch

    from bitmosaic.io import load_model
    from bitmosaic.pipeline.fisher import fisher_salience, salience_linear_names

    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = load_model(a.model, dtype=torch.float32)
    calib = calibration_samples(tok, "wikitext2", a.nsamples, a.seqlen, a.seed, data_dir=a.data_dir)
    sal, finfo = fisher_salience(model, calib, salience_linear_names(model), cache_dir="auto")
    prompt = calib[:1, : a.prompt_tokens]
    bpw, group = float(a.decode_point), PAIRS[a.decode_point][2]
    res = decode_reorder_cost(
        model, calib, prompt, sal, bpw=bpw, group_size=group, new_tokens=a.new_tokens, repeats=a.repeats,
        progress=True,
    )  # fmt: skip
    res.update(
        model=a.model, point=a.decode_point, group_size=group, prompt_tokens=prompt.shape[1],
        new_tokens=a.new_tokens, repeats=a.repeats, threads=torch.get_num_threads(), fisher=finfo,
    )  # fmt: skip
    lines = [
        f"## Decode cost of reordering (SFMP, {a.model}, BPW {bpw:g}, g{group}, batch 1, "
        f"{prompt.shape[1]}-token prompt + {a.new_tokens} new tokens, {res['threads']} thread(s), "
        f"median of {a.repeats})",
        "",
        "| variant | bpw | b reached | MLP folds | resident MB | decode tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, v in res["variants"].items():
        lines.append(
            f"| {name} | {v['bits_per_weight']:.3f} | {v['b_reached']:.3f} | {v['permutations_folded']} "
            f"| {v['resident_mb']:.1f} | {v['tok_s']:.2f} |"
        )
    lines += [
        "",
        f"Reorder / no-reorder decode speed: {res['ratio_reorder_vs_none']:.3f} "
        f"(cost {res['decode_cost_pct']:.1f}%; the paper reports at most 5%).  Blocks are min-max "
        "(n_grid=1, no clip search): speed depends on the widths, not on the codes.",
    ]
    md = "\n".join(lines) + "\n"
    print(md)
    write_text(RESULTS / "sfmp_decode.md", md)
    write_text(RESULTS / "sfmp_decode.json", json.dumps({"benchmark": "sfmp_decode", **res}, indent=2))


def report(rows: list[dict], args) -> str:
    by = {r["name"]: r for r in rows}
    lines = ["## SFMP vs uniform at matched memory (SmolLM2-135M, WikiText-2 ppl)", ""]
    lines.append(
        "| point | GPTQ uniform (bpw, ppl) | AWQ uniform (bpw, ppl) | SFMP-AWQ (bpw, b, ppl) "
        "| SFMP-GPTQ (bpw, b, ppl) |"
    )
    lines.append("|---|---|---|---|---|")
    for p, (bits, ug, sg) in PAIRS.items():
        cells = []
        for n in (f"{p} gptq w{bits}{_gname(ug)}", f"{p} awq w{bits}{_gname(ug)}"):
            r = by.get(n)
            cells.append(f"w{bits}{_gname(ug)}: {r['bits_per_weight']:.3f}, **{r['ppl']:.2f}**" if r else "-")
        for s in ("awq", "gptq"):
            r = by.get(f"{p} sfmp-{s} g{sg}")
            cells.append(
                f"g{sg}: {r['bits_per_weight']:.3f}, {r['b_reached']:.3f}, **{r['ppl']:.2f}**" if r else "-"
            )
        if any(c != "-" for c in cells):
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "SFMP's budget at each point is the smaller of the two baselines' measured bits per weight.",
    ]
    float_row = by.get("float")
    if float_row:
        lines += ["", f"Float: ppl {float_row['ppl']:.3f}."]
    abl = [
        r
        for r in rows
        if r["method"] == "sfmp" and any(k in r["name"] for k in ("reorder=", "mb=", "nb=", "fisher="))
    ]
    if abl:
        lines += [
            "",
            "## Ablations (SFMP-AWQ unless the name says gptq)",
            "",
            "| run | bpw | b reached | ppl | Fisher s (samples) |",
            "|---|---|---|---|---|",
        ]
        for r in abl:
            fs = (
                f"{r['fisher_seconds']:.1f} ({r['fisher_samples']})"
                if r.get("fisher_seconds")
                else f"cached ({r['fisher_samples']})"
            )
            lines.append(
                f"| {r['name']} | {r['bits_per_weight']:.3f} | {r['b_reached']:.3f} | {r['ppl']:.2f} | {fs} |"
            )
    sf = [r for r in rows if r["method"] == "sfmp"]
    if sf:
        costs = [r["fisher_seconds"] for r in sf if r.get("fisher_seconds")]
        lines += ["", f"Fisher salience cost (uncached runs): {', '.join(f'{c:.1f}s' for c in costs)}."]
        r0 = next(
            (r for r in sf if r["name"].endswith("sfmp-awq g128") and r["name"].startswith("2.5")), sf[0]
        )
        lines += ["", f"## Average code bits per projection type ({r0['name']})", ""]
        lines += ["| " + " | ".join(PROJ) + " |", "|" + "---|" * len(PROJ)]
        lines.append("| " + " | ".join(f"{_proj_mean(r0, p):.3f}" for p in PROJ) + " |")
        bd = r0["breakdown"]
        lines += [
            "",
            "Bits per weight of that run: " + ", ".join(f"{k} {v:.4f}" for k, v in bd.items()) + ".",
        ]
    return "\n".join(lines) + "\n"


def _proj_mean(row, proj):
    v = [b for n, b in row["per_linear_bits"].items() if n.endswith(proj)]
    return sum(v) / len(v)


def plot(rows, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sf = [
        r
        for r in rows
        if r["method"] == "sfmp" and r["name"].split()[1] == "sfmp-awq" and len(r["name"].split()) == 3
    ]
    if not sf:
        return
    fig, axes = plt.subplots(len(sf), 1, figsize=(12, 1.6 * len(sf) + 0.8), squeeze=False)
    for ax, r in zip(axes[:, 0], sf, strict=True):
        names = list(r["per_linear_bits"])
        layers = sorted({int(n.split(".")[2]) for n in names})
        M = np.array([[r["per_linear_bits"][f"model.layers.{i}.{'self_attn' if p in PROJ[:4] else 'mlp'}.{p}"]
                       for i in layers] for p in PROJ])  # fmt: skip
        im = ax.imshow(M, aspect="auto", cmap="viridis")
        ax.set_yticks(range(len(PROJ)), [p.replace("_proj", "") for p in PROJ], fontsize=7)
        ax.set_ylabel(f"BPW {r['bits_per_weight']:.2f}\nb={r['b_reached']:.2f}", fontsize=8)
        ax.set_xticks(range(0, len(layers), 2), [str(i) for i in layers[::2]], fontsize=7)
        fig.colorbar(im, ax=ax, pad=0.01)
    axes[-1, 0].set_xlabel("decoder layer")
    fig.suptitle("SFMP(AWQ) on SmolLM2-135M: average code bits per linear", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--parts", default="main", help="comma list: main,reorder,blocks,fisher,decode")
    p.add_argument("--points", default=",".join(PAIRS), help="comma list of points (2.5,3.0,...)")
    p.add_argument("--solvers", default="awq,gptq")
    p.add_argument("--fisher-samples", default="32,128")
    p.add_argument("--report", action="store_true", help="only assemble tables/PNG from the partial JSON")
    p.add_argument("--decode-point", default="3.0", choices=list(PAIRS), help="part decode: the BPW point")
    p.add_argument("--prompt-tokens", type=int, default=32, help="part decode: prompt length")
    p.add_argument("--new-tokens", type=int, default=64, help="part decode: greedy tokens per timing")
    p.add_argument("--repeats", type=int, default=7, help="part decode: timings per variant (median)")
    a = p.parse_args()
    parts = a.parts.split(",")
    if "decode" in parts:
        part_decode(a)
        if parts == ["decode"]:
            return
    if a.report:
        rows = json.loads(PARTIAL.read_text())["rows"]
    else:
        b = SFMPBench(a)
        if "float" not in b.done:
            b.done["float"] = b.float_row()
            b._add_partial()
        points = [x for x in a.points.split(",") if x]
        if "main" in parts:
            part_main(b, points, a.solvers.split(","))
        if "reorder" in parts:
            part_reorder(b, points, a.solvers.split(","))
        if "blocks" in parts:
            part_blocks(b, points)
        if "fisher" in parts:
            part_fisher(b, points, [int(x) for x in a.fisher_samples.split(",")])
        rows = b.rows
    md = report(rows, a)
    print(md)
    write_text(RESULTS / "sfmp.md", md)
    write_text(
        RESULTS / "sfmp.json", json.dumps({"benchmark": "sfmp", "args": vars(a), "rows": rows}, indent=2)
    )
    plot(rows, RESULTS / "sfmp_bits.png")


if __name__ == "__main__":
    main()
