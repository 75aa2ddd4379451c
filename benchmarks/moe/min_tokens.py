"""Where an expert's own Hessian beats the pooled one: the default of ``--moe-min-tokens`` (issue 71).

One random MoE layer (``hidden`` 256 and 512, 16 experts, top-2 with renormalised weights, expert
width ``hidden/2``; router and expert weights ~ N(0, 1/hidden)) on real WikiText-2 token embeddings
(:mod:`benchmarks.moe.inputs`; RMS-normalised per token, as the layer norm before a router does),
64 x 512 calibration tokens and 16 x 512 held-out ones.  For every expert and ``n`` calibration rows
(a random subset of the rows routed to it) its ``gate_proj`` is quantized by GPTQ (4 and 3 bits,
groups of 128, the method's defaults otherwise) with

* ``own``: its Hessian from those ``n`` rows, ``2/n sum w^2 x x^T`` (``--moe-calib routed``);
* ``pooled``: the layer's pooled Hessian (every expert's routed calibration rows: ``--moe-fallback pooled``);
* ``rtn``: no Hessian, round-to-nearest with MSE scales (``--moe-fallback rtn``);

and scored by the relative output error ``sum v^2 |dW y|^2 / sum v^2 |W y|^2`` on the *held-out* rows
``y`` routed to it (weights ``v``): the error it makes on the tokens it will see, not on the few it
was fitted to.  The table gives the mean over experts (2 draws of the subset each).  Simulated routing
(random router): the threshold it gives is a property of the Hessian's rank, not of a trained router.

``--source hidden`` feeds SmolLM2's contextual residual stream after layer 8 instead of the raw token
embeddings (a repeated token then differs by context, as in a real layer).

Run: python -m benchmarks.moe.min_tokens [--source hidden]
(writes benchmarks/results/moe_min_tokens[_hidden].{json,md})
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.harness import write_results
from benchmarks.moe.inputs import SIMULATED, wikitext_embeddings, wikitext_hidden
from bitmosaic.methods import LayerStats, get_method

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _route(x, router, k):
    """Top-``k`` experts and renormalised softmax weights per token."""
    p = torch.softmax(x @ router.T, dim=-1)
    w, idx = p.topk(k, dim=-1)
    return idx, w / w.sum(-1, keepdim=True)


def _rows(x, idx, w, e):
    hit = (idx == e).nonzero()
    return x[hit[:, 0]], w[hit[:, 0], hit[:, 1]]


def _hessian(x, w):
    xw = x * w[:, None]
    return 2.0 / max(x.shape[0], 1) * xw.T @ xw


def _rel(W, Wq, y, v):
    d = (y * v[:, None]) @ (W - Wq).T
    r = (y * v[:, None]) @ W.T
    return float(d.pow(2).sum() / r.pow(2).sum())


def _gptq(W, H, cfg):
    res = get_method("gptq").quantize(W.clone(), LayerStats(hessian=H.clone()), cfg)
    return res.dequantize(torch.float32)


def measure(hidden: int, bits: int, x_cal, x_eval, experts=16, k=2, draws=2, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(experts, hidden, generator=g) / hidden**0.5
    gates = torch.randn(experts, hidden // 2, hidden, generator=g) / hidden**0.5
    norm = lambda t: t / t.pow(2).mean(-1, keepdim=True).sqrt()  # noqa: E731
    xc, xe = norm(x_cal), norm(x_eval)
    ic, wc = _route(xc, router, k)
    ie, we = _route(xe, router, k)
    pooled = sum(_hessian(*_rows(xc, ic, wc, e)) * _rows(xc, ic, wc, e)[0].shape[0] for e in range(experts))
    pooled = pooled / (xc.shape[0] * k)
    gcfg = get_method("gptq").make_config(bits=bits, group_size=128)
    rcfg = get_method("rtn").make_config(bits=bits, group_size=128, scale="mse")
    out = {n: {"own": [], "pooled": [], "rtn": []} for n in ROWS}
    for e in range(experts):
        X, w = _rows(xc, ic, wc, e)
        Y, v = _rows(xe, ie, we, e)
        W = gates[e]
        base = {
            "pooled": _rel(W, _gptq(W, pooled, gcfg), Y, v),
            "rtn": _rel(W, get_method("rtn").quantize(W, LayerStats(), rcfg).dequantize(torch.float32), Y, v),
        }
        for n in (n for n in ROWS if n <= X.shape[0]):
            for _ in range(draws):
                pick = torch.randperm(X.shape[0], generator=g)[:n]
                out[n]["own"].append(_rel(W, _gptq(W, _hessian(X[pick], w[pick]), gcfg), Y, v))
            out[n]["pooled"].append(base["pooled"])
            out[n]["rtn"].append(base["rtn"])
    table = {
        n: {key: sum(vals) / len(vals) for key, vals in d.items()} | {"experts": len(d["pooled"])}
        for n, d in out.items()
        if d["pooled"]
    }
    beats = [n for n, r in table.items() if r["own"] < r["pooled"]]
    routed = [int((ic == e).sum()) for e in range(experts)]
    return {"hidden": hidden, "bits": bits, "table": table, "own_beats_pooled_from": min(beats, default=None),
            "calib_rows_per_expert": routed}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 512])
    p.add_argument("--bits", type=int, nargs="+", default=[4, 3])
    p.add_argument(
        "--source",
        choices=("embeddings", "hidden"),
        default="embeddings",
        help="token embeddings, or SmolLM2's residual stream after layer 8 (contextual)",
    )
    p.add_argument("--json", default=None)
    a = p.parse_args()
    name = "moe_min_tokens" + ("" if a.source == "embeddings" else "_hidden")
    t0 = time.perf_counter()
    what = (
        "token embeddings" if a.source == "embeddings" else "SmolLM2 hidden states after layer 8 (contextual)"
    )
    runs, md = [], [f"# Own vs pooled vs RTN for thin experts, inputs: {what} ({SIMULATED})", ""]
    for hidden in a.hidden:
        get = wikitext_embeddings if a.source == "embeddings" else wikitext_hidden
        x = get(80, 512, hidden).reshape(-1, hidden)
        x_cal, x_eval = x[: 64 * 512], x[64 * 512 :]
        for bits in a.bits:
            r = measure(hidden, bits, x_cal, x_eval)
            runs.append(r)
            md += [f"## hidden {hidden}, {bits} bits, g128: held-out relative output error of gate_proj "
                   f"(mean over experts); own beats pooled from n = {r['own_beats_pooled_from']}", "",
                   "| n rows | own | pooled | rtn | experts |", "|---:|---:|---:|---:|---:|"]  # fmt: skip
            md += [f"| {n} | {t['own']:.4f} | {t['pooled']:.4f} | {t['rtn']:.4f} | {t['experts']} |"
                   for n, t in r["table"].items()]  # fmt: skip
            md.append("")
            print("\n".join(md[-len(r["table"]) - 4 :]))
    write_results(a.json, name, {"simulated": SIMULATED, "source": a.source, "runs": runs,
                                             "seconds": time.perf_counter() - t0}, "\n".join(md))  # fmt: skip


if __name__ == "__main__":
    main()
