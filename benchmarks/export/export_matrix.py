"""Which method's result each export format holds: exported (bit-identical), refused (why), or lossy
(the weight error ``--lossy`` adds, measured).

Every method is run on the same model (the tiny 2-layer Llama of the tests by default, or SmolLM2-135M
with ``--model smollm2-135m``), saved, then exported to GPTQ (v1, and v2 when v1 refuses), and to
compressed-tensors, first exactly and, when refused, with ``--lossy``.  Prints a Markdown table and
writes benchmarks/results/export_matrix[_smollm2].json and .md.

    PYTHONPATH=src python -m benchmarks.export.export_matrix       # tiny model, ~1 min
    flock /tmp/bitmosaic-heavy.lock env PYTHONPATH=src python -m benchmarks.export.export_matrix \\
        --model smollm2-135m
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, write_results
from bitmosaic import quantize_
from bitmosaic.io import save_quantized
from bitmosaic.io.export import ExportError, export_model


def methods(group: int) -> list[tuple[str, str, dict]]:
    g = {"group_size": group}
    return [
        ("rtn w4 asym", "rtn", {"bits": 4, **g}),
        ("rtn w4 sym", "rtn", {"bits": 4, "sym": True, **g}),
        ("gptq act-order", "gptq", {"bits": 4, "order": "act", **g}),
        ("gptq gar", "gptq", {"bits": 4, "order": "gar", **g}),
        ("gptq static groups", "gptq", {"bits": 4, "order": "act", "static_groups": True, **g}),
        ("gptq w3 no-clip", "gptq", {"bits": 3, "order": "act", "clip": False, **g}),
        ("babai", "babai", {"bits": 4, **g}),
        ("ssqr", "ssqr", {"bits": 4, **g}),
        ("hptq", "hptq", {}),
        ("hrtn", "hrtn", {}),
        ("smoothquant W8A8", "smoothquant", {"scheme": "W8A8", "group_size": None, "sym": True}),
        ("awq", "awq", {"bits": 4, **g}),
        ("dpq W4A8-FP8", "dpq", {"bits": 4, **g}),
        ("fp8 e4m3", "fp8", {}),
    ]


def try_export(src: Path, out: Path, fmt: str, **kw) -> dict:
    try:
        r = export_model(src, out, fmt, overwrite=True, **kw)
    except ExportError as e:
        return {"status": "refused", "why": str(e)}
    s = r.summary()
    changes = sorted({c for rec in r.changed for c in rec.changes})
    return {"status": "lossy" if r.changed else "exported", **s, "changes": changes, "notes": r.notes}


def cell(res: dict) -> str:
    if res["status"] == "exported":
        return "exported (bit-identical)"
    if res["status"] == "lossy":
        return f"lossy: rel err {res['mean_rel_err']:.2e} (max {res['max_rel_err']:.2e})"
    return "refused"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="tiny", help="tiny (tests' 2-layer Llama) or smollm2-135m")
    p.add_argument("--nsamples", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", default=None, help="comma list of row names to run")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.model == "tiny":
        from bitmosaic.testing import SPECIALS, VOCAB, tiny_llama, word_tokenizer

        base, tok, group = tiny_llama(), word_tokenizer(), 32
        calib = torch.randint(len(SPECIALS), VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
        suffix = ""
    else:
        from bitmosaic.data import calibration_samples
        from bitmosaic.io import load_model

        base, tok = load_model(a.model)
        calib = calibration_samples(tok, "wikitext2", a.nsamples, a.seqlen, 0)
        group, suffix = 128, "_smollm2"
    rows = []
    only = set(a.only.split(",")) if a.only else None
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        for name, method, opts in methods(group):
            if only and name not in only:
                continue
            m = copy.deepcopy(base)
            quantize_(m, method, calib, progress=False, **opts)
            src = save_quantized(m, d / "src", {"method": method}, tokenizer=tok, overwrite=True)
            del m
            row = {"name": name, "method": method, "options": {k: str(v) for k, v in opts.items()}}
            row["gptq"] = try_export(src, d / "gptq", "gptq")  # checkpoint_format auto: v2 when asymmetric
            if row["gptq"]["status"] == "refused" and "pass --lossy" in row["gptq"]["why"]:
                row["gptq_lossy"] = try_export(src, d / "gptq", "gptq", lossy=True)
            row["ct"] = try_export(src, d / "ct", "compressed-tensors")
            if row["ct"]["status"] == "refused" and "pass --lossy" in row["ct"]["why"]:
                row["ct_lossy"] = try_export(src, d / "ct", "compressed-tensors", lossy=True)
            rows.append(row)
            print(f"{name}: gptq {row['gptq']['status']}, ct {row['ct']['status']}", flush=True)
    lines = [
        f"Export matrix on {a.model} (group {group}); weight error = relative Frobenius error added per "
        "layer, "
        "mean (max) over layers",
        "",
        "| method | GPTQ (v1/v2 by symmetry) | GPTQ --lossy |"
        " compressed-tensors | compressed-tensors --lossy |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        g2 = r.get("gptq_lossy")
        lines.append(
            f"| {r['name']} | {cell(r['gptq'])} | {cell(g2) if g2 else ''} | {cell(r['ct'])} | "
            f"{cell(r['ct_lossy']) if 'ct_lossy' in r else ''} |"
        )
    lines += ["", "Refusal reasons:", ""]
    for r in rows:
        for k in ("gptq", "gptq_lossy", "ct", "ct_lossy"):
            if k in r and r[k]["status"] == "refused":
                lines.append(f"- {r['name']} / {k}: {r[k]['why']}")
        for k in ("gptq_lossy", "ct_lossy"):
            if k in r and r[k].get("changes"):
                lines.append(f"- {r['name']} / {k} changes: {'; '.join(r[k]['changes'])}")
    md = "\n".join(lines)
    print(md)
    out = {"model": a.model, "rows": rows}
    write_results(RESULTS / f"export_matrix{suffix}.json", "export_matrix", out, md)


if __name__ == "__main__":
    main()
