"""MosaicQuant at the layer level on SmolLM2-135M (§3 Observations 1-3, Fig. 2): where the residual
output distortion sits, and how much each selection criterion recovers per budget.

For each chosen decoder layer (float model, WikiText-2 calibration inputs): the smoothing factors
the method would pick (alpha searched for W4A4 with a 10% residual, o_proj unsmoothed under
GQA), then for every linear ``W~ = W diag(s)``, ``H~ = diag(s)^-1 H diag(s)^-1`` (``H = 2/n XᵀX`` of
the float inputs), ``R = W~ - Q(W~)`` and the candidate ``Q(R)``:

* per-block residual distortion ``d_b = Σ_{i∈I} R_iJ H~_JJ R_iJᵀ`` (Fig. 2a heatmaps, PNG) and its
  concentration: share of ``Σ d_b`` in the top 10% blocks, against the share of the diagonal
  distortion ``Σ_j H_jj ||R_:j||²`` in the top input columns of the same element count (if the
  distortion were channel stripes the two would match);
* exact ``ΔD(S) / ||R Xᵀ||²`` per criterion (Δ-Hessian, magnitude, residual norm, random, greedy
  oracle, and the two channel baselines at the same element budget: the paper's outlier channels
  by the float input's ``max|X_j|`` and ours by summed Δ-Hessian, each with its residual
  re-quantized on the gathered columns as it is stored) and budget (Fig. 2b curves, PNG);
* W4A4 output error on the token sample, MosaicQuant (smoothed, 10%) against an Atom-like layer
  (Zhao et al. 2024, MosaicQuant's comparator in Table 1, simplified): 3.1% of the input channels
  (Atom's 128 of 4096), those of largest ``max|X_j|``, keep 8-bit weights (per-row symmetric) and
  per-token 8-bit activations; the others get GPTQ g128 4-bit symmetric weights (on their
  Hessian block; the 8-bit channels then take the OBS update for the 4-bit channels' error, as
  GPTQ's later columns would, and are rounded) and per-group-128 4-bit activations over the
  reordered channels; no smoothing.  Both sides report weight bits per weight (codes and fp16
  scales; MosaicQuant's module: base, residual, indices) and activation bits per element (codes
  and one fp16 scale per token per group: 4 + 16/128 for A4; Atom's 8-bit channels cost 8);
* global allocation (one 10% budget over the layer's seven matrices, ranked by Δ_b) against
  per-matrix top-K, on the summed ΔD (extension); the table gives the mean and the largest
  per-linear share at 10% beside it (the paper's Observation 3 quotes single layers).

Run: flock /tmp/bitmosaic-heavy.lock python -m benchmarks.mosaic.mosaic_layers --layers 10,20
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.harness import RESULTS, write_text
from bitmosaic.algorithms.gptq import gptq_quantize
from bitmosaic.algorithms.mosaic import (
    COLUMN_SELECTIONS,
    block_reduce,
    delta_distortion,
    delta_hessian_scores,
    dense_base,
    distortion,
    expand_blocks,
    global_topk,
    mosaic_decompose,
    residual_quant,
    residual_values,
    select,
    topk_blocks,
)
from bitmosaic.data import calibration_samples
from bitmosaic.formats.act import ActQuantSpec, fake_quant
from bitmosaic.formats.grid import IntGrid
from bitmosaic.io import load_model
from bitmosaic.methods import get_method
from bitmosaic.methods.mosaic import mosaic_transform, mosaic_weight
from bitmosaic.models.arch import get_arch
from bitmosaic.modules.mosaic import MosaicQuantLinear
from bitmosaic.pipeline.capture import capture_groups, run_layer
from bitmosaic.pipeline.pipeline import capture_layer_inputs

CRITERIA = ("delta-hessian", "oracle", "channel-act", "channel", "magnitude", "residual-norm", "random")
ATOM_SHARE = 128 / 4096  # Atom keeps 128 outlier channels of Llama's 4096 in INT8 (3.1%)
A4 = ActQuantSpec("int", 4, granularity="group", group_size=128)
BUDGETS = (0.0, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5)


def analyse_linear(W, H, block, budgets, criteria, act_amax=None):
    hdiag = torch.diagonal(H)
    codes, scales = dense_base(W)
    R = W - codes.float() * scales[:, None]
    rc, rs = residual_quant(R, block)
    QR = residual_values(rc, rs, block[1])
    d0 = distortion(R, H)
    Hf = H.float()
    curves = {}
    for c in criteria:
        curves[c] = []
        for b in budgets:
            if c in COLUMN_SELECTIONS:  # stored as dense columns: Q(R) re-quantized on the gathered ones
                S = mosaic_decompose(W, None, hdiag=hdiag, budget=b, block=block, selection=c,
                                     act_amax=act_amax, report=False).sparse  # fmt: skip
            else:
                M = select(c, W=W, R=R, QR=QR, hdiag=hdiag, H=H, block=block, budget=b, seed=0)
                S = M.float() * QR
            curves[c].append(float(((S @ Hf) * (2 * R - S)).sum(dtype=torch.float64)) / d0)  # exact ΔD
    # per-block residual distortion (block-diagonal part of tr(R H Rᵀ))
    out, n = W.shape
    dblock = torch.zeros(block_reduce(R, block).shape, dtype=torch.float64)
    for cb in range(dblock.shape[1]):
        J = slice(cb * block[1], min(n, (cb + 1) * block[1]))
        RH = R[:, J].double() @ H[J, J].double()
        dblock[:, cb] = block_reduce(RH * R[:, J].double(), (block[0], RH.shape[1]))[:, 0]
    k = max(1, round(0.1 * dblock.numel()))
    top_blocks = float(dblock.reshape(-1).sort(descending=True).values[:k].sum() / dblock.sum())
    col = R.double().pow(2).sum(0) * hdiag.double()
    ncols = min(n, round(k * block[0] * block[1] / out))
    top_cols = float(col.sort(descending=True).values[:ncols].sum() / col.sum())
    diag_blocks = block_reduce(R.double().pow(2) * hdiag.double()[None, :], block).reshape(-1)
    top_diag_blocks = float(diag_blocks.sort(descending=True).values[:k].sum() / diag_blocks.sum())
    scores = delta_hessian_scores(R, QR, hdiag, block)
    return {
        "shape": list(W.shape),
        "residual_distortion": d0,
        "curves": curves,
        "block_distortion": dblock.tolist(),
        "top10_blocks_share": top_blocks,
        "top10_blocks_share_diag": top_diag_blocks,
        "same_elements_columns_share_diag": top_cols,
        "_scores": scores,
        "_RQ": (R, QR),
    }


def _rel(Y, ref) -> float:
    return float((Y - ref).pow(2).sum() / ref.pow(2).sum())


def atom_like(X, W, H, amax, act4, share=ATOM_SHARE, damp=0.01) -> tuple[torch.Tensor, dict]:
    """Atom-like W4A4 output ``Y [tokens, out]`` of ``X`` and its bits (module doc): the ``share``
    of input channels with the largest ``max|X_j|`` in INT8 (weights and activations), GPTQ g128
    INT4 weights and ``act4`` activations on the rest."""
    lo, hi, Wlo, Whi, bits = atom_like_weights(W, H, amax, act4, share, damp)
    Y = fake_quant(X[:, lo], act4) @ Wlo.T + fake_quant(X[:, hi], ActQuantSpec("int", 8)) @ Whi.T
    return Y, bits


def atom_like_weights(W, H, amax, act4, share=ATOM_SHARE, damp=0.01):
    """The Atom-like split of ``W [out, n]`` (module doc): ``(lo, hi, W_lo, W_hi, bits)`` -- the 4-bit
    and the 8-bit input channels (``hi``: the ``share`` of largest ``max|X_j|``), their dequantized
    weights (GPTQ g128 INT4 on ``H``'s ``lo`` block; INT8 per row after the OBS update for the 4-bit
    channels' error) and the bits of weights and activations (``act4`` on the 4-bit channels)."""
    n = W.shape[1]
    n8 = max(1, round(share * n))
    order = torch.sort(amax.float(), descending=True, stable=True).indices
    hi, lo = order[:n8], order[n8:]
    Hd = H.double()
    g = gptq_quantize(W[:, lo].float(), Hd[lo][:, lo].float(), IntGrid(4, True), 128, percdamp=damp)
    Wlo = g.dequantize(torch.float32)
    E = (W[:, lo] - Wlo).double()  # the 4-bit channels' error; the 8-bit ones absorb what they can
    Hhh = Hd[hi][:, hi] + damp * torch.diagonal(Hd[hi][:, hi]).mean() * torch.eye(n8, dtype=torch.float64)
    Whi = (W[:, hi].double() + E @ Hd[lo][:, hi] @ torch.linalg.inv(Hhh)).float()
    sc = (Whi.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12).half().float()
    Whi = torch.round(Whi / sc).clamp(-128, 127) * sc
    out = W.shape[0]
    wbits = out * (len(lo) * 4 + -(-len(lo) // 128) * 16) + out * (n8 * 8 + 16) + n * 32  # + channel order
    abits = len(lo) * 4 + -(-len(lo) // act4.group_size) * 16 + n8 * 8 + 16
    bits = {"atom_8bit_channels": n8, "atom_weight_bpw": wbits / (out * n), "atom_act_bits": abits / n}
    return lo, hi, Wlo, Whi, bits


def w4a4_errors(X, W, s, amax, H, cfg) -> dict:
    """Relative output errors at W4A4: MosaicQuant (smoothed, ``cfg``) vs the Atom-like layer (3.1%
    INT8 channels, unsmoothed), with each side's weight and activation bits."""
    ref = X @ W.T
    Ws = W * s[None, :]
    res = mosaic_weight(Ws, (X / s).T @ (X / s), cfg, report=False, act_amax=amax)
    m = MosaicQuantLinear.from_result(res)
    mosaic = fake_quant(X / s, cfg.act) @ res.dequantize(torch.float32).T
    atom, bits = atom_like(X, W, H, amax, cfg.act)
    n = W.shape[1]
    return {
        "mosaic_w4a4_rel_err": _rel(mosaic, ref),
        "mosaic_weight_bpw": m.bits_per_weight(),
        "mosaic_act_bits": (n * 4 + -(-n // cfg.act.group_size) * 16) / n,
        "atom_like_w4a4_rel_err": _rel(atom, ref),
        **bits,
    }


def float_layer_inputs(nsamples: int, seqlen: int, seed: int):
    """SmolLM2-135M's architecture map, decoder layers, the first layer's inputs on a WikiText-2
    calibration set (``nsamples x seqlen``, ``seed``) and the layers' keyword arguments: a walk over the
    float model's layers starts here (``run_layer`` gives the next layer's inputs)."""
    model, tok = load_model("smollm2-135m")
    calib = calibration_samples(tok, "wikitext2", nsamples, seqlen, seed)
    arch = get_arch(model)
    layers = arch.layers(model)
    inputs, kw = capture_layer_inputs(model, layers, calib, batch_size=4)
    return arch, layers, inputs, next(iter(kw.values()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", default="10,20")
    p.add_argument("--nsamples", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--block", default="64x64")
    p.add_argument("--heatmap-block", default="32x32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    block = tuple(int(x) for x in a.block.split("x"))
    hblock = tuple(int(x) for x in a.heatmap_block.split("x"))
    arch, layers, inputs, kwargs = float_layer_inputs(a.nsamples, a.seqlen, a.seed)
    wanted = [int(x) for x in a.layers.split(",")]
    cfg = get_method("mosaic").make_config(act=A4, block=a.block, max_tokens=1024)
    result = {"args": vars(a), "budgets": list(BUDGETS), "layers": {}}
    gen = torch.Generator().manual_seed(a.seed)
    for li in range(max(wanted) + 1):
        layer = layers[li]
        if li in wanted:
            caps = capture_groups(layer, arch, inputs, kwargs, max_tokens=1024, generator=gen)
            facts = mosaic_transform(caps, cfg)
            rows, scores, rq, hm = {}, [], [], {}
            for cap, (s, info) in zip(caps, facts, strict=True):
                sv = torch.ones(cap.hessian.shape[0]) if s is None else s.float()
                Hs = cap.hessian.float() / (sv[:, None] * sv[None, :])
                for name in cap.names:
                    W = cap.weights[name] * sv[None, :]
                    amax = cap.observer.channel_absmax  # the float (unsmoothed) input's max|X_j|
                    r = analyse_linear(W, Hs, block, BUDGETS, CRITERIA, act_amax=amax)
                    r["alpha"] = info.get("alpha")
                    X = cap.sample.float()
                    r.update(w4a4_errors(X, cap.weights[name], sv, amax, cap.hessian.float(), cfg))
                    scores.append(r.pop("_scores"))
                    rq.append((r.pop("_RQ"), Hs))
                    hm[name] = analyse_linear(W, Hs, hblock, (0.0,), ("delta-hessian",))["block_distortion"]
                    rows[name.split(".")[-1]] = r
                    at10 = ", ".join(f"{c} {r['curves'][c][3]:.3f}" for c in CRITERIA)
                    print(f"layer {li} {name}: alpha {r['alpha']} recovered@10% {at10}", flush=True)
            per = sum(
                delta_distortion(R, QR, expand_blocks(topk_blocks(sc, 0.1), R.shape, block), H)
                for sc, ((R, QR), H) in zip(scores, rq, strict=True)
            )
            glob = sum(
                delta_distortion(R, QR, expand_blocks(m, R.shape, block), H)
                for m, ((R, QR), H) in zip(global_topk(scores, 0.1), rq, strict=True)
            )
            total = sum(distortion(R, H) for (R, QR), H in rq)
            result["layers"][str(li)] = {
                "linears": rows,
                "heatmaps": {k.split(".")[-1]: v for k, v in hm.items()},
                "per_matrix_top10_recovered": per / total,
                "global_top10_recovered": glob / total,
            }
            print(f"layer {li}: per-matrix {per / total:.3f}, global {glob / total:.3f}", flush=True)
        with torch.inference_mode():
            inputs = [run_layer(layer, h, k) for h, k in zip(inputs, kwargs, strict=True)]
    write_text(RESULTS / "mosaic_layers.json", json.dumps(result, indent=1))
    _plots(result, hblock)
    _markdown(result)


def _plots(result, hblock) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    layers = list(result["layers"])
    fig, axes = plt.subplots(len(layers), 2, figsize=(12, 3.2 * len(layers)), squeeze=False)
    for row, li in enumerate(layers):
        for col, name in enumerate(("q_proj", "down_proj")):
            d = np.array(result["layers"][li]["heatmaps"][name])
            ax = axes[row][col]
            im = ax.imshow(np.log10(d + d.max() * 1e-6), aspect="auto", cmap="magma")
            ax.set_title(f"layer {li} {name}: log10 block distortion ({hblock[0]}x{hblock[1]} blocks)")
            ax.set_xlabel("input-column block")
            ax.set_ylabel("output-row block")
            fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(RESULTS / "mosaic_heatmap.png", dpi=110)
    budgets = [100 * b for b in result["budgets"]]
    fig, axes = plt.subplots(1, len(layers), figsize=(6 * len(layers), 4), squeeze=False)
    for i, li in enumerate(layers):
        lin = result["layers"][li]["linears"]
        ax = axes[0][i]
        for c in CRITERIA:
            mean = np.mean([v["curves"][c] for v in lin.values()], axis=0)
            ax.plot(budgets, 100 * mean, marker="o", label=c)
        ax.set_title(f"layer {li}: output distortion recovered (mean of 7 linears)")
        ax.set_xlabel("budget (% of blocks / equal elements)")
        ax.set_ylabel("ΔD / ||R Xᵀ||² (%)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "mosaic_budget_curves.png", dpi=110)


def _markdown(result) -> None:
    budgets = result["budgets"]
    a = result["args"]
    lines = [
        "Fraction of residual output distortion recovered, ΔD(S)/||R Xᵀ||² (exact), 64x64 blocks; channel "
        "criteria at the same element count, residual re-quantized on the gathered columns as stored "
        "(channel-act: the paper's outlier channels by max|X_j|; channel: ours, by summed Δ-Hessian). "
        "W4A4 relative output error on the token sample: MosaicQuant (10%) vs Atom-like (3.1% INT8 "
        "channels, GPTQ g128 INT4 weights), each with weight bits per weight / activation bits per element. "
        f"SmolLM2-135M, calib {a['nsamples']}x{a['seqlen']} seed {a['seed']}; "
        f"`python -m benchmarks.mosaic.mosaic_layers --layers {a['layers']} --nsamples {a['nsamples']}`",
        "",
    ]
    i10 = budgets.index(0.1)
    for li, L in result["layers"].items():
        head = ["linear", "alpha", *(f"{c} @10%" for c in CRITERIA), "top-10% blocks share",
                "same-elements columns share (diag)", "W4A4 err mosaic (w bpw / a bits)",
                "W4A4 err Atom-like (w bpw / a bits)"]  # fmt: skip
        lines += [f"### layer {li}", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for name, r in L["linears"].items():
            cells = " | ".join(f"{r['curves'][c][i10]:.3f}" for c in CRITERIA)
            lines.append(
                f"| {name} | {r['alpha']} | {cells} | {r['top10_blocks_share_diag']:.3f} | "
                f"{r['same_elements_columns_share_diag']:.3f} | {r['mosaic_w4a4_rel_err']:.4f} "
                f"({r['mosaic_weight_bpw']:.3f} / {r['mosaic_act_bits']:.3f}) | "
                f"{r['atom_like_w4a4_rel_err']:.4f} ({r['atom_weight_bpw']:.3f} / {r['atom_act_bits']:.3f}) |"
            )
        share = {c: [r["curves"][c][i10] for r in L["linears"].values()] for c in ("delta-hessian", "oracle")}
        best = max(L["linears"], key=lambda k: L["linears"][k]["curves"]["oracle"][i10])
        lines += ["", f"at 10%: per-linear oracle mean {sum(share['oracle']) / len(share['oracle']):.3f}, "
                  f"max {max(share['oracle']):.3f} ({best}); Δ-Hessian mean "
                  f"{sum(share['delta-hessian']) / len(share['delta-hessian']):.3f}, max "
                  f"{max(share['delta-hessian']):.3f}; of the layer's summed distortion: per-matrix top-10% "
                  f"{L['per_matrix_top10_recovered']:.3f}, global top-10% {L['global_top10_recovered']:.3f}",
                  ""]  # fmt: skip
        lines += ["Δ-Hessian vs budget (mean of the 7 linears): " + ", ".join(
            f"{100 * b:g}%: {sum(r['curves']['delta-hessian'][j] for r in L['linears'].values()) / 7:.3f}"
            for j, b in enumerate(budgets)), ""]  # fmt: skip
    write_text(RESULTS / "mosaic_layers.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
