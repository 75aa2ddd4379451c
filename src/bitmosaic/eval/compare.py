"""The folder of ``bitmosaic compare`` (:mod:`bitmosaic.cli.compare` runs the configs): what it holds,
and the table and plot made from its finished runs.

``OUT/compare.json`` (written first: it marks a compare folder), ``OUT/runs/<slug>.json`` (each finished
config's ``quantize --json`` record plus a ``compare`` entry; ``float.json`` for the float model),
``OUT/logs/``, ``OUT/models/`` and ``OUT/failures.json``; from those, :func:`collect_rows` and
:func:`write_reports` (re)write ``OUT/results.{csv,json,md}`` and ``OUT/pareto.png``.  ``OUT`` must be
new, empty or a compare folder: a folder of other files is refused, never overwritten
(:func:`check_compare_out`).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

__all__ = [
    "MARKER", "check_compare_out", "collect_rows", "disk_use", "models_bytes", "write_json_atomic",
    "write_reports",
]  # fmt: skip


MARKER = "compare.json"  # written first into every compare folder: what it compares
_OWN_NAMES = {"runs", "logs", "models", "failures.json", "results.csv", "results.json", "results.md",
              "pareto.png", MARKER}  # fmt: skip


def check_compare_out(out: str | Path) -> Path:
    """``out`` resolved, if ``bitmosaic compare`` may write there: a new or empty folder, or one that
    compare wrote (it holds ``compare.json``; a folder from a bitmosaic before that marker holds
    ``runs/`` and nothing but the names compare writes).  Anything else is a one-line
    :class:`~bitmosaic.errors.OutputExistsError`: compare rewrites ``results.*`` and ``pareto.png``."""
    from ..errors import OutputExistsError

    out = Path(out).expanduser().resolve()
    if not out.exists():
        return out
    if not out.is_dir():
        raise OutputExistsError(f"--out {out} exists and is not a folder; choose another --out")
    names = {p.name for p in out.iterdir()}
    if not names or MARKER in names or ("runs" in names and (out / "runs").is_dir() and names <= _OWN_NAMES):
        return out
    raise OutputExistsError(
        f"--out {out} is not empty and is not a bitmosaic compare folder (no {MARKER}); compare would "
        "overwrite its results.csv/results.md: choose a new or empty --out"
    )


def write_json_atomic(path: Path, obj) -> None:
    """``obj`` as indented JSON in ``path``, through ``path.tmp`` renamed into place."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    tmp.replace(path)


def disk_use(out: str | Path) -> int:
    """Bytes of every file under a compare folder (the saved models are most of it)."""
    return sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file())


def models_bytes(path: Path) -> int:
    """Bytes of the safetensors files of a saved model folder ``path`` (0 when it is gone)."""
    return sum(f.stat().st_size for f in path.rglob("*.safetensors")) if path.is_dir() else 0


def collect_rows(out: str | Path, configs: list | None = None) -> list[dict]:
    """One row per finished run under ``out/runs`` (the float model first), in ``configs`` order (each with
    a ``slug``: :class:`bitmosaic.cli.compare.CompareConfig`)."""
    out = Path(out)
    rows: list[dict] = []
    fj = out / "runs" / "float.json"
    if fj.is_file():
        f = json.loads(fj.read_text())
        rows.append({"name": "float", "method": "float", "setting": "", "bits_per_weight": None,
                     "size_mb": None, "ppl": f["ppl"], "kl_mean": 0.0, "kl_p99": 0.0,
                     "top1_agreement": 1.0, "tasks": f.get("tasks", {}), "quant_seconds": None,
                     "peak_rss_mb": None, "cache_hits": ""})  # fmt: skip
    names = [c.slug for c in configs] if configs else sorted(
        p.stem for p in (out / "runs").glob("*.json") if p.stem != "float"
    )
    for slug in names:
        p = out / "runs" / f"{slug}.json"
        if not p.is_file():
            continue
        r = json.loads(p.read_text())
        q = r.get("eval", {}).get("quantized", {})
        meta = r.get("compare", {})
        name = meta.get("name", slug)
        rows.append({
            "name": name,
            "method": meta.get("method", r.get("method", "?")),
            "setting": name.partition(":")[2],
            "bits_per_weight": r.get("bits_per_weight"),
            "size_mb": meta.get("size_bytes", models_bytes(out / "models" / slug)) / 2**20,
            "ppl": q.get("ppl"),
            "kl_mean": q.get("kl_mean"),
            "kl_p99": q.get("kl_p99"),
            "top1_agreement": q.get("top1_agreement"),
            "tasks": r.get("tasks", {}),
            "quant_seconds": r.get("seconds"),
            "peak_rss_mb": r.get("peak_rss_mb"),
            "cache_hits": " ".join((r.get("calibration") or {}).get("cache", {}).get("hits", [])),
        })  # fmt: skip
    return rows


_COLS = ["name", "method", "bits_per_weight", "size_mb", "ppl", "kl_mean", "kl_p99", "top1_agreement",
         "quant_seconds", "peak_rss_mb", "cache_hits"]  # fmt: skip


def _task_cols(rows: list[dict]) -> list[str]:
    return sorted({f"{t}:{m}" for r in rows for t, ms in r["tasks"].items() for m in ms
                   if m in ("acc", "acc_norm", "perplexity")})  # fmt: skip


def _cell(v) -> str:
    if v is None:
        return ""
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write_reports(rows: list[dict], out: str | Path) -> None:
    """``results.csv``, ``results.json``, ``results.md`` and ``pareto.png`` (when anything finished)."""
    from .plots import pareto_plot

    out = Path(out)
    tcols = _task_cols(rows)

    def flat(r):
        d = {k: r[k] for k in _COLS}
        for tc in tcols:
            t, m = tc.split(":")
            d[tc] = r["tasks"].get(t, {}).get(m)
        return d

    flat_rows = [flat(r) for r in rows]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=_COLS + tcols)
    w.writeheader()
    w.writerows(flat_rows)
    (out / "results.csv").write_text(buf.getvalue())
    write_json_atomic(out / "results.json", rows)
    cols = _COLS + tcols
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(_cell(fr[c]) for c in cols) + " |" for fr in flat_rows]
    failures = json.loads((out / "failures.json").read_text()) if (out / "failures.json").is_file() else {}
    if failures:
        md += ["", "Failed (rerun the same command to retry them):", ""]
        md += [f"- `{k}`: {v}" for k, v in failures.items()]
    (out / "results.md").write_text("\n".join(md) + "\n")
    quant = [r for r in rows if r["method"] != "float" and r["bits_per_weight"] is not None]
    if any(r["ppl"] is not None for r in quant):
        fl = next((r["ppl"] for r in rows if r["method"] == "float"), None)
        pareto_plot(quant, out / "pareto.png", float_ppl=fl)
