"""Issue 73 item 4: every SQ-format result row's activation bits, scales counted, recomputed from the
row's own settings (its name: the INT width and A4 group, or the SQ split, strategy and scale groups)
and the model's linear shapes by :func:`bitmosaic.formats.sq_act.act_bits` -- the function the
benchmark's :meth:`SQBench.measured` uses -- without rerunning any perplexity.  Rows measured before
``paper_act_bits_scales`` existed get it; every other row's stored numbers are checked (a difference
is printed and fixed).  Each JSON gets a note saying so.

Run: python -m benchmarks.sq.sq_act_bits [--check]   (--check: report, write nothing)
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, write_text
from bitmosaic.formats.act import ActQuantSpec
from bitmosaic.formats.sq import parse_sq
from bitmosaic.formats.sq_act import SQActLayout, act_bits

FILES = ("sq_format", "sq_format_verdict", "sq_format_verdict_s1", "sq_format_verdict_paper")
NOTE = (
    "issue 73: act_bits (values + fp16 scales + mask) and paper_act_bits_scales (the paper's y or the "
    "INT width, plus the scales) of every row recomputed from the row's settings by "
    "benchmarks/sq/sq_act_bits.py (formats.sq_act.act_bits, MAC-weighted over the model's linears); "
    "no perplexity was rerun"
)
_SQ_ACT = re.compile(r"^W\d+A\(SQ[\d.]*\) (?P<sq>\S+) (?P<strategy>dynamic|static)")
_SCALES = re.compile(r"scales=(?P<scale>token|bank|group(?P<group>\d+))(?P<cal>/calibrated)?")
_INT_ACT = re.compile(r"^W(?:\d+|\(SQ[\d.]+\))A(?P<bits>\d+)(?:\s|$)")
_A_GROUP = re.compile(r" a\d+-g(?P<group>\d+)")


def row_layout(name: str) -> ActQuantSpec | SQActLayout | None:
    """The activation layout a row's name states (KeyError: the name states none, e.g. part defaults)."""
    if m := _SQ_ACT.match(name):
        sc = _SCALES.search(name)
        scale = "token" if sc is None else ("group" if sc["group"] else sc["scale"])
        group = int(sc["group"]) if sc is not None and sc["group"] else None
        return SQActLayout(parse_sq(m["sq"]), m["strategy"], scale, group, bool(sc and sc["cal"]))
    if m := _INT_ACT.match(name):
        bits = int(m["bits"])
        if bits >= 16:
            return None
        g = _A_GROUP.search(name)
        kw = {"granularity": "group", "group_size": int(g["group"])} if g else {}
        return ActQuantSpec("int", bits, **kw)
    raise KeyError(f"no activation layout in row name {name!r}")


def linear_shapes(model: str = "smollm2-135m") -> list[tuple[int, int]]:
    """``(in, out)`` of every linear the SQ benchmark quantizes: those of the decoder layers."""
    from bitmosaic.io import load_model

    m, _ = load_model(model)
    lins = [x for x in m.model.layers.modules() if isinstance(x, torch.nn.Linear)]
    return [(x.in_features, x.out_features) for x in lins]


def row_bits(name: str, shapes: list[tuple[int, int]], tokens: int = 2048) -> tuple[float, float]:
    """(act_bits, paper_act_bits_scales) of row ``name``: :func:`act_bits` MAC-weighted over ``shapes``."""
    layout = row_layout(name)
    macs = sum(i * o for i, o in shapes)
    bits = [(act_bits(i, layout, tokens), i * o) for i, o in shapes]
    return sum(b.total * k for b, k in bits) / macs, sum(b.with_scales * k for b, k in bits) / macs


def backfill(path: Path, shapes: list[tuple[int, int]], write: bool = True) -> tuple[int, int, list[str]]:
    """(rows filled, rows checked, differences) of one result file; writes it back with :data:`NOTE`."""
    data = json.loads(path.read_text())
    filled = checked = 0
    diffs = []
    for r in data["rows"]:
        if "ppl" not in r:
            continue  # part defaults: layer losses, no activations
        total, with_scales = row_bits(r["name"], shapes)
        for key, value in (("act_bits", total), ("paper_act_bits_scales", with_scales)):
            old = r.get(key)
            if old is None:
                filled += key == "paper_act_bits_scales"
            elif abs(old - value) > 1e-9:
                diffs.append(f"{path.stem}: {r['name']} {key} {old} -> {value}")
            r[key] = value
        checked += 1
    if write:
        notes = [n for n in (data.get("notes") or []) if not n.startswith("issue 73:")]
        data["notes"] = [*notes, NOTE]
        write_text(path, json.dumps(data, indent=2))
    return filled, checked, diffs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="report only, write nothing")
    a = p.parse_args()
    shapes = linear_shapes()
    for name in FILES:
        path = RESULTS / f"{name}.json"
        if path.exists():
            filled, checked, diffs = backfill(path, shapes, write=not a.check)
            print(f"{name}: {checked} rows checked, {filled} filled, {len(diffs)} differed")
            for d in diffs:
                print("  " + d)


if __name__ == "__main__":
    main()
