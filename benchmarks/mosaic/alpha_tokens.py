"""Why MosaicQuant's α search can lose to no smoothing (issue 73 item 7): which tokens its loss weighs.

The search (``methods/mosaic.py``, the objective the paper states) picks, per layer and foldable group,
the α of the smallest summed output error ``Σ_t e_t`` on a token sample of the float inputs, ``e_t =
Σ_i ||x_t W_iᵀ - Q_x(x_t / s) Ŵ_i(s)ᵀ||²``.  A sum of squares is ruled by the tokens of the largest
outputs (a few "massive activation" tokens -- the first token of a sequence, delimiters -- have
hidden states 10-100x the others'), while perplexity averages over every token.  For every layer and
group of SmolLM2-135M, on the method's own token sample and each candidate (the default grid 0.3..1.0
and ``s = 1``, no smoothing), this reports:

* ``mse``: the search's loss; ``rel``: the mean over tokens of ``e_t / ||x_t Wᵀ||²`` (each token's
  relative error, the same weight for every token);
* the α the search picks (the default grid, as the method: ``s = 1`` not among them) and the candidate
  of the smallest ``rel`` (``s = 1`` among them), and the search pick's ``mse`` and ``rel`` against no
  smoothing's;
* ``top1%``: the share of the search's loss held by the 1% of tokens with the largest error.

Activation quantization simulated as in the method (fake-quantized inputs, float32 matmul); W4A8
(per-token INT8) unless ``--scheme W4A4``.  Each layer's inputs come from the float model.

    python -m benchmarks.mosaic.alpha_tokens [--layers 0-29 | 2,10,20] [--scheme W4A8] [--nsamples 16]
      (writes benchmarks/results/mosaic_alpha_tokens.{json,md})
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness import RESULTS, machine_info, write_results
from benchmarks.mosaic.mosaic_layers import float_layer_inputs
from bitmosaic.algorithms.smooth import smooth_scales
from bitmosaic.formats.act import ActQuantSpec
from bitmosaic.methods import get_method
from bitmosaic.methods.common import act_fake_quant
from bitmosaic.methods.mosaic import ALPHA_GRID, mosaic_weight
from bitmosaic.pipeline.capture import capture_groups, run_layer

ACTS = {"W4A8": ActQuantSpec("int", 8), "W4A4": ActQuantSpec("int", 4, granularity="group", group_size=128)}


def token_errors(X, weights, s, qw, qx) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: ``e_t`` (module doc) and ``||x_t Wᵀ||²`` summed over the group's weights."""
    Xq = qx(X / s)
    err = torch.zeros(X.shape[0], dtype=torch.float64)
    ref = torch.zeros_like(err)
    for W in weights:
        Y = X @ W.T
        d = Y - Xq @ qw(W * s, s).T
        err += d.double().pow(2).sum(1)
        ref += Y.double().pow(2).sum(1)
    return err, ref


