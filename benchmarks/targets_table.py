"""The table of issue 74's targets (``benchmarks/targets.py``): the targets themselves, the pure judge of
one row (:func:`judge`), the rows built from each measurement's numbers, the Markdown of the table, and
the README's "Inference on the CPU" headline lines regenerated from ``targets.json``
(:func:`readme_lines`, :func:`rewrite_readme`).  No measurement here: every function takes numbers."""

from __future__ import annotations

import re
from pathlib import Path

# id -> (what the issue asks, comparison, goal); ratio conventions in each row's builder below
TARGETS = {
    "calib": (
        "`bitmosaic quantize --method gptq` defaults on SmolLM2 (16x512): llm-compressor's time / ours, "
        "at equal or lower perplexity",
        ">=",
        2.0,
    ),
    "layer8b": (
        "Llama-3-8B-shaped layer, streamed GPTQ w4 g128 with the default scale search: seconds per "
        "layer / its FLOP bound",
        "<=",
        1.3,
    ),
    "decode": (
        "decode, plain `bitmosaic.load(dir).generate` of the default W4 result: ours / llama.cpp "
        "tok/s on the same GGUF (Q4_1)",
        ">=",
        1.0,
    ),
    "decode_w2": ("decode, W2 (`bitmosaic.load`): ours / llama.cpp Q2_K tok/s at equal threads", ">=", 1.5),
    "prefill": (
        "W4A8 prefill kernel, every SmolLM2 shape at 512 rows: fp32 time / W4A8 time (worst shape)",
        ">=",
        2.0,
    ),
    "prefill_model": ("whole-model 512-token prefill: SmoothQuant W4A8 time / float time", "<=", 0.5),
}
ORDER = tuple(TARGETS)
BEGIN, END = "<!-- targets:begin -->", "<!-- targets:end -->"


def judge(ratio: float | None, op: str, goal: float, also: bool | None = True) -> bool | None:
    """Whether a row meets its target: ``ratio`` against ``goal`` by ``op`` (``>=`` or ``<=``), and the
    row's other condition ``also`` (the calibration row: perplexity at most the peer's); ``None`` when
    nothing was measured (``ratio`` or ``also`` is ``None``)."""
    if ratio is None or also is None:
        return None
    if op == ">=":
        ok = ratio >= goal
    elif op == "<=":
        ok = ratio <= goal
    else:
        raise ValueError(f"op must be >= or <=, not {op!r}")
    return bool(ok and also)


def row(
    target: str,
    label: str = "",
    *,
    ours: str = "",
    baseline: str = "",
    ratio: float | None = None,
    also: bool | None = True,
    bound: str = "",
    note: str = "",
    numbers: dict | None = None,
) -> dict:
    """One row of the table: ``target`` (a key of :data:`TARGETS`), a ``label`` beside it (``1 thread``),
    what was measured (``ours``), the baseline of the same run, their ratio, the verdict (:func:`judge`),
    the physical bound beside it and a one-line ``note`` (why a row was not measured, a caveat)."""
    what, op, goal = TARGETS[target]
    note = note.strip().splitlines()[0][:240] if note.strip() else ""  # one line
    met = judge(ratio, op, goal, also)
    verdict = "met" if met else ("not met" if met is False else "not measured")
    return {
        "target": target,
        "label": label,
        "asks": what,
        "ours": ours,
        "baseline": baseline,
        "ratio": ratio,
        "goal": f"{op} {goal:g}x",
        "met": met,
        "verdict": verdict,
        "bound": bound,
        "note": note,
        "numbers": numbers or {},
    }


def missing(target: str, label: str, why: str) -> dict:
    """A row whose measurement (or peer) is missing: one line says why; the others still run."""
    return row(target, label, note=why or "not measured")


# -- rows from each measurement's numbers ---------------------------------------------------------------


def calib_rows(ours: dict | None, peer: dict | None, bound: dict | None, why: str = "",
               same: dict | None = None) -> list[dict]:  # fmt: skip
    """speed.py's rows: bitmosaic's defaults (g128) and llm-compressor at g64 (seconds, ppl); with
    ``same`` (bitmosaic at llm-compressor's settings, g64), a second row at equal settings."""
    if ours is None:
        return [missing("calib", "", why or "bitmosaic's row did not run")]
    defaults = "ours w4 g128 (defaults), llm-compressor w4 g64 (it refuses g128 here)"
    out = [_calib_row(ours, peer, bound, why, defaults)]
    if same is not None and peer is not None:
        out.append(_calib_row(same, peer, bound, why, "both w4 g64 asym, static act-order (equal settings)"))
    return out


