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


def write_results(path: str | os.PathLike | None, name: str, out: dict, markdown: str | None = None) -> Path:
    """Write ``out`` (with ``benchmark`` and ``machine`` filled in when absent) as JSON to ``path``
    (default ``benchmarks/results/<name>.json``) and ``markdown`` beside it (``.md``), atomically."""
    path = Path(path) if path else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {"benchmark": name, **out}
    out.setdefault("machine", machine_info())
    atomic_write_text(path, json.dumps(out, indent=2, default=str))
    if markdown is not None:
        atomic_write_text(path.with_suffix(".md"), markdown.rstrip() + "\n")
    print(f"\nJSON written to {path}")
    return path
