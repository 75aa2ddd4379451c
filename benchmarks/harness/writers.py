"""The one writer of the benchmarks' results: JSON, and a Markdown table beside it, atomically, into
``benchmarks/results/`` (:data:`RESULTS`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks import RESULTS
from benchmarks.harness.machine import machine_info
from bitmosaic.io.saved.outdir import atomic_write_text


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write a text file (a Markdown table, a figure's data) atomically: a temporary file, renamed."""
    atomic_write_text(path, text)


# lists written on one line (a row's per-window NLLs: one number per test window, not one line each)
ONE_LINE = ("window_nll",)


def dumps_results(out: dict) -> str:
    """``out`` as the results' JSON: indented, with the lists named in :data:`ONE_LINE` on one line."""
    inline: list[str] = []

    def mark(x):
        if isinstance(x, dict):
            return {
                k: _mark_list(v) if k in ONE_LINE and isinstance(v, list) else mark(v) for k, v in x.items()
            }
        if isinstance(x, list | tuple):
            return [mark(v) for v in x]
        return x

    def _mark_list(v: list) -> str:
        inline.append(json.dumps(v, separators=(",", ":")))
        return f"@@one-line-{len(inline) - 1}@@"

    text = json.dumps(mark(out), indent=2, default=str)
    for i, v in enumerate(inline):
        text = text.replace(f'"@@one-line-{i}@@"', v, 1)
    return text


def write_results(path: str | os.PathLike | None, name: str, out: dict, markdown: str | None = None) -> Path:
    """Write ``out`` (with ``benchmark`` and ``machine`` filled in when absent) as JSON to ``path``
    (default ``benchmarks/results/<name>.json``) and ``markdown`` beside it (``.md``), atomically."""
    path = Path(path) if path else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {"benchmark": name, **out}
    out.setdefault("machine", machine_info())
    atomic_write_text(path, dumps_results(out))
    if markdown is not None:
        atomic_write_text(path.with_suffix(".md"), markdown.rstrip() + "\n")
    print(f"\nJSON written to {path}")
    return path