def group_rows(cap, cfg, qx) -> dict:
    X = cap.sample.float()
    H = cap.hessian.float()
    amax = cap.observer.channel_absmax.float()
    weights = [cap.weights[n].float() for n in cap.names]
    tie = None if cap.foldable else cap.tie

    def qw(Ws, s):
        Hs = H / (s[:, None] * s[None, :])
        res = mosaic_weight(Ws, Hs, cfg, cfg.budget_frac, report=False, act_amax=amax)
        return res.dequantize(torch.float32)

    cands = {str(a): smooth_scales(amax, weights, a, tie=tie).float() for a in cfg.alpha_grid}
    cands["none"] = torch.ones_like(amax)
    out = {}
    for name, s in cands.items():
        e, n = token_errors(X, weights, s, qw, qx)
        k = max(1, len(e) // 100)
        out[name] = {"mse": float(e.sum()), "rel": float((e / n.clamp_min(1e-30)).mean()),
                     "top1_share": float(e.topk(k).values.sum() / e.sum())}  # fmt: skip
    grid = [c for c in out if c != "none"]  # the method's default search: the grid, without s = 1
    pick_mse = min(grid, key=lambda c: out[c]["mse"])
    pick_rel = min(out, key=lambda c: out[c]["rel"])
    return {"names": list(cap.names), "candidates": out, "pick_mse": pick_mse, "pick_rel": pick_rel,
            "rel_pick_over_none": out[pick_mse]["rel"] / out["none"]["rel"],
            "mse_pick_over_none": out[pick_mse]["mse"] / out["none"]["mse"]}  # fmt: skip


def markdown(res: dict, command: str) -> str:
    md = [f"# MosaicQuant's α search by token: SmolLM2-135M, {res['scheme']}", "", f"`{command}`", "",
          "Per layer and group: the α the search picks (smallest summed error, `mse`) and the one of the "
          "smallest mean per-token relative error (`rel`), the search pick's loss and mean relative "
          "error against no smoothing's (`s = 1`), and the share of its loss in the top 1% of tokens.", "",
          "| layer | group | pick (mse) | pick (rel) | mse: pick / none | rel: pick / none | top-1% share |",
          "|---|---|---|---|---|---|---|"]  # fmt: skip
    for li, groups in res["layers"].items():
        for g in groups:
            c = g["candidates"][g["pick_mse"]]
            md.append(f"| {li} | {'/'.join(n.split('.')[-1] for n in g['names'])} | {g['pick_mse']} | "
                      f"{g['pick_rel']} | {g['mse_pick_over_none']:.3f} | {g['rel_pick_over_none']:.3f} | "
                      f"{c['top1_share']:.2f} |")  # fmt: skip
    s = res["summary"]
    md += ["", f"Groups: {s['groups']}; the search's pick has a larger mean relative error than no "
           f"smoothing in {s['worse_rel']}, a larger summed error in {s['worse_mse']} (geometric mean "
           f"rel pick/none {s['gmean_rel']:.3f}, mse pick/none {s['gmean_mse']:.3f}); median top-1% "
           f"share of the loss {s['median_top1']:.2f}."]  # fmt: skip
    return "\n".join(md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="0-29")
    p.add_argument("--scheme", choices=tuple(ACTS), default="W4A8")
    p.add_argument("--nsamples", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="default benchmarks/results/mosaic_alpha_tokens.json")
    a = p.parse_args()
    wanted = set()
    for part in a.layers.split(","):
        lo, _, hi = part.partition("-")
        wanted |= set(range(int(lo), int(hi or lo) + 1))
    arch, layers, inputs, kwargs = float_layer_inputs(a.nsamples, a.seqlen, a.seed)
    cfg = get_method("mosaic").make_config(act=ACTS[a.scheme])
    qx = act_fake_quant(cfg.act)
    gen = torch.Generator().manual_seed(a.seed)
    res = {"scheme": a.scheme, "alpha_grid": list(ALPHA_GRID), "layers": {}}
    for li in range(max(wanted) + 1):
        layer = layers[li]
        if li in wanted:
            caps = capture_groups(layer, arch, inputs, kwargs, max_tokens=cfg.max_tokens, generator=gen)
            rows = [group_rows(c, cfg, qx) for c in caps if c.foldable or c.tie is not None]
            res["layers"][str(li)] = rows
            for g in rows:
                print(f"layer {li} {'/'.join(n.split('.')[-1] for n in g['names'])}: pick {g['pick_mse']} "
                      f"(rel {g['pick_rel']}), rel pick/none {g['rel_pick_over_none']:.3f}, top-1% "
                      f"{g['candidates'][g['pick_mse']]['top1_share']:.2f}", flush=True)  # fmt: skip
        with torch.inference_mode():
            inputs = [run_layer(layer, h, k) for h, k in zip(inputs, kwargs, strict=True)]
    allg = [g for rows in res["layers"].values() for g in rows]
    gm = lambda v: float(torch.tensor(v, dtype=torch.float64).log().mean().exp()) if v else float("nan")  # noqa: E731
    res["summary"] = {"groups": len(allg), "worse_rel": sum(g["rel_pick_over_none"] > 1 for g in allg),
                      "worse_mse": sum(g["mse_pick_over_none"] > 1 for g in allg),
                      "gmean_rel": gm([g["rel_pick_over_none"] for g in allg]),
                      "gmean_mse": gm([g["mse_pick_over_none"] for g in allg]),
                      "median_top1": float(torch.tensor([g["candidates"][g["pick_mse"]]["top1_share"]
                                                         for g in allg]).median())}  # fmt: skip
    cmd = (f"python -m benchmarks.mosaic.alpha_tokens --layers {a.layers} --scheme {a.scheme} "
           f"--nsamples {a.nsamples}")  # fmt: skip
    write_results(a.json or RESULTS / "mosaic_alpha_tokens.json", "mosaic_alpha_tokens",
                  {"args": vars(a), **res, "machine": machine_info()}, markdown(res, cmd))  # fmt: skip


if __name__ == "__main__":
    main()
