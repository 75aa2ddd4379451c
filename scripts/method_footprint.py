#!/usr/bin/env python3
"""How many source files each method touches: the files whose *code* (comments and docstrings
stripped) names the method or its own modules.  A new method should be one algorithms file, one
methods file and one registration line (plus a module kind and kernel for a new storage format).

    python scripts/method_footprint.py            # a Markdown table
    python scripts/method_footprint.py --json     # {method: [files]}
"""

from __future__ import annotations

import ast
import io
import json
import re
import sys
import tokenize
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "bitmosaic"

# the words that mean a method in code: its registered names, its class/module stems (one row per
# methods file: hptq.py registers hptq and its RTN variant hrtn)
METHODS: dict[str, tuple[str, ...]] = {
    "rtn": ("rtn",),
    "gptq": ("gptq",),
    "babai": ("babai",),
    "awq": ("awq",),
    "smoothquant": ("smoothquant",),
    "dpq": ("dpq",),
    "fp8": ("fp8",),
    "ssqr": ("ssqr",),
    "hptq/hrtn": ("hptq", "hrtn", "huffman"),
    "sq-weights": ("sq-weights", "sq_weights", "sqweight"),
    "sq-acts": ("sq-acts", "sq_acts", "sqact"),
    "sfmp": ("sfmp",),
    "mosaic": ("mosaic",),
}
# shared pieces several methods build on (they are not one method's footprint)
SHARED = {"__init__.py"}


def code_text(path: Path) -> str:
    """The file with comments and docstrings removed (C++: // and /* */ comments removed)."""
    src = path.read_text(encoding="utf-8")
    if path.suffix in (".cpp", ".h"):
        return re.sub(r"//[^\n]*|/\*.*?\*/", "", src, flags=re.S)
    doc_lines: set[int] = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            first = body[0] if body else None
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
                doc_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT or tok.start[0] in doc_lines:
            continue
        out.append(tok.string)
    return " ".join(out)


def footprint() -> dict[str, list[str]]:
    files = sorted(
        p for p in PKG.rglob("*") if p.suffix in (".py", ".cpp", ".h") and "__pycache__" not in p.parts
    )
    texts = {p: code_text(p).lower() for p in files}
    out = {}
    for method, words in METHODS.items():
        pat = re.compile(r"(?<![a-z0-9])(" + "|".join(re.escape(w) for w in words) + r")")
        out[method] = [str(p.relative_to(PKG)) for p, t in texts.items() if pat.search(t)]
    return out


def main(argv: list[str]) -> int:
    fp = footprint()
    if "--json" in argv:
        print(json.dumps(fp, indent=1))
        return 0
    print("| method | files | which |\n|---|---|---|")
    for m, fs in fp.items():
        print(f"| {m} | {len(fs)} | {', '.join(fs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
