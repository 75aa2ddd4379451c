"""SFMP (issue #12, #25) on SmolLM2-135M: perplexity at matched memory against uniform GPTQ and AWQ.

Pairings (the paper's Table 3, plus 2.5/3.5/4.25): at each point the uniform baselines are run
first and SFMP gets the *smaller* of their two *measured* totals of bits per weight (``bpw``: codes +
scales/zeros + permutations + bit map; at 2-3 bits our GPTQ's act-order ``g_idx`` makes it store more
than AWQ, at 4 its static groups do not), so SFMP never stores more than either (checked on every row):

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

The uniform rows: GPTQ as the paper ran it (``gptq-orig``: natural order, min-max scales, no
``g_idx``: the paper's Table 3 comparator, with AWQ), and ours (``gptq``: act-order + MSE scales, an
extra row, not the paper's comparator; its ``g_idx`` at 2-3 bits is why it stores more there).

Parts: ``main`` (the table above, SFMP with AWQ and with GPTQ blocks, both uniform GPTQs), ``orig``
(only the paper's GPTQ rows), and the ablations, all at **equal code bits** ``b`` (``avg_bits``: the
``b`` that the point's budget leaves on the main layout -- rows and columns reordered, m_b = 512,
n_b = group -- :func:`bitmosaic.methods.sfmp.sfmp_budget`), each row's total bits per weight (indices,
bit map) reported beside: ``reorder`` (none / row / column / both at ``--ablation-mb``, default 64, so
that every SmolLM2 matrix has several row blocks), ``order`` (GPTQ blocks: none and both again with
GPTQ solving in act-order, the same order in both layouts, :func:`part_order`), ``blocks`` (m_b in
{32, 64, 128, 512} at n_b = group; the m_b = 512 row is the main row, the same allocation, so it is
copied; plus n_b in {group, 2 group} at ``--ablation-mb`` with the same group), ``fisher`` (Fisher
from ``--fisher-samples`` samples drawn apart from the calibration, uncached, its cost in seconds kept
in the row).
``--salience-samples N`` estimates every SFMP row's Fisher from N calibration samples (more are drawn
when ``--nsamples`` is smaller; the verdict protocol refuses fewer than 128).  The Fisher salience is
cached per token set.  Solvers: ``--solvers`` (default gptq, the method's default; awq is the paper's).

Results accumulate in ``benchmarks/results/sfmp.partial.json`` (seeded from ``sfmp.json``; with
``--json X.json``: ``X.partial.json`` and ``X.json``, e.g. ``sfmp_verdict.json`` for verdict rows; every row
records its protocol, and a saved row is reused only under the same protocol and settings), so the
parts can run a few rows at a time under the shared lock (``--only``); ``--report`` prints the
tables and writes ``sfmp.json``/``sfmp.md`` and the allocation PNG.  Part ``decode``:
:mod:`sfmp_decode`.

Run: flock /tmp/bitmosaic-heavy.lock python -m benchmarks.sfmp.sfmp --protocol fast --parts main --points 2.5
     flock /tmp/bitmosaic-heavy.lock python -m benchmarks.sfmp.sfmp --protocol fast --parts reorder \
         --points 3.25 --solvers gptq --only "3.25 sfmp-gptq g256 mb=64 b=3.068 reorder=none"
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

from benchmarks.harness import RESULTS, Bench, base_parser, protocol_label, write_text
from bitmosaic.data import calibration_samples
from bitmosaic.methods import get_method
from bitmosaic.methods.sfmp import sfmp_budget
from bitmosaic.pipeline import Calibration, RunSettings, quantize_model
from bitmosaic.pipeline.fisher import salience_linear_names

PAIRS = {  # point -> (uniform bits, uniform group or None, sfmp group)
    "2.5": (2, 64, 128),
    "3.0": (3, None, 128),
    "3.25": (3, 128, 256),
    "3.5": (3, 64, 128),
    "4.0": (4, None, 128),
    "4.25": (4, 128, 256),
}
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the settings that make two SFMP rows the same run (a saved row is reused only when they match)
SAME = ("avg_bits", "bpw", "budget_mb", "group_size", "block_rows", "block_cols", "row_reorder",
        "col_reorder", "solver", "fisher_samples")  # fmt: skip


def paths(args) -> tuple[Path, Path]:
    """The results JSON (``--json``, default ``sfmp.json``; a verdict run: ``sfmp_verdict.json``, which
    the findings report prefers) and its partial file beside it, which the rows accumulate in."""
    path = Path(args.json) if args.json else RESULTS / "sfmp.json"
    return path, path.with_name(path.stem + ".partial.json")


def protocol_of(args) -> str:
    """``fast``/``verdict``, else the settings (every row records the protocol it was measured with)."""
    label = protocol_label(args)
    if label != "custom":
        return label
    w = "every window" if args.max_windows is None else f"{args.max_windows} windows"
    return f"{args.nsamples}x{args.seqlen} calib, {w}"


class SFMPBench(Bench):
    def __init__(self, args):
        self.protocol = protocol_of(args)
        want = args.salience_samples or args.nsamples
        if self.protocol == "verdict" and want < 128:  # checked before the model loads
            raise SystemExit(
                f"error: verdict rows need a Fisher from >= 128 samples; got {want} (--salience-samples)"
            )
        super().__init__(args)
        out, self.partial_path = paths(args)
        src = self.partial_path if self.partial_path.is_file() else out
        self.rows = json.loads(src.read_text())["rows"] if src.is_file() else []
        # rows of another protocol stay in the file (and the report) but are never reused here
        self.done = {r["name"]: r for r in self.rows if r.get("protocol") == self.protocol}

    def get(self, name):
        return self.done.get(name)

    def _more(self, n: int):
        a = self.args
        return calibration_samples(self.tok, "wikitext2", n, a.seqlen, a.seed, data_dir=a.data_dir)

    def _replace(self, name: str) -> None:
        """Drop the saved rows called ``name`` (of any protocol): a row name means one result."""
        self.rows = [r for r in self.rows if r["name"] != name]
        self.done.pop(name, None)

    def sfmp(self, name: str, fisher_tokens=None, **options) -> dict | None:
        if self.args.salience_samples and fisher_tokens is None:
            options.setdefault("fisher_samples", self.args.salience_samples)
        spec = get_method("sfmp")
        cfg = spec.make_config(**options)
        want = cfg.to_dict()
        old = self.done.get(name)
        if old is not None and all(old["options"].get(k) == want[k] for k in SAME):
            return old
        if not self.wants(name):
            return None
        if old is not None:
            print(f"  {name}: the saved row was made with other settings: rerun")
        self._replace(name)
        model = copy.deepcopy(self.model)
        inputs = {"salience_tokens": fisher_tokens}
        calib = Calibration(self.calib, more=self._more)
        rep = quantize_model(model, calib, spec, cfg, RunSettings(progress=self.progress), inputs=inputs)
        t = time.perf_counter()
        alloc = rep.calibration["allocation"]
        row = {
            "name": name,
            "method": "sfmp",
            "protocol": self.protocol,
            "options": want,
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
            **self.measure(model),
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

    def uniform(self, name: str, method: str, **options) -> dict | None:
        if name in self.done:
            return self.done[name]
        if not self.wants(name):
            return None
        self._replace(name)
        row = self.run(name, method, **options)
        row.pop("layers", None)
        row["protocol"] = self.protocol
        self.done[name] = row
        self._add_partial()
        return row

    def copy_row(self, name: str, src: dict, why: str) -> None:
        if self.get(name) is None:
            self._replace(name)
            keep = {"copied_from": src["name"], "why_copied": why, "cpu": src.get("cpu")}  # who measured it
            self.done[name] = self._add({**src, "name": name, **keep})

    def _add_partial(self):
        rows = [{k: v for k, v in r.items() if k != "layers"} for r in self.rows]
        write_text(self.partial_path, json.dumps({"partial": True, "rows": rows}, indent=2))


def _breakdown(layers) -> dict:
    n = sum(r["shape"][0] * r["shape"][1] for r in layers)
    keys = layers[0]["bits_breakdown"].keys()
    return {k: sum(r["bits_breakdown"][k] * r["shape"][0] * r["shape"][1] for r in layers) / n for k in keys}


def _gname(g):
    return "ch" if g is None else f"g{g}"


def _baselines(p: str) -> tuple[str, str, str]:
    """Point ``p``'s uniform rows: our GPTQ (act-order + MSE), AWQ and the paper's GPTQ (natural, min-max)."""
    bits, ug, _ = PAIRS[p]
    return (
        f"{p} gptq w{bits}{_gname(ug)}",
        f"{p} awq w{bits}{_gname(ug)}",
        f"{p} gptq-orig w{bits}{_gname(ug)}",
    )


def matched_bpw(b: SFMPBench, p: str) -> float:
    """SFMP's budget at point ``p``: the SMALLER measured total bpw of our GPTQ and AWQ, so SFMP never
    stores more bits than either (at 2-3 bits GPTQ's act-order ``g_idx`` makes it the larger one; at
    4 bits its static groups store what AWQ does, as the paper's GPTQ always does)."""
    try:  # the same accounting, measured by an earlier run (it depends on no data or seed)
        given = {k: float(v) for k, v in (x.split("=") for x in (b.args.budget_bpw or "").split(",") if x)}
        bad = any(v <= 0 for v in given.values())
    except ValueError:  # no "=", or not a number
        bad = True
    if bad:
        raise SystemExit(f"--budget-bpw {b.args.budget_bpw}: give POINT=BPW pairs, e.g. 3.25=3.2708")
    if p in given:
        return given[p]
    rows = [b.get(n) for n in _baselines(p)[:2]]
    if None in rows:
        raise SystemExit(
            f"point {p}: run --parts main first (the uniform baselines set SFMP's budget), "
            f"or pass --budget-bpw {p}=BPW from a run that has them"
        )
    return min(r["bits_per_weight"] for r in rows)


def ablation_b(b: SFMPBench, p: str) -> float:
    """The code bits ``b`` every ablation row at ``p`` gets: what the matched budget leaves on the main
    layout (rows and columns reordered, m_b = 512, n_b = the group), measured as the method does."""
    cfg = get_method("sfmp").make_config(bpw=matched_bpw(b, p), group_size=PAIRS[p][2])
    shapes = {n: tuple(b.model.get_submodule(n).weight.shape) for n in salience_linear_names(b.model)}
    return sfmp_budget(shapes, cfg)["b"]


def part_main(b: SFMPBench, points, solvers):
    for p in points:
        bits, ug, sg = PAIRS[p]
        base = {"bits": bits, "group_size": ug}
        ours, awq, orig = _baselines(p)
        b.uniform(ours, "gptq", **base)
        b.uniform(awq, "awq", **base)
        b.uniform(orig, "gptq", order="natural", scale="minmax", **base)
        bpw = matched_bpw(b, p)
        for s in solvers:
            b.sfmp(f"{p} sfmp-{s} g{sg}", bpw=bpw, group_size=sg, solver=s)


def part_orig(b: SFMPBench, points):
    """Only the paper's uniform GPTQ (natural order, min-max scales) at each point."""
    for p in points:
        bits, ug, _ = PAIRS[p]
        b.uniform(_baselines(p)[2], "gptq", bits=bits, group_size=ug, order="natural", scale="minmax")


def _abl(p: str, s: str, bb: float, mb: int, nb: int | None = None) -> str:
    sg = PAIRS[p][2]
    return f"{p} sfmp-{s} g{sg} mb={mb}" + ("" if nb in (None, sg) else f" nb={nb}") + f" b={bb:.3f}"


def part_reorder(b: SFMPBench, points, solvers, mb: int):
    """none / row / column / both at equal code bits ``b`` and ``m_b`` (both = the unsuffixed row)."""
    for p in points:
        bb, sg = ablation_b(b, p), PAIRS[p][2]
        for s in solvers:
            for label, r, c in (
                ("", True, True),
                ("none", False, False),
                ("row", True, False),
                ("col", False, True),
            ):
                name = _abl(p, s, bb, mb) + (f" reorder={label}" if label else "")
                b.sfmp(
                    name, avg_bits=bb, group_size=sg, block_rows=mb, solver=s, row_reorder=r, col_reorder=c
                )


def part_order(b: SFMPBench, points, mb: int):
    """GPTQ blocks only (issue 73, item 6): the reorder ablation's *both* and *none* layouts again, GPTQ
    solving in act-order (``gptq_order="act"``, the layout's groups static) -- the same columns' order in
    both layouts.  *both* against *none* then measures the layout (the allocation's reorder) alone, and
    *none* against the plain *none* row GPTQ's solve order alone."""
    for p in points:
        bb, sg = ablation_b(b, p), PAIRS[p][2]
        head = _abl(p, "gptq", bb, mb) + " solve=act"
        for label, r, c in (("", True, True), ("none", False, False)):
            b.sfmp(head + (f" reorder={label}" if label else ""), avg_bits=bb, group_size=sg, block_rows=mb,
                   solver="gptq", row_reorder=r, col_reorder=c, gptq_order="act")  # fmt: skip


def part_blocks(b: SFMPBench, points, solvers, mb: int):
    """m_b in {32, 64, 128, 512} at n_b = the group, and n_b = 2 groups at ``mb``, all at equal code
    bits (the paper's Tables 5-6 sweep at equal memory; its n_b is the group size, whose scales then
    take the codes' bits: our n_b sweep keeps the group, so it isolates the allocation's grain)."""
    for p in points:
        bb, sg = ablation_b(b, p), PAIRS[p][2]
        for s in solvers:
            main = b.get(f"{p} sfmp-{s} g{sg}")
            for m in (32, 64, 128, 512):
                name = _abl(p, s, bb, m)
                if m == 512 and main is not None and main["b_target"] == bb:
                    b.copy_row(name, main, "the main row: the same b, layout and allocation (sfmp_budget)")
                    continue
                b.sfmp(name, avg_bits=bb, group_size=sg, block_rows=m, solver=s)
            b.sfmp(
                _abl(p, s, bb, mb, 2 * sg),
                avg_bits=bb,
                group_size=sg,
                block_rows=mb,
                block_cols=2 * sg,
                solver=s,
            )


def part_fisher(b: SFMPBench, points, solvers, samples, mb: int):
    """Fisher from ``samples`` samples drawn apart from the calibration (seed + 1), uncached so that
    each row's ``fisher_seconds`` is the estimation's cost, at equal code bits and ``mb``."""
    for p in points:
        bb, sg = ablation_b(b, p), PAIRS[p][2]
        for s in solvers:
            for n in samples:
                name = _abl(p, s, bb, mb) + f" fisher={n}"
                if not b.wants(name) and b.get(name) is None:
                    continue
                a = b.args
                toks = calibration_samples(b.tok, "wikitext2", n, a.seqlen, a.seed + 1, data_dir=a.data_dir)
                b.sfmp(name, fisher_tokens=toks, avg_bits=bb, group_size=sg, block_rows=mb, solver=s,
                       fisher_samples=n, fisher_cache=None)  # fmt: skip


def _protocols(rows) -> str:
    got = sorted({r.get("protocol", "unrecorded") for r in rows})
    return got[0] if len(got) == 1 else "mixed: " + ", ".join(got)


def _cell(r, what="bpw") -> str:
    if r is None:
        return "-"
    lead = f"{r['bits_per_weight']:.3f}" + (f", {r['b_reached']:.3f}" if what == "b" else "")
    return f"{lead}, **{r['ppl']:.2f}**"


def _ablation_table(title: str, rows: list[dict]) -> list[str]:
    head = "| run | code bits b (target / reached) | total bpw | permutations bpw | bit map bpw | ppl "
    lines = ["", title, "", head + "| Fisher s (samples) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        fs = r.get("fisher_seconds")
        fs = f"{fs:.1f} ({r['fisher_samples']})" if fs else f"cached ({r['fisher_samples']})"
        bd = r["breakdown"]
        lines.append(
            f"| {r['name']} | {r['b_target']:.4f} / {r['b_reached']:.4f} | {r['bits_per_weight']:.4f} "
            f"| {bd.get('permutations', 0):.4f} | {bd.get('bit_map', 0):.4f} | {r['ppl']:.2f} | {fs} |"
        )
    return lines


def report(rows: list[dict], args) -> str:
    by = {r["name"]: r for r in rows}
    lines = ["## SFMP vs uniform at matched memory (SmolLM2-135M, WikiText-2 ppl)", ""]
    lines += [f"Protocol of these rows: {_protocols(rows)}. (fast = 16x512 calibration and Fisher, 20 "
              "windows of 512 tokens; verdict = >= 128x512, every window, KL and top-1.)", ""]  # fmt: skip
    lines.append(
        "| point | GPTQ, the paper's: natural, min-max (bpw, ppl) | AWQ (bpw, ppl) | GPTQ, ours: act-order, "
        "MSE (bpw, ppl) | SFMP-AWQ (bpw, b, ppl) | SFMP-GPTQ (bpw, b, ppl) |"
    )
    lines.append("|---|---|---|---|---|---|")
    for p, (_, _, sg) in PAIRS.items():
        ours, awq, orig = (by.get(n) for n in _baselines(p))
        cells = [_cell(orig), _cell(awq), _cell(ours)]
        cells += [_cell(by.get(f"{p} sfmp-{s} g{sg}"), "b") for s in ("awq", "gptq")]
        if any(c != "-" for c in cells):
            lines.append(f"| {p} ({_baselines(p)[0].split()[-1]} / g{sg}) | " + " | ".join(cells) + " |")
    given = getattr(args, "budget_bpw", None)  # else this run's own uniform rows
    given = f"; this run took it from an earlier run's rows (--budget-bpw {given})" if given else ""
    lines += ["", "SFMP's budget at each point is the smaller of the measured bits per weight of AWQ and our "
              f"GPTQ (the paper's GPTQ stores what AWQ does: no g_idx){given}."]  # fmt: skip
    float_row = by.get("float")
    if float_row:
        lines += ["", f"Float: ppl {float_row['ppl']:.3f}."]
    sf = [r for r in rows if r["method"] == "sfmp"]
    abl = [r for r in sf if any(k in r["name"] for k in ("reorder=", "mb=", "nb=", "fisher="))]
    code = [r for r in abl if " b=" in r["name"]]  # avg_bits, or the main row it equals (copied)
    total = [r for r in abl if " b=" not in r["name"]]
    if code:
        lines += _ablation_table(
            "## Ablations at equal code bits b (total bits per weight beside; a name without reorder= "
            "reorders rows and columns)", code
        )  # fmt: skip
    if total:
        lines += _ablation_table(
            "## Earlier ablations at equal total bits (indices and bit map take bits from the codes)", total
        )
    if sf:
        costs = [f"{r['fisher_seconds']:.1f}s ({r['fisher_samples']})" for r in sf if r.get("fisher_seconds")]
        lines += ["", f"Fisher salience cost, uncached runs (samples): {', '.join(costs)}."]
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
    p.add_argument("--parts", default="main", help="comma list: main,orig,reorder,order,blocks,fisher,decode")
    p.add_argument("--points", default=",".join(PAIRS), help="comma list of points (2.5,3.0,...)")
    p.add_argument("--solvers", default="awq,gptq")
    p.add_argument(
        "--ablation-mb", type=int, default=64, help="the ablations' m_b (several row blocks per matrix)"
    )
    p.add_argument(
        "--budget-bpw",
        default=None,
        metavar="POINT=BPW,...",
        help="SFMP's matched budget per point, taken from the uniform rows of an earlier run (bits per "
        "weight are pure accounting: no data, seed or protocol changes them); default: this run's rows",
    )
    p.add_argument("--fisher-samples", default="32,128", help="part fisher: the sample counts compared")
    p.add_argument("--salience-samples", type=int, default=None,
                   help="Fisher samples for every SFMP row (default: every calibration sample)")  # fmt: skip
    p.add_argument("--report", action="store_true", help="only assemble tables/PNG from the partial JSON")
    p.add_argument("--decode-point", default="3.0", choices=list(PAIRS), help="part decode: the BPW point")
    p.add_argument("--prompt-tokens", type=int, default=32, help="part decode: prompt length")
    p.add_argument("--new-tokens", type=int, default=64, help="part decode: greedy tokens per timing")
    p.add_argument("--repeats", type=int, default=7, help="part decode: timings per variant (median)")
    a = p.parse_args()
    parts = a.parts.split(",")
    path, partial = paths(a)
    if "decode" in parts:
        from sfmp_decode import part_decode

        a.decode_group = PAIRS[a.decode_point][2]
        part_decode(a)
        if parts == ["decode"]:
            return
    if a.report:
        saved = json.loads((partial if partial.is_file() else path).read_text())
        rows = saved["rows"]  # and the run's own settings, not the report's
        a = argparse.Namespace(**{**vars(a), **saved.get("args", {})})
    else:
        b = SFMPBench(a)
        if "float" not in b.done and b.wants("float"):
            b.float_row()["protocol"] = b.protocol
            b.done["float"] = b.rows[-1]
            b._add_partial()
        points, solvers, mb = [x for x in a.points.split(",") if x], a.solvers.split(","), a.ablation_mb
        if "main" in parts:
            part_main(b, points, solvers)
        if "orig" in parts:
            part_orig(b, points)
        if "reorder" in parts:
            part_reorder(b, points, solvers, mb)
        if "order" in parts:
            part_order(b, points, mb)
        if "blocks" in parts:
            part_blocks(b, points, solvers, mb)
        if "fisher" in parts:
            part_fisher(b, points, solvers, [int(x) for x in a.fisher_samples.split(",")], mb)
        rows = b.rows
    md = report(rows, a)
    print(md)
    write_text(path.with_suffix(".md"), md)
    out = {"benchmark": "sfmp", "protocol": _protocols(rows), "args": vars(a), "rows": rows}
    write_text(path, json.dumps(out, indent=2))
    plot(rows, path.with_name(path.stem + "_bits.png"))


if __name__ == "__main__":
    main()
