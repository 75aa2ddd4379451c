"""A model-level Atom-like W4A4 row on SmolLM2-135M: MosaicQuant's comparator in its Table 1 (Atom, Zhao
et al. 2024), rebuilt in the simplified form of ``benchmarks/mosaic/mosaic_layers.py`` and run over the whole
model, so that MosaicQuant's "beats Atom" claim is judged on perplexity, as the paper judges it.

Per linear: 3.1% of the input channels (Atom's 128 of 4096), those of largest ``max|X_j|`` on the
calibration inputs, keep INT8 weights (per row, symmetric, after the OBS update for the 4-bit channels'
error) and INT8 per-token activations; the other channels get GPTQ g128 INT4 symmetric weights on their
Hessian block and INT4 activations per group of 128 over the reordered channels (dynamic, as MosaicQuant's
A4, App. C.1).  No smoothing, no KV-cache quantization.  Layers are quantized in order, each linear group
(q/k/v, o, gate/up, down) calibrated on the inputs the already-quantized layers and groups produce (as the
pipeline's GPTQ does).

**Simulated:** the split runs as float32 fake quantization (the values Atom's kernels would compute, not
its kernels or speed).  Bits: weight codes, fp16 scales and the int32 channel order per weight;
activation codes and one fp16 scale per token and group per element.

The run also measures MosaicQuant W4A4 (``mosaic.py``'s main row, the same options) as its comparator, so
the claim compares rows of one run: one protocol, one ``--device`` (``--no-mosaic`` skips it).  The
Atom-like split itself is quantized on the CPU whatever ``--device`` says; its evaluation runs there.

Run: flock /tmp/bitmosaic-heavy.lock python -m benchmarks.mosaic.atom_model --protocol fast --threads 2
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

from benchmarks.harness import Bench, base_parser, protocol_label, write_results
from benchmarks.mosaic.mosaic import REFERENCE
from benchmarks.mosaic.mosaic import part_runs as mosaic_runs
from benchmarks.mosaic.mosaic_layers import A4, ATOM_SHARE, atom_like_weights
from bitmosaic.formats.act import ActQuantSpec, fake_quant
from bitmosaic.models.arch import get_arch
from bitmosaic.pipeline.calibration import LayerInputs
from bitmosaic.pipeline.capture import run_layer
from bitmosaic.pipeline.pipeline import capture_layer_inputs
from bitmosaic.pipeline.statistics import group_statistics

A8 = ActQuantSpec("int", 8)


class AtomLikeLinear(nn.Module):
    """``y = Q4(x[lo]) W_loᵀ + Q8(x[hi]) W_hiᵀ (+ b)``, fake-quantized (dequantized weights in float32)."""

    def __init__(self, lin: nn.Linear, lo, hi, w_lo, w_hi, act4: ActQuantSpec):
        super().__init__()
        self.register_buffer("lo", lo)
        self.register_buffer("hi", hi)
        self.register_buffer("w_lo", w_lo.to(lin.weight.dtype))
        self.register_buffer("w_hi", w_hi.to(lin.weight.dtype))
        self.bias = lin.bias
        self.act4 = act4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (
            fake_quant(x[..., self.lo], self.act4) @ self.w_lo.T
            + fake_quant(x[..., self.hi], A8) @ self.w_hi.T
        )
        return y if self.bias is None else y + self.bias


@torch.no_grad()
def quantize_atom_like(model: nn.Module, calib: torch.Tensor, share: float = ATOM_SHARE) -> dict:
    """Replace every decoder linear of ``model`` (in place) by its :class:`AtomLikeLinear`; returns the
    weight bits per weight and activation bits per element, weighted by the linears' sizes."""
    arch = get_arch(model)
    layers = arch.layers(model)
    inputs, kw = capture_layer_inputs(model, layers, calib, batch_size=4)
    kwargs = next(iter(kw.values()))
    wbits = abits = weights = elems = 0.0
    t0 = time.perf_counter()
    for li, layer in enumerate(layers):
        for group in arch.sequential:  # each group calibrated on the inputs the quantized ones give
            lins = {n: layer.get_submodule(n) for n in group}
            accs, owner, obs = group_statistics(
                layer, group, LayerInputs(inputs, torch.device("cpu"), False), kwargs,
                hessian_dtype=torch.float64, observe=True,
            )  # fmt: skip
            for n, lin in lins.items():
                W = lin.weight.detach().float()
                own = owner[n]  # q/k/v and gate/up share one input: its Hessian and channel maxima
                lo, hi, w_lo, w_hi, bits = atom_like_weights(
                    W, accs[own].H, obs[own].channel_absmax, A4, share
                )
                parent, _, leaf = n.rpartition(".")
                setattr(layer.get_submodule(parent), leaf, AtomLikeLinear(lin, lo, hi, w_lo, w_hi, A4))
                wbits += bits["atom_weight_bpw"] * W.numel()
                weights += W.numel()
                abits += bits["atom_act_bits"] * W.shape[1]
                elems += W.shape[1]
        inputs = [run_layer(layer, h, k) for h, k in zip(inputs, kwargs, strict=True)]
        done = li + 1
        eta = (time.perf_counter() - t0) / done * (len(layers) - done)
        print(f"  layer {done}/{len(layers)}  ETA {eta:4.0f}s", flush=True)
    return {"weight_bpw": wbits / weights, "act_bits": abits / elems}


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--share", type=float, default=ATOM_SHARE, help="share of INT8 input channels")
    p.add_argument("--max-tokens", type=int, default=1024, help="MosaicQuant's alpha-search token sample")
    p.add_argument(
        "--no-mosaic", action="store_true",
        help="skip the MosaicQuant W4A4 row (mosaic.py's main row, rerun here as the comparator)",
    )  # fmt: skip
    a = p.parse_args()
    a.fidelity = True
    b = Bench(a)
    rows = [{"name": "float", **b.measure(b.model)}]
    model = copy.deepcopy(b.model)  # b.model stays the float reference of KL and top-1
    t = time.perf_counter()
    bits = quantize_atom_like(model, b.calib, a.share)
    q = time.perf_counter() - t
    row = {"name": f"atom-like W4A4 ({a.share:.1%} INT8 channels)", "share": a.share, **bits,
           "quant_seconds": q, **b.measure(model)}  # fmt: skip
    rows.append(row)
    print(f"  {row['name']}: ppl {row['ppl']:.2f} KL {row['kl_mean']:.4f} top-1 {row['top1_agreement']:.4f} "
          f"@ {bits['weight_bpw']:.3f} bpw / {bits['act_bits']:.3f} act bits", flush=True)  # fmt: skip
    if not a.no_mosaic:  # the comparator, measured in this run: one protocol, one device
        name, _, method, opts = next(r for r in mosaic_runs("main", a.max_tokens) if r[0] == REFERENCE)
        mos = b.run(name, method, **opts)
        rows.append({k: v for k, v in mos.items() if k != "layers"})
    keep = ("model", "nsamples", "seqlen", "max_windows", "seed", "fidelity", "device")
    args = {k: getattr(a, k) for k in keep}
    proto = protocol_label(a)
    windows = "every window" if a.max_windows is None else f"{a.max_windows} windows"
    md = [
        f"Atom-like W4A4 on {a.model}, *{proto}* protocol (calibration {a.nsamples}x{a.seqlen}, seed "
        f"{a.seed}; {windows}); simulated (float32 fake quantization). Reproduce: "
        f"`python -m benchmarks.mosaic.atom_model --protocol {proto}`",
        "",
        "| row | ppl | KL | top-1 | weight bits/weight | activation bits | quant s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        wb, qs = r.get("weight_bpw", r.get("bits_per_weight", 32)), r.get("quant_seconds", 0)
        ab = f"{r['act_bits']:.3f}" if "act_bits" in r else ("32" if r["name"] == "float" else "A4 g128")
        cells = (r["name"], f"{r['ppl']:.2f}", f"{r['kl_mean']:.4f}", f"{r['top1_agreement']:.4f}",
                 f"{wb:.3f}", ab, f"{qs:.0f}")  # fmt: skip
        md.append("| " + " | ".join(cells) + " |")
    write_results(a.json, "atom_model", {"protocol": proto, "args": args, "rows": rows}, "\n".join(md))


if __name__ == "__main__":
    main()
