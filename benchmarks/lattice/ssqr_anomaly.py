"""Why SSQR-3% loses to GPTQ w3 in perplexity while it wins every layer (issue 73 item 7).

On the verdict protocol (``ssqr_groups_verdict.json``) SSQR w3 g128 3% static has the lower
Hessian-weighted error in 210 of 210 layers, the lower KL and the higher top-1 against GPTQ w3 g128
act mse static, yet the higher perplexity.  Quantizing the whole model twice takes ~40 min on the shared
2-core CPU (SSQR's alpha bisection runs GPTQ several times per linear), so this benchmark quantizes
a few decoder layers (``--layers``, default one in the middle) with each method, from
the float model's inputs on the verdict calibration's text (``--nsamples`` samples of 512, seed 0),
keeps the float model everywhere else, and measures on test windows spread over WikiText-2 test:

(a) ``grams``/``quantize``: each quantized linear's output error ``tr(dW H dW^T) / tr(W H W^T)`` under
    the float model's inputs on the calibration text the quantizers saw and on held-out text (test
    windows), for both methods: a lower calibration error with a higher held-out error would point at
    overfitting the calibration;
(b) ``evaluate``: per predicted token, each model's NLL and KL to the float model, by position in the
    window, by the target token's frequency in the test text, and by whether the float model's top-1
    is right -- and so, for the few layers, whether SSQR's layers already cost more NLL than GPTQ's
    with lower KL, and in which layer (SSQR with one layer taken from GPTQ);
(c) ``evaluate``/``report``: where SSQR's outliers sit (rows vs columns of which projections, and
    whether their columns are the high-activation input channels), and the NLL of SSQR with the
    outliers of one projection kind removed (the clamped dense code kept).

Stages: ``grams``, ``quantize --which ssqr``, ``quantize --which gptq``, ``evaluate --part base``,
``evaluate --part variants``, ``report`` (writes ``benchmarks/results/ssqr_anomaly.{md,json}``), or
``all`` of them in one job (the variants while ``--budget`` seconds last).

Run: python -m benchmarks.lattice.ssqr_anomaly all [--layers 15] [--nsamples 32] [--windows 8]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.harness import RESULTS, write_text
from benchmarks.harness.writers import dumps_results
from bitmosaic.data import bos_token_id, calibration_samples, eval_tokens
from bitmosaic.eval.perplexity import eval_windows
from bitmosaic.io import load_model
from bitmosaic.methods import get_method
from bitmosaic.methods.base import LayerStats
from bitmosaic.modules.qlinear import QuantLinear
from bitmosaic.modules.qmodules import SparseOutlierQuantLinear

MODEL, SEQLEN, SEED = "smollm2-135m", 512, 0  # the verdict protocol's calibration text and seed
STATIC = {"bits": 3, "group_size": 128, "order": "act"}
SPECS = {  # the two rows of ssqr_groups_verdict.json (benchmarks/lattice/ssqr_groups.py row_specs)
    "gptq": ("gptq w3 g128 act mse static", "gptq", {**STATIC, "scale": "mse", "static_groups": True}),
    "ssqr": ("ssqr w3 g128 3% static", "ssqr", {**STATIC, "outlier_rate": 0.03, "groups": "static"}),
}
KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
POSITIONS = ((0, 16), (16, 64), (64, 256), (256, 511))  # predicted-token positions in a window
FREQ = ((1000, math.inf), (100, 1000), (10, 100), (0, 10))  # the target's count in the test text


def kind_of(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def layer_of(name: str) -> int:
    return int(name.split(".layers.")[1].split(".")[0])


def chosen(model, layers: list[int]) -> list[str]:
    """The linears of decoder layers ``layers``."""
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".layers." in n and layer_of(n) in layers
    ]


def test_windows(tok, n: int) -> torch.Tensor:
    """``n`` test windows spread evenly over the WikiText-2 test set (of the verdict's windows)."""
    ids = eval_tokens(tok, "wikitext2")
    every = eval_windows(ids, SEQLEN, None, bos_token_id(tok))
    pick = torch.linspace(0, every.shape[0] - 1, n).round().long()
    return every[pick]


def token_counts(tok) -> torch.Tensor:
    ids = eval_tokens(tok, "wikitext2")[0]
    return torch.bincount(ids, minlength=len(tok))


# -- (a) inputs and quantization ------------------------------------------------------------------------
class _Enough(Exception):
    """Raised after the last layer whose inputs are wanted: the rest of the forward is not needed."""


def input_gram(model, batches: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """name -> sum over tokens of x x^T of the linear's float inputs (float64); each forward stops
    after the last decoder layer of ``names``."""
    grams: dict[str, torch.Tensor] = {}
    hooks = []
    for name in names:

        def hook(mod, inp, out, name=name):
            x = inp[0].reshape(-1, inp[0].shape[-1]).double()
            grams[name] = grams.get(name, 0) + x.T @ x

        hooks.append(model.get_submodule(name).register_forward_hook(hook))
    last = max(layer_of(n) for n in names)

    def stop(mod, inp, out):
        raise _Enough

    hooks.append(model.get_submodule(f"model.layers.{last}").register_forward_hook(stop))
    with torch.no_grad():
        for row in batches:
            try:
                model(row[None], use_cache=False)
            except _Enough:
                pass
    for h in hooks:
        h.remove()
    return grams


def grams(store: Path, layers: list[int], nsamples: int, windows: int) -> None:
    model, tok = load_model(MODEL)
    names = chosen(model, layers)
    calib = calibration_samples(tok, "wikitext2", nsamples, SEQLEN, SEED)
    out = {
        "layers": layers,
        "nsamples": nsamples,
        "windows": windows,
        "calib": input_gram(model, calib, names),
        "test": input_gram(model, test_windows(tok, windows), names),
        "tokens": {"calib": calib.numel(), "test": windows * SEQLEN},
    }
    torch.save(out, store / "grams.pt")
    print(f"grams of {len(names)} linears: {nsamples} calibration samples, {windows} test windows")


def quantize(which: str, store: Path) -> None:
    """Quantize the chosen linears as row ``which`` from their calibration Hessians (2/n X^T X of the
    float inputs); save each one's dense dequantized weight, SSQR's outliers, its info and errors."""
    _, method, opts = SPECS[which]
    model, _ = load_model(MODEL)
    g = torch.load(store / "grams.pt")
    spec = get_method(method)
    cfg = spec.make_config(**opts)
    weights, outliers, info = {}, {}, {}
    t0 = time.perf_counter()
    for name, gram in g["calib"].items():
        w = model.get_submodule(name).weight.detach().float()
        stats = LayerStats(hessian=(2 / g["tokens"]["calib"] * gram).float())
        res = spec.quantize(w, stats, cfg, name=name)
        info[name] = {k: v for k, v in (res.info or {}).items() if isinstance(v, int | float)}
        q = spec.pack(res, cfg, None)
        weights[name] = QuantLinear.dequantize_reference(q).float()  # the dense code alone
        if isinstance(q, SparseOutlierQuantLinear):
            sp = q.csr().add_to(torch.zeros_like(weights[name]))
            idx = sp.nonzero()
            outliers[name] = (idx.to(torch.int32), sp[idx[:, 0], idx[:, 1]])
        print(f"  {name} {time.perf_counter() - t0:.0f}s", flush=True)
    out = {"name": SPECS[which][0], "weights": weights, "outliers": outliers, "info": info}
    torch.save(out, store / f"{which}.pt")


def weight_set(q: dict, drop: str | None = None) -> dict[str, torch.Tensor]:
    """name -> the full dequantized weight (dense + outliers; without the outliers of kind ``drop``, or
    of every kind: ``"*"``)."""
    out = {}
    for name, w in q["weights"].items():
        if name in q["outliers"] and drop not in (kind_of(name), "*"):
            idx, vals = q["outliers"][name]
            w = w.clone()
            w[idx[:, 0].long(), idx[:, 1].long()] += vals
        out[name] = w
    return out


def layer_errors(store: Path, model) -> dict:
    """Per quantized linear: relative output error of each method on calibration and held-out text."""
    g = torch.load(store / "grams.pt")
    rows: dict[str, dict] = {}
    for which in SPECS:
        for name, wq in weight_set(torch.load(store / f"{which}.pt")).items():
            wf = model.get_submodule(name).weight.detach().double()
            dw = wq.double() - wf
            r = rows.setdefault(name, {"name": name})
            for text in ("calib", "test"):
                h = g[text][name]
                r[f"{which}_{text}"] = float(((dw @ h) * dw).sum() / ((wf @ h) * wf).sum())
    return {"nsamples": g["nsamples"], "windows": g["windows"], "rows": list(rows.values())}


def summarize_layers(res: dict) -> dict:
    rows = res["rows"]
    out = {"linears": len(rows)}
    for text in ("calib", "test"):
        out[f"ssqr_lower_{text}"] = sum(r[f"ssqr_{text}"] < r[f"gptq_{text}"] for r in rows)
        for which in SPECS:
            out[f"{which}_{text}_mean"] = sum(r[f"{which}_{text}"] for r in rows) / len(rows)
    for which in SPECS:  # held-out over calibration error: > 1 where the fit does not carry over
        out[f"{which}_test_over_calib"] = out[f"{which}_test_mean"] / out[f"{which}_calib_mean"]
    per_kind = {}
    for k in KINDS:
        ks = [r for r in rows if kind_of(r["name"]) == k]
        per_kind[k] = {
            f"{w}_{t}": sum(r[f"{w}_{t}"] for r in ks) / len(ks) for w in SPECS for t in ("calib", "test")
        }
        per_kind[k]["ssqr_lower_test"] = sum(r["ssqr_test"] < r["gptq_test"] for r in ks)
        per_kind[k]["n"] = len(ks)
    out["per_kind"] = per_kind
    return out


# -- (b) tokens ---------------------------------------------------------------------------------------
def logprobs(model, row: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return F.log_softmax(model(row[None], use_cache=False).logits[0, :-1].float(), dim=-1)


def setter(model, store: Path):
    """``put(weights)``: the chosen linears of ``model`` get ``weights`` (None: back to float)."""
    q = {w: torch.load(store / f"{w}.pt") for w in SPECS}
    names = list(q["gptq"]["weights"])
    orig = {n: model.get_submodule(n).weight.detach().clone() for n in names}

    def put(weights: dict | None) -> None:
        for n in names:
            model.get_submodule(n).weight.data.copy_(orig[n] if weights is None else weights[n])

    return put, q


def variant_sets(q: dict, layers: list[int]) -> dict[str, dict]:
    """SSQR without any outliers, without those of one kind, and with one layer taken from GPTQ."""
    full, gw = weight_set(q["ssqr"]), weight_set(q["gptq"])
    out = {"ssqr without outliers": weight_set(q["ssqr"], drop="*")}
    out |= {f"ssqr without {k} outliers": weight_set(q["ssqr"], drop=k) for k in KINDS}
    if len(layers) > 1:
        for layer in layers:
            out[f"ssqr with gptq layer {layer}"] = {
                n: gw[n] if layer_of(n) == layer else w for n, w in full.items()
            }
    return out


def evaluate(store: Path, part: str, windows: int, budget_s: float = math.inf) -> None:
    """``base``: per predicted token the float NLL, each model's NLL and KL(float || model), and whether
    the float top-1 is right (``tokens.pt``); ``variants``: each variant's per-window mean NLL, in
    :func:`variant_sets`' order until ``budget_s`` seconds have passed."""
    model, tok = load_model(MODEL)
    wins = test_windows(tok, windows)
    put, q = setter(model, store)
    t0 = time.perf_counter()
    if part == "variants":
        layers = sorted({layer_of(n) for n in q["gptq"]["weights"]})
        out = {"windows": windows}
        for label, w in variant_sets(q, layers).items():
            if time.perf_counter() - t0 > budget_s:
                print(f"  time budget spent: {label} and the variants after it not run")
                break
            put(w)
            nll = [float(-logprobs(model, r).gather(1, r[1:, None]).double().mean()) for r in wins]
            out[label] = nll
            print(f"  {label}: ppl {math.exp(sum(nll) / len(nll)):.3f} ({time.perf_counter() - t0:.0f}s)")
            (store / "variants.json").write_text(json.dumps(out))
        return
    sets = {w: weight_set(q[w]) for w in SPECS}
    cols: dict[str, list] = {k: [] for k in ("nll_float", "target", "pos", "float_right")}
    for row in wins:
        target = row[1:]
        put(None)
        lf = logprobs(model, row)
        cols["nll_float"].append(-lf.gather(1, target[:, None])[:, 0])
        cols["float_right"].append(lf.argmax(-1) == target)
        cols["target"].append(target)
        cols["pos"].append(torch.arange(target.numel()))
        for which, w in sets.items():
            put(w)
            lq = logprobs(model, row)
            cols.setdefault(f"nll_{which}", []).append(-lq.gather(1, target[:, None])[:, 0])
            cols.setdefault(f"kl_{which}", []).append((lf.exp() * (lf - lq)).sum(-1))
    torch.save({k: torch.cat(v) for k, v in cols.items()}, store / "tokens.pt")
    print(f"{windows} windows in {time.perf_counter() - t0:.0f}s")


def _mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float(x[mask].double().mean()) if bool(mask.any()) else float("nan")


def summarize_tokens(t: dict, counts: torch.Tensor) -> dict:
    """Means of NLL excess over float (``dnll``) and KL per model, over all tokens and per bucket."""
    freq = counts[t["target"]]
    buckets = {"all": torch.ones_like(t["pos"], dtype=torch.bool)}
    buckets |= {f"pos {a}-{b - 1}": (t["pos"] >= a) & (t["pos"] < b) for a, b in POSITIONS}
    buckets |= {f"freq {a}-{b}": (freq >= a) & (freq < b) for a, b in FREQ}
    buckets |= {"float top-1 right": t["float_right"], "float top-1 wrong": ~t["float_right"]}
    out = {}
    for name, mask in buckets.items():
        r = {"tokens": int(mask.sum()), "share": float(mask.float().mean())}
        for w in SPECS:
            r[f"dnll_{w}"] = _mean(t[f"nll_{w}"] - t["nll_float"], mask)
            r[f"kl_{w}"] = _mean(t[f"kl_{w}"], mask)
        # the bucket's part of the whole NLL gap, SSQR minus GPTQ (sums to the "all" gap)
        empty = r["tokens"] == 0  # an empty bucket has no means, and no part of the gap
        r["gap_part"] = 0.0 if empty else r["share"] * (r["dnll_ssqr"] - r["dnll_gptq"])
        r["kl_gap_part"] = 0.0 if empty else r["share"] * (r["kl_ssqr"] - r["kl_gptq"])
        out[name.replace(" ", "_").replace("-", "_")] = r
    a = out["all"]
    a["ppl_float"] = math.exp(float(t["nll_float"].double().mean()))
    for w in SPECS:
        a[f"ppl_{w}"] = math.exp(float(t[f"nll_{w}"].double().mean()))
    a["nll_gap"] = a["dnll_ssqr"] - a["dnll_gptq"]
    a["kl_gap"] = a["kl_ssqr"] - a["kl_gptq"]
    # a paired bootstrap over windows of the mean NLL gap (SSQR - GPTQ): is the sign settled here?
    per_win = (t["nll_ssqr"] - t["nll_gptq"]).view(-1, SEQLEN - 1).double().mean(1)
    g = torch.Generator().manual_seed(0)
    boot = per_win[torch.randint(0, per_win.numel(), (2000, per_win.numel()), generator=g)].mean(1)
    a["gap_ci95_lo"], a["gap_ci95_hi"] = float(boot.quantile(0.025)), float(boot.quantile(0.975))
    a["windows_ssqr_worse"] = int((per_win > 0).sum())
    a["windows"] = per_win.numel()
    return out


# -- (c) outliers ---------------------------------------------------------------------------------------
def outlier_layout(q: dict, diag: dict[str, torch.Tensor]) -> dict:
    """Per projection kind: outlier share, the share held by the top 1% of rows and of columns (1% if
    spread evenly), and the share sitting in the 1% of input channels with the largest mean x^2."""
    per: dict[str, dict] = {}
    for name, (idx, _) in q["outliers"].items():
        rows, cols = q["weights"][name].shape
        r = per.setdefault(kind_of(name), dict.fromkeys(("weights", "outliers", "rows", "cols", "hot"), 0))
        r["weights"] += rows * cols
        r["outliers"] += idx.shape[0]
        rc = torch.bincount(idx[:, 0].long(), minlength=rows).sort(descending=True).values
        cc = torch.bincount(idx[:, 1].long(), minlength=cols)
        r["rows"] += int(rc[: max(1, rows // 100)].sum())
        r["cols"] += int(cc.sort(descending=True).values[: max(1, cols // 100)].sum())
        r["hot"] += int(cc[diag[name].topk(max(1, cols // 100)).indices].sum())
    out = {}
    for k in KINDS:
        if k not in per:
            continue
        r, n = per[k], max(per[k]["outliers"], 1)
        out[k] = {
            "rate": r["outliers"] / r["weights"],
            "outliers": r["outliers"],
            "top_rows_share": r["rows"] / n,
            "top_cols_share": r["cols"] / n,
            "hot_cols_share": r["hot"] / n,
        }
    return out


# -- report ---------------------------------------------------------------------------------------------
def verdict_alpha() -> dict:
    """SSQR-3%'s grid multiplier alpha (mean, min, max over layers) in ``ssqr_groups_verdict.json``, the
    verdict run this benchmark explains (read from its per-layer rows)."""
    rows = json.loads((RESULTS / "ssqr_groups_verdict.json").read_text())["rows"]
    layers = next(r for r in rows if r["name"] == SPECS["ssqr"][0])["layers"]
    a = [r["scale_multiplier"] for r in layers]
    return {"mean": sum(a) / len(a), "min": min(a), "max": max(a), "layers": len(a)}


def report(store: Path) -> None:
    model, tok = load_model(MODEL)
    g = torch.load(store / "grams.pt")
    q = {w: torch.load(store / f"{w}.pt") for w in SPECS}
    tokens = torch.load(store / "tokens.pt")
    win = tokens["nll_float"].numel() // (SEQLEN - 1)
    base = {w: tokens[f"nll_{w}"].view(win, -1).double().mean(1) for w in SPECS}
    gap = float((base["ssqr"] - base["gptq"]).mean())
    variants = []
    var = json.loads((store / "variants.json").read_text()) if (store / "variants.json").is_file() else {}
    for label, nll in var.items():
        if label == "windows" or var["windows"] != win:
            continue
        d = float((torch.tensor(nll, dtype=torch.float64) - base["gptq"]).mean())
        variants.append(
            {
                "name": label,
                "ppl": math.exp(sum(nll) / len(nll)),
                "nll_over_gptq": d,
                "gap_closed": 1 - d / gap,
            }
        )
    diag = {n: torch.diagonal(h).float() for n, h in g["calib"].items()}
    out = {
        "protocol": f"decoder layers {g['layers']} quantized from the float model's inputs on "
        f"{g['nsamples']}x{SEQLEN} calibration tokens (seed {SEED}, the verdict calibration's text), the "
        f"rest float; {win} test windows spread over WikiText-2 test; layer errors with float inputs",
        "layers_quantized": g["layers"],
        "calib_samples": g["nsamples"],
        "test_windows": win,
        "linear_errors": summarize_layers(layer_errors(store, model)),
        "tokens": summarize_tokens(tokens, token_counts(tok)),
        "outliers": outlier_layout(q["ssqr"], diag),
        "alpha": {n: i.get("scale_multiplier") for n, i in q["ssqr"]["info"].items()},
        "variants": variants,
        "verdict_alpha": verdict_alpha(),
    }
    write_text(RESULTS / "ssqr_anomaly.json", dumps_results(out))
    write_text(RESULTS / "ssqr_anomaly.md", markdown(out))


def markdown(out: dict) -> str:
    t, lay, a = out["tokens"], out["linear_errors"], out["tokens"]["all"]
    lines = [
        "# SSQR-3% vs GPTQ w3: lower layer error, higher perplexity (issue 73 item 7)",
        "",
        f"Protocol: {out['protocol']}.",
        "",
        f"On these windows: float {a['ppl_float']:.3f}, GPTQ w3 layers {a['ppl_gptq']:.3f}, SSQR-3% layers "
        f"{a['ppl_ssqr']:.3f}; mean NLL gap SSQR - GPTQ {a['nll_gap']:+.5f} nats (95% paired bootstrap "
        f"over windows {a['gap_ci95_lo']:+.5f} .. {a['gap_ci95_hi']:+.5f}; SSQR worse in "
        f"{a['windows_ssqr_worse']} of {a['windows']} windows); KL {a['kl_gptq']:.5f} (GPTQ) vs "
        f"{a['kl_ssqr']:.5f} (SSQR).",
        "",
        "## (a) Linear output error, calibration vs held-out text",
        "",
        f"Relative error tr(dW H dW^T)/tr(W H W^T), float inputs: SSQR lower in {lay['ssqr_lower_calib']} of "
        f"{lay['linears']} linears on the calibration text, {lay['ssqr_lower_test']} on held-out text; "
        f"held-out / calibration mean error: GPTQ {lay['gptq_test_over_calib']:.3f}, SSQR "
        f"{lay['ssqr_test_over_calib']:.3f}.",
        "",
        "| kind | GPTQ calib | GPTQ test | SSQR calib | SSQR test | SSQR lower (test) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for k, r in lay["per_kind"].items():
        lines.append(
            f"| {k} | {r['gptq_calib']:.4g} | {r['gptq_test']:.4g} | {r['ssqr_calib']:.4g} | "
            f"{r['ssqr_test']:.4g} | {r['ssqr_lower_test']} of {r['n']} |"
        )
    lines += [
        "",
        "## (b) NLL excess over float and KL, per bucket of predicted tokens",
        "",
        "| tokens | share | dNLL GPTQ | dNLL SSQR | KL GPTQ | KL SSQR | part of NLL gap | part of KL gap |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in t.items():
        lines.append(
            f"| {name} | {r['share']:.3f} | {r['dnll_gptq']:.5f} | {r['dnll_ssqr']:.5f} | {r['kl_gptq']:.5f} "
            f"| {r['kl_ssqr']:.5f} | {r['gap_part']:+.5f} | {r['kl_gap_part']:+.5f} |"
        )
    lines += [
        "",
        "## (c) Where SSQR's outliers sit",
        "",
        "| kind | rate | outliers | top 1% rows hold | top 1% columns hold | hottest 1% input channels "
        "hold |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for k, r in out["outliers"].items():
        lines.append(
            f"| {k} | {r['rate']:.4f} | {r['outliers']} | {r['top_rows_share']:.3f} | "
            f"{r['top_cols_share']:.3f} | {r['hot_cols_share']:.3f} |"
        )
    lines += [
        "",
        "Variants on the same windows (gap closed: 1 = SSQR's NLL gap to GPTQ gone, < 0 wider):",
        "",
        "| variant | ppl | NLL over GPTQ | gap closed |",
        "| --- | --- | --- | --- |",
    ]
    for v in out["variants"]:
        lines.append(f"| {v['name']} | {v['ppl']:.3f} | {v['nll_over_gptq']:+.5f} | {v['gap_closed']:+.2f} |")
    va = out["verdict_alpha"]
    lines += [
        "",
        f"SSQR-3%'s grid multiplier α in the verdict run (ssqr_groups_verdict.json): mean {va['mean']:.3f}, "
        f"{va['min']:.3f}-{va['max']:.3f} over {va['layers']} layers.",
        "",
        "Reproduce (each a few minutes): `python -m benchmarks.lattice.ssqr_anomaly grams`, then `quantize "
        "--which ssqr`, `quantize --which gptq`, `evaluate --part base`, `evaluate --part variants`, "
        "`report`.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=("all", "grams", "quantize", "evaluate", "report"))
    p.add_argument("--which", choices=sorted(SPECS), default="ssqr")
    p.add_argument("--part", choices=("base", "variants"), default="base")
    p.add_argument("--store", default="/tmp/ssqr_anomaly", help="where the stages keep their results")
    p.add_argument("--layers", default="15", help="decoder layers quantized (comma list)")
    p.add_argument("--budget", type=float, default=270, help="all: seconds after which variants stop")
    p.add_argument("--nsamples", type=int, default=32, help="calibration samples of 512 tokens")
    p.add_argument("--windows", type=int, default=16, help="test windows (spread over the test set)")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    store = Path(a.store)
    store.mkdir(parents=True, exist_ok=True)
    if a.stage in ("all", "grams"):
        t0 = time.perf_counter()
        grams(store, [int(x) for x in a.layers.split(",")], a.nsamples, a.windows)
    if a.stage == "all":  # one job: every stage, the variants as long as the budget lasts
        for which in ("ssqr", "gptq"):
            quantize(which, store)
        evaluate(store, "base", a.windows)
        evaluate(store, "variants", a.windows, a.budget - (time.perf_counter() - t0))
        report(store)
    elif a.stage == "quantize":
        quantize(a.which, store)
    elif a.stage == "evaluate":
        evaluate(store, a.part, a.windows)
    elif a.stage == "report":
        report(store)


if __name__ == "__main__":
    main()