def _calib_row(ours: dict, peer: dict | None, bound: dict | None, why: str, label: str) -> dict:
    b = (
        (
            f"float32 GEMM {bound['gemm_gflops']:.0f} GFLOP/s; ~{bound['tflop']:.2f} TFLOP -> >= "
            f"{bound['seconds']:.1f} s (ours {ours['seconds'] / bound['seconds']:.1f}x it)"
        )
        if bound
        else ""
    )
    mine = f"{ours['seconds']:.1f} s, ppl {ours['ppl']:.3f}"
    compiled = ours.get("kernels_compiled")  # not a measurement of the calibration: rerun
    compiled = f"compiled {', '.join(compiled)} inside the timed run" if compiled else ""
    if peer is None:
        note = "; ".join(filter(None, [why or "llm-compressor not run", compiled]))
        return row("calib", "", ours=mine, also=None, bound=b, note=note, numbers={"ours": ours})
    above = "" if ours["ppl"] <= peer["ppl"] else "perplexity above llm-compressor's"
    return row(
        "calib",
        label,
        ours=mine,
        baseline=f"llm-compressor {peer['seconds']:.1f} s, ppl {peer['ppl']:.3f}",
        ratio=peer["seconds"] / ours["seconds"],
        also=ours["ppl"] <= peer["ppl"] and not compiled,
        bound=b,
        note="; ".join(filter(None, [compiled, above])),
        numbers={"ours": ours, "peer": peer},
    )


def layer_row(res: dict | None, why: str = "") -> dict:
    """real_shapes.py's results: seconds per layer after the first against FLOPs / GEMM rate."""
    if not res or not res.get("layer_seconds"):
        return missing("layer8b", "", why or "no layer finished")
    mean, bound = res["mean_s_per_layer_after_first"], res["bound_s_per_layer"]
    return row(
        "layer8b",
        res["shape"],
        ours=f"{mean:.1f} s/layer (after the first)",
        baseline=f"FLOP bound {bound:.1f} s",
        ratio=mean / bound,
        bound=f"float32 GEMM {res['gemm_gflops_fp32']:.0f} GFLOP/s, {res['layer_tflop']['total']:.2f} "
        "TFLOP/layer",
        numbers=res,
    )


def decode_row(
    target: str,
    threads: int,
    ours: dict | None,
    peer: dict | None,
    peer_name: str,
    bandwidth_gbs: float | None,
    why: str = "",
) -> dict:
    """decode.py's child rows (tok/s) at one thread count; bound: read bandwidth / bytes a token reads."""
    label = f"{threads} thread{'s' if threads > 1 else ''}"
    if ours is None:
        return missing(target, label, why or "bitmosaic's decode did not run")
    path = "compiled" if ours.get("compiled") else "eager"
    mine = f"{ours['decode_tok_s']:.1f} tok/s ({path})"
    b = ""
    if bandwidth_gbs and ours.get("linears_resident_mb"):
        mb = ours["linears_resident_mb"]
        b = (
            f"read {bandwidth_gbs:.1f} GB/s / {mb:.0f} MB of linears = "
            f"{bandwidth_gbs * 1e3 / (mb * 1.048576):.0f} "
            "tok/s (head excluded)"
        )
    if peer is None:
        return row(
            target, label, ours=mine, bound=b, note=why or f"{peer_name} not run", numbers={"ours": ours}
        )
    return row(
        target,
        label,
        ours=mine,
        baseline=f"{peer_name} {peer['decode_tok_s']:.1f} tok/s",
        ratio=ours["decode_tok_s"] / peer["decode_tok_s"],
        bound=b,
        note="" if ours.get("compiled") else "decoded eagerly (compiled decode off or not available)",
        numbers={"ours": ours, "peer": peer},
    )


def prefill_row(threads: int, shapes: list[dict]) -> dict:
    """int_gemm.measure rows at one thread count: the worst shape's fp32 / W4A8 ratio."""
    label = f"{threads} thread{'s' if threads > 1 else ''}, {shapes[0]['M'] if shapes else '?'} rows"
    if not shapes:
        return missing("prefill", label, "no shape measured")
    ratios = {r["shape"]: r["fp32"] / r["w4a8_int"] for r in shapes}
    worst = min(shapes, key=lambda r: ratios[r["shape"]])
    each = ", ".join(f"{s} {v:.2f}x" for s, v in ratios.items())
    return row(
        "prefill",
        label,
        ours=f"W4A8 {worst['w4a8_int']:.3f} ms at {worst['shape']} ({each})",
        baseline=f"fp32 {worst['fp32']:.3f} ms",
        ratio=ratios[worst["shape"]],
        bound=f"int8 GEMM bound {worst['int8_bound']:.3f} ms at {worst['shape']} (W4A8 "
        f"{worst['w4a8_int'] / worst['int8_bound']:.1f}x it)",
        numbers={"shapes": shapes},
    )


