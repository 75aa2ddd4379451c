"""Plots of comparison results: perplexity against bits per weight, with the Pareto frontier.

matplotlib is imported lazily with the ``Agg`` backend (no display needed).
"""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["pareto_front", "pareto_plot"]


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
    on a log axis against bits per weight, one marker a method, labels, the frontier as a line and the
    float model as a dashed line.  Returns the matplotlib ``Figure`` (closed; its axes keep the data)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if r.get("ppl") is not None and math.isfinite(r["ppl"])]
    if not pts:
        raise ValueError("no finished configuration with a finite perplexity to plot")
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=100)
    methods = sorted({r["method"] for r in pts})
    markers = "os^Dv<>pP*Xh"
    for k, m in enumerate(methods):
        mine = [r for r in pts if r["method"] == m]
        ax.scatter(
            [r["bits_per_weight"] for r in mine],
            [r["ppl"] for r in mine],
            marker=markers[k % len(markers)],
            s=46,
            label=m,
            zorder=3,
        )
        for r in mine:
            ax.annotate(r["name"], (r["bits_per_weight"], r["ppl"]), fontsize=7, xytext=(4, 3),
                        textcoords="offset points")  # fmt: skip
    front = pareto_front([(r["bits_per_weight"], r["ppl"]) for r in pts])
    ax.plot(
        [pts[i]["bits_per_weight"] for i in front],
        [pts[i]["ppl"] for i in front],
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
