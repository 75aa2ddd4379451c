"""Plots of comparison results: perplexity against bits per weight, with the Pareto frontier.

matplotlib is imported lazily with the ``Agg`` backend (no display needed).
"""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["pareto_front", "pareto_plot"]

CLIP = 50.0  # perplexities above CLIP x the best plotted one go on the top edge


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats: none has lower-or-equal bits *and* lower-or-equal
    perplexity with one of them strictly lower.  Sorted by bits."""
    keep = []
    for i, (b, p) in enumerate(points):
        dominated = any(
            (b2 <= b and p2 <= p) and (b2 < b or p2 < p) for j, (b2, p2) in enumerate(points) if j != i
        )
        if not dominated and math.isfinite(p):
            keep.append(i)
    return sorted(keep, key=lambda i: (points[i][0], points[i][1]))


def pareto_plot(rows: list[dict], path: str | Path, title: str = "", float_ppl: float | None = None):
    """Write a PNG of ``rows`` (each with ``name``, ``method``, ``bits_per_weight``, ``ppl``): perplexity
    on a log axis against bits per weight, one marker a method, the frontier as a labelled line and the
    float model as a dashed line; a perplexity above ``CLIP`` x the best one is drawn on the top edge
    with its value.  Returns the matplotlib ``Figure`` (closed; its axes keep the data)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if r.get("ppl") is not None and math.isfinite(r["ppl"])]
    if not pts:
        raise ValueError("no finished configuration with a finite perplexity to plot")
    fig, ax = plt.subplots(figsize=(9, 6), dpi=100)
    # one collapsed config (e.g. RTN at 2 bits, ppl ~1e6) would squeeze every other point into a
    # band: perplexities above CLIP x the best one are drawn on the top edge, labelled with their value
    top = CLIP * min(r["ppl"] for r in pts)
    front = set(pareto_front([(r["bits_per_weight"], r["ppl"]) for r in pts]))
    methods = sorted({r["method"] for r in pts})
    markers = "os^Dv<>pP*Xh"
    for k, m in enumerate(methods):
        mine = [(i, r) for i, r in enumerate(pts) if r["method"] == m]
        ax.scatter(
            [r["bits_per_weight"] for _, r in mine],
            [min(r["ppl"], top) for _, r in mine],
            marker=markers[k % len(markers)],
            s=46,
            label=m,
            zorder=3,
        )
        for i, r in mine:  # labels on the frontier and on clipped points; the table names the rest
            if r["ppl"] > top:
                text = f"{r['name']} ({r['ppl']:.3g}, off scale)"
            elif i in front:
                text = r["name"]
            else:
                continue
            ax.annotate(text, (r["bits_per_weight"], min(r["ppl"], top)), fontsize=7, xytext=(4, 3),
                        textcoords="offset points")  # fmt: skip
    front = sorted(front, key=lambda i: (pts[i]["bits_per_weight"], pts[i]["ppl"]))
    ax.plot(
        [pts[i]["bits_per_weight"] for i in front],
        [min(pts[i]["ppl"], top) for i in front],
        "k-",
        lw=1.2,
        alpha=0.7,
        label="Pareto frontier",
        zorder=2,
    )
    if float_ppl is not None and math.isfinite(float_ppl):
        ax.axhline(float_ppl, color="grey", ls="--", lw=1, label=f"float ({float_ppl:.2f})")
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight (every stored tensor counted)")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title(title or "perplexity vs bits per weight")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    tmp.replace(path)
    plt.close(fig)
    return fig