def prefill_model_row(r: dict | None, why: str = "") -> dict:
    """prefill.py's row for one thread count (ms of one forward)."""
    if r is None:
        return missing("prefill_model", "", why or "not run")
    label = f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}, {r['tokens']} tokens"
    return row(
        "prefill_model",
        label,
        ours=f"SmoothQuant W4A8 {r['w4a8_ms']:.0f} ms",
        baseline=f"float {r['float_ms']:.0f} ms",
        ratio=r["ratio"],
        bound=f"int8 GEMM {r['int8_gops']:.0f} GOPS: linears >= {r['int8_bound_ms']:.0f} ms",
        numbers=r,
    )


# -- the Markdown and the README --------------------------------------------------------------------------


def _ratio(r: dict) -> str:
    return "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"


def markdown(rows: list[dict], machine: dict, command: str, smoke: bool = False) -> str:
    """The table with the machine (CPU, cores, load average before/after) and the exact command."""
    before, after = machine.get("loadavg_before"), machine.get("loadavg_after")
    la = lambda v: "?" if v is None else " / ".join(f"{x:.2f}" for x in v)  # noqa: E731
    md = [
        "# Issue 74's targets, measured in one run"
        + (" (SMOKE: tiny sizes, not a measurement)" if smoke else ""),
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine.get('cpu')}, {machine.get('cpus')} logical CPUs; torch {machine.get('torch')}; "
        f"load average (1/5/15 min) before {la(before)}, after {la(after)}; "
        f"commit {machine.get('commit', '?')}; "
        f"{machine.get('date', '')}.",
        "",
        "| target | measured | ours | baseline (same run) | ratio | target | verdict | physical bound "
        "| note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        verdict = {"met": "**met**", "not met": "not met"}.get(r["verdict"], r["verdict"])
        md.append(
            f"| {r['target']} | {r['label']} | {r['ours']} | {r['baseline']} | {_ratio(r)} | {r['goal']} "
            f"| {verdict} | {r['bound']} | {r['note']} |"
        )
    md += ["", "Targets (issue 74):", ""] + [f"- `{k}`: {t[0]}, {t[1]} {t[2]:g}x" for k, t in TARGETS.items()]
    return "\n".join(md)


def readme_lines(data: dict) -> list[str]:
    """The README's headline lines for the targets, from ``targets.json``'s contents."""
    if data.get("smoke"):
        raise ValueError("targets.json holds a --smoke run (tiny sizes): run the real one first")
    m = data["machine"]
    short = {
        "calib": "GPTQ calibration vs llm-compressor",
        "layer8b": "8B-shaped layer vs its FLOP bound",
        "decode": "decode W4 vs llama.cpp Q4_1",
        "decode_w2": "decode W2 vs llama.cpp Q2_K",
        "prefill": "W4A8 prefill kernel vs fp32 (worst SmolLM2 shape)",
        "prefill_model": "512-token prefill, SmoothQuant W4A8 / float",
    }
    out = [
        f"Issue 74's targets, measured in one run on {m.get('cpu')} ({m.get('cpus')} CPUs, "
        f"{m.get('date', '')}; "
        "`python -m benchmarks.targets`, table: "
        "[benchmarks/results/targets.md](benchmarks/results/targets.md)):"
    ]
    for r in data["rows"]:
        label = f", {r['label']}" if r["label"] else ""
        got = _ratio(r) if r["ratio"] is not None else (r["note"] or "not measured")
        out.append(
            f"- {short.get(r['target'], r['target'])}{label}: {got} (target {r['goal']}: {r['verdict']})"
        )
    return out


def rewrite_readme(readme: Path, data: dict) -> bool:
    """Replace the lines between :data:`BEGIN` and :data:`END` in ``readme`` with :func:`readme_lines`;
    returns whether the file changed.  Raises ``ValueError`` where the markers are missing."""
    text = readme.read_text()
    pat = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)
    if not pat.search(text):
        raise ValueError(f"{readme} has no {BEGIN} ... {END} block")
    new = pat.sub(lambda _: "\n".join([BEGIN, *readme_lines(data), END]), text, count=1)
    if new != text:
        readme.write_text(new)
    return new != text
