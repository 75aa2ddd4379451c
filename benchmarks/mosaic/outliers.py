"""Outlier statistics behind the findings report's "why" texts (issue 73, item 2): where a text says a
model has, or lacks, outliers, this is the measurement it cites.

Per model (SmolLM2-135M, whose float weights are a dequantized Q4_1 GGUF; Gemma-3-270m, a Q4_K_M GGUF
with Q6_K parts; neither is a float-origin checkpoint):

* **activation outliers** at the input of every linear of every decoder layer, on ``--nsamples`` x
  ``--seqlen`` WikiText-2 calibration tokens (the fast protocol's 16x512): per input channel j its
  ``max_t |x_tj|`` over the tokens, then per linear input the share of channels whose max exceeds 20x
  the median channel's max (LLM.int8()'s and SmoothQuant's "outlier channel": a few channels orders of
  magnitude above the rest), the largest max / median ratio, and the share of the input energy
  ``Σ_t x_tj²`` (the Hessian's diagonal, which weights a weight column's error) held by the top 10% of
  channels.  Also without each sample's first token (a BOS / attention-sink token carries "massive
  activations", Sun et al. 2024), so the two kinds of outlier are told apart;
* **weight outliers** of every linear: per output row ``max|w| / std(w)`` (beside it the same measure of
  Gaussian matrices of the same shapes, ``gauss_*``) and the
  excess kurtosis of the whole matrix (0 for a Gaussian);
* **the 4-bit grid**: the share of 32-weight groups (along the input dimension) holding at most 16
  distinct values -- 1.0 for a dequantized Q4_1 or Q4_K matrix, about 0 for float weights.

Grouped by input kind (``qkv``: q/k/v_proj share one input; ``o_proj``; ``gate_up``; ``down_proj``),
mean over layers (the max ratio: the largest).  Writes ``results/outliers.{json,md}``.

Run: flock /tmp/locks/heavy python -m benchmarks.mosaic.outliers   (about 2 min on 2 cores)
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from benchmarks.harness import write_results
from bitmosaic.data import calibration_samples
from bitmosaic.io import load_model

KINDS = {"q_proj": "qkv", "o_proj": "o_proj", "gate_proj": "gate_up", "down_proj": "down_proj"}
WEIGHT_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
OUTLIER_X = 20.0  # an outlier channel's max |x| exceeds 20x the median channel's


class _Inputs:
    """Per input channel: max |x| over every token, over every token but each sample's first, and Σ x²."""

    def __init__(self, width: int):
        self.mx = torch.zeros(width)
        self.mx_rest = torch.zeros(width)
        self.sq = torch.zeros(width, dtype=torch.float64)

    def add(self, x: torch.Tensor) -> None:
        a = x.detach().float().abs()  # [batch, seq, width]
        self.mx = torch.maximum(self.mx, a.amax(dim=(0, 1)))
        self.mx_rest = torch.maximum(self.mx_rest, a[:, 1:].amax(dim=(0, 1)))
        self.sq += a.double().square().sum(dim=(0, 1))


def _channel_stats(mx: torch.Tensor, sq: torch.Tensor) -> dict:
    ratio = mx / mx.median().clamp_min(1e-12)
    k = max(1, round(0.1 * sq.numel()))
    return {
        "share_over_20x": float((ratio > OUTLIER_X).float().mean()),
        "max_ratio": float(ratio.max()),
        "top10_energy_share": float(sq.topk(k).values.sum() / sq.sum()),
    }


def activation_stats(model, calib: torch.Tensor, batch: int = 4) -> dict[str, dict]:
    """Per layer and input kind: :func:`_channel_stats` of all tokens and without each sample's first."""
    layers = model.model.layers
    acc, hooks = {}, []
    for i, layer in enumerate(layers):
        for name, mod in layer.named_modules():
            kind = KINDS.get(name.rsplit(".", 1)[-1])
            if kind:
                acc[(i, kind)] = _Inputs(mod.in_features)
                hooks.append(mod.register_forward_pre_hook(lambda m, a, s=acc[(i, kind)]: s.add(a[0])))
    try:
        with torch.inference_mode():
            for b in range(0, calib.shape[0], batch):
                model(calib[b : b + batch])
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for (i, kind), s in acc.items():
        row = _channel_stats(s.mx, s.sq)
        rest = _channel_stats(s.mx_rest, s.sq)
        row.update({f"{k}_no_first": rest[k] for k in ("share_over_20x", "max_ratio")})
        out[f"{i}.{kind}"] = row
    return out


def _kurtosis(w: torch.Tensor) -> float:
    z = (w - w.mean()) / w.std()
    return float(z.pow(4).mean() - 3)


def _row_max_over_std(w: torch.Tensor) -> torch.Tensor:
    return w.abs().amax(dim=1) / w.std(dim=1)


