"""SQ-format paper Fig. 6 on SmolLM2: ``sq_format.py --parts fig`` (its own file to keep the
benchmark under 500 lines).  ``b`` is ``sq_format.SQBench``."""

from __future__ import annotations

import torch

from benchmarks.harness import RESULTS
from bitmosaic.algorithms.sq import static_channel_mask, static_importance
from bitmosaic.formats.sq import parse_sq


def part_fig(b) -> None:
    """Fig. 6: per-channel mean |x| of one layer's input, original vs the low part after the
    static split at s = 0.75 for b = 32 and b = 4."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = "model.layers.20.mlp.down_proj"
    base = b.base()
    lin = base.get_submodule(name)
    xs = []
    h = lin.register_forward_pre_hook(lambda mod, a: xs.append(a[0].detach().reshape(-1, a[0].shape[-1])))
    with torch.inference_mode():
        base(b.calib[:1], use_cache=False)
    h.remove()
    x = xs[0].float()
    mean, absmean, _ = b.stats(b.args.nsamples)[name]
    W = lin.dequantize_weight(torch.float32)
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True, sharey=True)
    mag = x.abs().mean(0)
    axes[0].plot(mag.numpy(), lw=0.6)
    axes[0].set_title(f"(a) original input of {name} (mean |x| per channel)")
    for ax, bank in zip(axes[1:], (32, 4), strict=True):
        fmt = parse_sq(f"{bank}-(8/4)-0.75")
        mask = static_channel_mask(static_importance(W, mean, absmean, "aw"), fmt)
        ax.plot(mag.masked_fill(mask, 0).numpy(), lw=0.6, color="C1")
        ax.set_title(f"low-precision part, static split, bank {bank}, s = 0.75")
    axes[-1].set_xlabel("input channel")
    for ax in axes:
        ax.set_yscale("log")
    fig.tight_layout()
    path = RESULTS / "sq_format_fig6.png"
    fig.savefig(path, dpi=110)
    print(f"  figure written to {path}")
