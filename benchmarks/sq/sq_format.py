"""SQ-format (Huang et al.) on SmolLM2-135M: Algorithm 2 (W4A(SQ), dynamic/static) against W4A8 /
W4A4, Algorithm 1 (W(SQ)Ay) against W4Ay, defaults, ablations, grids and a Fig. 6-like PNG.

Every activation setting uses ONE set of W4 weights (SmoothQuant alpha=0.5 folded, GPTQ W4 g128
asymmetric, calibrated on 16-bit activations): W4A16/A8/A4 attach per-token INT input quantizers,
W4A(SQ) converts each linear to :class:`~bitmosaic.modules.sq.SQActLinear` (static masks from the
per-channel statistics of the smoothed inputs on the calibration set and the quantized ``W'``;
the ``sq-acts`` method uses the float ``W'`` instead).  So the A-settings differ only in their
activations.  Every W(SQ) model is calibrated on 16-bit activations as well and evaluated at A16,
A8 and A4 with the same weights.  Activation quantization is simulated (float32 matmuls).

Columns: ppl (WikiText-2), paper-equivalent bits (x or y, §4.1), measured stored bits per weight
(all buffers, scales included), low-precision MAC share, calibration loss (CE on calibration
windows) where a choice is made by it.

Parts (``--parts``, each cached in JSON so they can run one at a time under the lock):
acts, weights, defaults, gap, ablate, calib, agrid, wgrid, fig, and (issue 25) scales -- static vs
dynamic W4A(SQ6) with activation scales per token / per bank / per group of 128 (and calibrated
static bank/group scales) -- and a4group -- W4A4 and W(SQ)A4 with A4 per group of 64 / 128 channels,
the SQ bank swept apart from the A4 group -- and (issue 73) a4paper -- part a4group's W(SQ)A4 rows with
Algorithm 1's masks as printed (fixed up front from ``W'^2 / diag(H^-1)^2``).  ``--only`` (comma list
of row names) runs some rows; abits (issue 73): W4A5 / A6 / A7, the INT rows between A4 and A8.
Columns ``act_bits`` (values, scales and mask) and ``paper_act_bits_scales`` (the paper's y, or the INT
width, plus the scales), MAC-weighted over the linears, both from ``formats.sq_act.act_bits``.

Run: python -m benchmarks.sq.sq_format --protocol fast --parts acts,weights,...
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, Bench, base_parser, protocol_label, write_text
from benchmarks.sq.sq_format_a4 import (
    CACHE,
    W_SQ,
    _sq_weights,
    model_tag,
    part_a4group,
    part_a4paper,
    part_abits,
)
from benchmarks.sq.sq_format_fig import part_fig
from bitmosaic.algorithms.sq import static_act_scales, static_channel_mask, static_importance
from bitmosaic.data import bos_token_id, calibration_samples
from bitmosaic.eval.perplexity import perplexity
from bitmosaic.formats.act import ActQuantSpec
from bitmosaic.formats.sq import act_name, parse_sq, weight_name
from bitmosaic.formats.sq_act import SQActLayout, act_bits
from bitmosaic.io import load_quantized, save_quantized
from bitmosaic.methods import get_method
from bitmosaic.modules.actquant import attach_input_quant, input_quant_spec
from bitmosaic.modules.base import set_weight_cache
from bitmosaic.modules.qlinear import QuantLinear
from bitmosaic.modules.sq import SQActLinear, SQWeightLinear
from bitmosaic.pipeline import RunSettings, quantize_model

BASE = {"bits": 4, "group_size": 128, "alpha": 0.5, "solver": "gptq"}
DEFAULT_LAYERS = (2, 14, 26)
SCALE_SETTINGS = (("token", None, False), ("bank", None, False), ("group", 128, False))
STATIC_CALIBRATED = (("bank", None, True), ("group", 128, True))
ACT_TOKENS = 2048  # rows a static mask / calibrated scale is spread over in the activation bits


def scale_label(scale: str, group: int | None, calibrated: bool) -> str:
    return (f"group{group}" if scale == "group" else scale) + ("/calibrated" if calibrated else "")


def linears(model, kinds=(QuantLinear, SQWeightLinear)):
    return [(n, m) for n, m in model.named_modules() if type(m) in kinds]


class SQBench(Bench):
    def __init__(self, args):
        super().__init__(args)
        self.out = Path(args.json) if args.json else RESULTS / "sq_format.json"
        old = json.loads(self.out.read_text()) if self.out.exists() else {}
        self.done = old.get("rows", [])
        self.notes = old.get("notes")  # kept across runs (e.g. sq_act_bits.py's backfill note)
        self._base = None
        self._stats: dict[int, dict] = {}

    def save(self) -> None:
        out = {"args": vars(self.args), "rows": self.done}
        write_text(self.out, json.dumps(out | ({"notes": self.notes} if self.notes else {}), indent=2))

    # -- models -------------------------------------------------------------------------------
    def quantize(self, method: str, **opts):
        spec = get_method(method)
        cfg = spec.make_config(**opts)
        model = copy.deepcopy(self.model)
        rep = quantize_model(model, self.calib, spec, cfg, RunSettings(seed=self.args.seed))
        return model, rep

    def base(self):
        """The W4 weights every activation setting shares; cached on disk between parts."""
        if self._base is None:
            a = self.args
            # the model is part of the key (a second model once read SmolLM2's cached weights)
            path = CACHE / f"base_{a.nsamples}x{a.seqlen}_s{a.seed}{model_tag(a)}"
            t = time.perf_counter()
            if path.exists():
                self._base = load_quantized(path, load_tokenizer=False)[0].float().eval()
            else:
                self._base, _ = self.quantize("smoothquant", **BASE)
                save_quantized(self._base, path, {"method": "smoothquant", **BASE})
            print(f"base W4 (smoothquant a=0.5 + GPTQ g128): {time.perf_counter() - t:.0f}s", flush=True)
        return self._base

    def stats(self, nsamples: int) -> dict:
        """Per-linear mean x_j, mean |x_j| and max |x_j| of the base model's (smoothed) inputs on the
        first ``nsamples`` calibration sequences."""
        if nsamples not in self._stats:
            model = self.base()
            acc: dict[str, list] = {}

            def hook(name):
                def f(mod, args):
                    x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
                    a = acc.setdefault(name, [0, 0.0, 0.0, 0.0])
                    a[0] += x.shape[0]
                    a[1] = a[1] + x.sum(0)
                    a[2] = a[2] + x.abs().sum(0)
                    a[3] = torch.maximum(torch.as_tensor(a[3]), x.abs().amax(0).float())

                return f

            calib = self.calib
            if nsamples > len(calib):  # more sequences than the weights were calibrated on
                a = self.args
                calib = calibration_samples(
                    self.tok, "wikitext2", nsamples, a.seqlen, a.seed, data_dir=a.data_dir
                )
            hs = [m.register_forward_pre_hook(hook(n)) for n, m in linears(model)]
            with torch.inference_mode():
                for i in range(0, nsamples, 4):
                    model(calib[i : min(i + 4, nsamples)], use_cache=False)
            for h in hs:
                h.remove()
            self._stats[nsamples] = {n: (s / c, a / c, mx) for n, (c, s, a, mx) in acc.items()}
        return self._stats[nsamples]

    def with_acts(self, model, abits: int | None, group: int | None = None):
        """``model`` with INT ``abits`` input quantizers: per token, or per token and ``group`` channels."""
        m = copy.deepcopy(model)
        if abits is not None:
            kw = {"granularity": "group", "group_size": group} if group else {}
            spec = ActQuantSpec("int", abits, **kw)
            for _, lin in linears(m):
                attach_input_quant(lin, spec, lin.in_features)
        return m

    def with_sq_acts(
        self,
        sq: str,
        strategy: str,
        importance: str = "aw",
        nsamples: int | None = None,
        scale: str = "token",
        group: int | None = None,
        calibrated: bool = False,
    ):
        """The base W4 model with SQ-format activations (``scale``/``group``: the activation scale
        groups; ``calibrated``: static bank/group scales from the calibration inputs' max |x_j|)."""
        m = copy.deepcopy(self.base())
        fmt = parse_sq(sq)
        st = self.stats(nsamples or self.args.nsamples) if strategy == "static" else None
        for name, lin in linears(m, (QuantLinear,)):
            mask = scales = None
            if st is not None:
                mean, absmean, absmax = st[name]
                W = lin.dequantize_weight(torch.float32)
                mask = static_channel_mask(static_importance(W, mean, absmean, importance), fmt)
                if calibrated:
                    scales = static_act_scales(absmax, mask, fmt, scale, group)
            m.set_submodule(name, SQActLinear.from_packed(lin, sq, strategy, scale, mask, group, scales))
        return m

    # -- measurements ---------------------------------------------------------------------------
    def calib_loss(self, model) -> float:
        """Mean CE (nats) on the first 4 calibration sequences (the selection criterion of the grids)."""
        ids = self.calib[:4].reshape(1, -1)
        r = perplexity(model, ids, self.args.seqlen, progress=False, bos_token_id=bos_token_id(self.tok))
        return math.log(r["ppl"])

    @staticmethod
    def measured(model) -> tuple[float, float, float, float]:
        """(stored bits per weight over all quantized linears, low-precision MAC share, activation bits,
        the paper's activation bits plus the scales' bits), the last two MAC-weighted, both from
        :func:`~bitmosaic.formats.sq_act.act_bits` of each linear's input layout (issue 73): ``total``
        (values, scales and mask: SQ splits with scales per token / bank / group or calibrated per
        linear, INT ``a + 16 ceil(K / G) / K`` with G = K per token, 16 when unquantized) and
        ``with_scales`` (the paper's ``y`` or the INT width, plus the scales)."""
        bits = n = low = abits = pbits = 0.0
        for _, m in model.named_modules():
            if not (hasattr(m, "bits_per_weight") and hasattr(m, "storage_tensors")):
                continue
            k = m.in_features * m.out_features
            bits += m.bits_per_weight() * k
            n += k
            spec = input_quant_spec(m)
            a4 = spec is not None and spec.bits <= 4
            layout = spec
            if isinstance(m, SQActLinear):  # W4 x A(SQ): the low part runs W4A4
                layout = SQActLayout(m.fmt, m.strategy, m.act_scale, m.act_group, m.calibrated_scales)
                low += m.mac_split()[0]
            elif isinstance(m, SQWeightLinear):  # W(SQ) x A4: the low part runs W4A4
                low += m.mac_split()[0] if a4 else 0
            else:
                low += k if a4 and getattr(m, "bits", 16) <= 4 else 0
            ab = act_bits(m.in_features, layout, ACT_TOKENS)
            abits += ab.total * k
            pbits += ab.with_scales * k
        return bits / n, low / n, abits / n, pbits / n

    def row(self, part: str, name: str, model, paper_bits, **extra) -> dict | None:
        if not self.wants(name):
            return None
        t = time.perf_counter()
        bpw, share, abits, pbits = self.measured(model)
        r = {
            "part": part,
            "name": name,
            "paper_bits": paper_bits,
            "measured_bits": bpw,
            "act_bits": abits,
            "paper_act_bits_scales": pbits,
            "low_mac_share": share,
            **extra,
        }
        set_weight_cache(model, True)  # SQ weights dequantize through the reference path
        r.update(self.measure(model))  # ppl (and, verdict protocol, KL and top-1 from the same pass)
        r["eval_seconds"] = time.perf_counter() - t
        self.done = [d for d in self.done if not (d["part"] == part and d["name"] == name)] + [r]
        self.save()
        print(
            f"  [{part}] {name:<44} ppl {r['ppl']:9.3f}  paper {paper_bits!s:>6}  bits {bpw:6.3f}"
            f"  act-bits {abits:6.3f}  low-MAC {share:.3f}" + "".join(f"  {k} {v}" for k, v in extra.items()),
            flush=True,
        )
        return r


def part_acts(b: SQBench) -> None:
    base = b.base()
    for ab in (16, 8, 4):
        b.row("acts", f"W4A{ab}", b.with_acts(base, None if ab == 16 else ab), f"4/{ab}")
    for sq in ("16-(8/4)-0.5", "16-(8/4)-0.75"):
        for strat in ("dynamic", "static"):
            name = f"{act_name(4, parse_sq(sq))} {sq} {strat}"
            if b.wants(name):
                b.row("acts", name, b.with_sq_acts(sq, strat), parse_sq(sq).paper_act_bits())


def part_weights(b: SQBench) -> None:
    for sq in W_SQ.values():
        model, info = _sq_weights(b, sq)
        fmt = parse_sq(sq)
        for ab in (4, 8, 16):
            name = f"{weight_name(fmt, ab)} {sq}"
            b.row(
                "weights", name, b.with_acts(model, None if ab == 16 else ab), fmt.paper_weight_bits, **info
            )
        del model


def part_defaults(b: SQBench) -> None:
    """Importance form x mask timing for Algorithm 1, decided by the calibration loss: the float
    model is smoothed layer by layer (the sq-weights transform), every linear of layers
    ``DEFAULT_LAYERS`` gets its Hessian from the smoothed calibration inputs, and ``sq_gptq`` runs
    with each combination; the loss is ``sum tr(E H E^T) / sum tr(W H W^T)`` over those linears.
    (Four full pipeline runs would not fit the shared machine's budget.)"""
    from bitmosaic.algorithms.hessian import HessianAccumulator
    from bitmosaic.algorithms.sq import sq_gptq
    from bitmosaic.models.arch import get_arch
    from bitmosaic.pipeline.calibration import capture_layer_inputs
    from bitmosaic.pipeline.capture import run_layer
    from bitmosaic.pipeline.loop import transform_layer

    spec = get_method("sq-weights")
    m = copy.deepcopy(b.model)
    arch = get_arch(m)
    layers = arch.layers(m)
    inputs, kw = capture_layer_inputs(m, layers, b.calib[:8], batch_size=4)
    kwargs = next(iter(kw.values()))
    gen = torch.Generator().manual_seed(b.args.seed)
    cfg = spec.make_config(sq=W_SQ["W(SQ5)"])
    linears_h: list[tuple[torch.Tensor, torch.Tensor]] = []
    for li, layer in enumerate(layers):
        plan = {n: (spec, cfg) for g in arch.sequential for n in g}
        transform_layer(layer, arch, plan, inputs, kwargs, gen)
        accs, hooks = {}, []
        if li in DEFAULT_LAYERS:
            for name in [n for g in arch.sequential for n in g]:
                lin = layer.get_submodule(name)
                acc = accs[name] = HessianAccumulator(lin.in_features)
                hooks.append(lin.register_forward_pre_hook(lambda mod, a, acc=acc: acc.add(a[0])))
        with torch.inference_mode():
            inputs = [run_layer(layer, h, k) for h, k in zip(inputs, kwargs, strict=True)]
        for h in hooks:
            h.remove()
        for name, acc in accs.items():
            linears_h.append((layer.get_submodule(name).weight.detach().float().clone(), acc.H))
    den = sum(float(torch.einsum("ij,jk,ik->", W, H, W)) for W, H in linears_h)
    for sq in (W_SQ["W(SQ6)"], W_SQ["W(SQ5)"], W_SQ["W(SQ4.5)"], "4-(8/0)-0.5"):
        fmt = parse_sq(sq)
        for imp in ("obs", "paper"):
            for timing in ("lazy", "upfront"):
                t = time.perf_counter()
                num = 0.0
                for W, H in linears_h:
                    E = W - sq_gptq(W, H, fmt, importance=imp, mask_timing=timing).dequantize()
                    num += float(torch.einsum("ij,jk,ik->", E, H, E))
                r = {
                    "part": "defaults",
                    "name": f"{sq} {imp}/{timing}",
                    "calib_loss": num / den,
                    "paper_bits": fmt.paper_weight_bits,
                    "seconds": time.perf_counter() - t,
                }
                b.done = [d for d in b.done if not (d["part"] == "defaults" and d["name"] == r["name"])] + [r]
                print(f"  [defaults] {r['name']:<36} rel. output error {num / den:.5f}", flush=True)
    b.save()


# issue 25: the claims first measured with per-token activation scales, rerun with per-bank scales (the
# granularity the paper's tables fit); per-bank rows carry " scales=bank" in their names
CLAIM_SCALES = ("token", "bank")


def _scaled(name: str, scale: str) -> str:
    return name if scale == "token" else f"{name} scales={scale}"


def part_gap(b: SQBench) -> None:
    for scale in CLAIM_SCALES:
        for sq in ("16-(8/4)-0.5", "16-(8/3)-0.5", "16-(8/2)-0.5"):
            for strat in ("dynamic", "static"):
                fmt = parse_sq(sq)
                name = _scaled(f"{act_name(4, fmt)} {sq} {strat}", scale)
                if b.wants(name):
                    b.row("gap", name, b.with_sq_acts(sq, strat, scale=scale), fmt.paper_act_bits())


def part_ablate(b: SQBench) -> None:
    sq = "16-(8/4)-0.5"
    for scale in CLAIM_SCALES:
        for imp in ("aw", "a", "abs-aw"):
            name = _scaled(f"W4A(SQ6) {sq} static I={imp}", scale)
            if b.wants(name):
                b.row("ablate", name, b.with_sq_acts(sq, "static", imp, scale=scale), 6.0)


def part_calib(b: SQBench) -> None:
    sq = "16-(8/4)-0.5"
    for n in (8, 128):  # the weights stay those calibrated on --nsamples; only the masks change
        b.row(
            "calib",
            f"W4A(SQ6) {sq} static, mask from {n} samples",
            b.with_sq_acts(sq, "static", nsamples=n),
            6.0,
        )


def part_agrid(b: SQBench) -> None:
    """Bank x sparsity grid for W4A(SQ) (8/4), static (the strategy whose bank preference the paper
    discusses; the dynamic split's reference path is ~7x slower here), with per-token and per-bank
    activation scales; the best cell is chosen by calibration loss, test perplexity is only reported.
    Banks up to 64: 128 does not divide SmolLM2's 576-wide inputs.  Cells already in the JSON are kept
    (the grid is long)."""
    have = {d["name"] for d in b.done if d["part"] == "agrid"}
    for scale in CLAIM_SCALES:
        for s in (0.5, 0.75):
            for bank in (4, 8, 16, 32, 64):
                sq = f"{bank}-(8/4)-{s:g}"
                name = _scaled(f"W4A(SQ) {sq} static", scale)
                if name in have or not b.wants(name):
                    continue
                m = b.with_sq_acts(sq, "static", scale=scale)
                b.row("agrid", name, m, parse_sq(sq).paper_act_bits(), calib_loss=b.calib_loss(m))


def part_wgrid(b: SQBench) -> None:
    """Bank grid at s = 0.875 for W(SQ5)A16, the best by calibration loss (sum of layer losses)."""
    for bank in (16, 32, 64):
        sq = f"{bank}-(8/4)-0.875"
        model, info = _sq_weights(b, sq)
        b.row("wgrid", f"W(SQ5)A16 {sq}", model, 5.0, calib_loss=b.calib_loss(model), **info)


def part_scales(b: SQBench) -> None:
    """Issue 25: static vs dynamic W4A(SQ6) 16-(8/4)-0.5 with activation scales per token, per
    (token, bank) and per (token, 128 channels), and static with calibrated bank / 128-channel scales."""
    sq = "16-(8/4)-0.5"
    fmt = parse_sq(sq)
    runs = [(st, *c) for st in ("dynamic", "static") for c in SCALE_SETTINGS]
    runs += [("static", *c) for c in STATIC_CALIBRATED]
    for strat, scale, group, calibrated in runs:
        name = f"{act_name(4, fmt)} {sq} {strat} scales={scale_label(scale, group, calibrated)}"
        if b.wants(name):
            m = b.with_sq_acts(sq, strat, scale=scale, group=group, calibrated=calibrated)
            b.row("scales", name, m, fmt.paper_act_bits())


PARTS = {
    "table": lambda b: None,  # only print/write the table of what is already in the JSON
    "acts": part_acts,
    "weights": part_weights,
    "defaults": part_defaults,
    "gap": part_gap,
    "ablate": part_ablate,
    "calib": part_calib,
    "agrid": part_agrid,
    "wgrid": part_wgrid,
    "fig": part_fig,
    "scales": part_scales,
    "a4group": part_a4group,
    "a4paper": part_a4paper,
    "abits": part_abits,
}


def table(rows: list[dict]) -> str:
    cols = ["part", "name", "ppl", "paper_bits", "measured_bits", "act_bits", "paper_act_bits_scales"]
    cols += ["low_mac_share", "calib_loss"]
    cols += [c for c in ("kl_mean", "top1_agreement", "act_compute") if any(c in r for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            if isinstance(v, dict):  # act_compute: layers by path (common.act_paths)
                v = ", ".join(f"{k} {n}" for k, n in v.items())
            cells.append(f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--parts", default="acts,weights")
    a = p.parse_args()
    torch.manual_seed(a.seed)
    b = SQBench(a)
    for part in a.parts.split(","):
        if part not in PARTS:
            raise SystemExit(f"unknown part {part!r}; choose from {', '.join(PARTS)}")
        t = time.perf_counter()
        print(f"== part {part}", flush=True)
        PARTS[part](b)
        print(f"== part {part}: {time.perf_counter() - t:.0f}s", flush=True)
    md = report(b.done, a)
    print("\n" + md)
    write_text(b.out.with_suffix(".md"), md + "\n")


def report(rows: list[dict], a) -> str:
    """The markdown of ``rows`` (a run's JSON) under its settings ``a``."""
    windows = "every window" if a.max_windows is None else f"the first {a.max_windows} windows"
    proto = protocol_label(a)
    flag = "" if proto == "custom" else f"--protocol {proto} "
    head = (
        f"SQ-format on {a.model}, calibration {a.nsamples}x{a.seqlen} (seed {a.seed}), WikiText-2 "
        f"perplexity on {windows} of {a.seqlen} (protocol: {proto}; fast: 16x512 and 20 windows, "
        "verdict: 128x512, every window, KL and top-1 to the float model from the same pass). Each part "
        f"reruns alone: `PYTHONPATH=src python -m benchmarks.sq.sq_format {flag}--parts PART` "
        "(`--only ROW,...` for some of its rows; `act_compute`: the quantized layers by how "
        "their activations computed, integer kernel or simulated in float32, where the row recorded it).\n\n"
    )
    return head + table(rows)


if __name__ == "__main__":
    main()