def _grid_share(w: torch.Tensor, group: int = 32) -> float:
    """The share of ``group``-weight groups along the input dimension with at most 16 distinct values."""
    g = w[:, : w.shape[1] // group * group].reshape(-1, group).sort(dim=1).values
    distinct = 1 + (g[:, 1:] != g[:, :-1]).sum(dim=1)
    return float((distinct <= 16).float().mean())


def weight_stats(model, seed: int = 0) -> dict[str, dict]:
    """Per weight kind, mean over layers: row max|w|/std (mean and max over rows), excess kurtosis, the
    4-bit-grid share; and the same two outlier measures of Gaussian matrices of the same shapes."""
    gen = torch.Generator().manual_seed(seed)
    per = defaultdict(lambda: defaultdict(list))
    for layer in model.model.layers:
        for name, mod in layer.named_modules():
            kind = name.rsplit(".", 1)[-1]
            if kind not in WEIGHT_KINDS:
                continue
            w = mod.weight.detach().float()
            r = _row_max_over_std(w)
            g = torch.randn(w.shape, generator=gen)
            rg = _row_max_over_std(g)
            p = per[kind]
            p["row_max_over_std_mean"].append(float(r.mean()))
            p["row_max_over_std_max"].append(float(r.max()))
            p["kurtosis"].append(_kurtosis(w))
            p["grid16_share"].append(_grid_share(w))
            p["gauss_row_max_over_std_mean"].append(float(rg.mean()))
            p["gauss_row_max_over_std_max"].append(float(rg.max()))
    out = {}
    for kind, p in per.items():
        out[kind] = {k: (max(v) if k.endswith("_max") else sum(v) / len(v)) for k, v in p.items()}
        out[kind]["kurtosis_max"] = max(p["kurtosis"])
    return out


def by_kind(layers: dict[str, dict]) -> dict[str, dict]:
    """Mean over layers per input kind (``max_ratio*``: the largest), and ``all`` over every input."""
    groups = defaultdict(list)
    for key, row in layers.items():
        groups[key.split(".", 1)[1]].append(row)
    groups["all"] = list(layers.values())
    out = {}
    for kind, rows in groups.items():
        out[kind] = {
            k: (max(r[k] for r in rows) if k.startswith("max_ratio") else sum(r[k] for r in rows) / len(rows))
            for k in rows[0]
        }
        out[kind]["layers_with_outliers"] = sum(r["share_over_20x"] > 0 for r in rows) / len(rows)
    return out


def measure(alias: str, nsamples: int, seqlen: int, seed: int) -> dict:
    model, tok = load_model(alias)
    model.eval()
    calib = calibration_samples(tok, "wikitext2", nsamples, seqlen, seed=seed)
    layers = activation_stats(model, calib)
    return {"act": by_kind(layers), "act_layers": layers, "weights": weight_stats(model, seed)}


ACT_COLS = (  # (header, key, format) of the activation table
    ("share > 20x median", "share_over_20x", ".2%"),
    ("no first", "share_over_20x_no_first", ".2%"),
    ("max / median", "max_ratio", ".1f"),
    ("no first", "max_ratio_no_first", ".1f"),
    ("top-10% energy", "top10_energy_share", ".1%"),
    ("layers with outliers", "layers_with_outliers", ".0%"),
)
WEIGHT_COLS = (
    ("row max/std", "row_max_over_std_mean", ".2f"),
    ("max", "row_max_over_std_max", ".1f"),
    ("Gaussian", "gauss_row_max_over_std_mean", ".2f"),
    ("Gaussian max", "gauss_row_max_over_std_max", ".1f"),
    ("excess kurtosis", "kurtosis", ".2f"),
    ("max", "kurtosis_max", ".2f"),
    ("32-groups with <= 16 values", "grid16_share", ".3f"),
)


def _table(out: dict, part: str, first: str, cols: tuple) -> list[str]:
    md = [f"| model | {first} | " + " | ".join(h for h, _, _ in cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for m, r in out["models"].items():
        for kind, s in r[part].items():
            md.append(f"| {m} | {kind} | " + " | ".join(format(s[k], f) for _, k, f in cols) + " |")
    return md


def markdown(out: dict) -> str:
    a = out["args"]
    head = f"# Outlier statistics ({a['nsamples']}x{a['seqlen']} WikiText-2 tokens, seed {a['seed']})"
    return "\n".join(
        [head, "", "Activation channels at each linear's input (mean over layers; max / median: the largest;",
         "'no first': without each sample's first token).", "", *_table(out, "act", "input", ACT_COLS), "",
         "Weights (mean over layers; Gaussian matrices of the same shapes beside).", "",
         *_table(out, "weights", "weight", WEIGHT_COLS)]
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-135m,gemma3-270m")
    p.add_argument("--nsamples", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    out = {"args": vars(a), "outlier_x": OUTLIER_X, "models": {}}
    for m in a.models.split(","):  # written after each model: a run cut short keeps the models it measured
        out["models"][m] = measure(m, a.nsamples, a.seqlen, a.seed)
        write_results(a.json, "outliers", out, markdown(out))


if __name__ == "__main__":
    main()
