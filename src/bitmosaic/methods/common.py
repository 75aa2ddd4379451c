"""What several methods share, declared once: the options they have in common (``shared(name)``;
each config may give its own default, help and choices) and small helpers of the method layer
(processing orders, the Hessian check, the fake quantizers smoothing searches score with).  Method
files import this, never each other's private parts."""

from __future__ import annotations

import dataclasses

import torch

from ..algorithms.hessian import damp_hessian
from ..algorithms.observers import ActObserver
from ..algorithms.orders import make_order
from ..algorithms.rtn import rtn_quantize
from ..formats.act import ActQuantSpec, fake_quant
from ..formats.grid import IntGrid
from .base import LayerStats, WeightQuantConfig
from .options import option, parse_alpha

__all__ = [
    "HESSIAN_DTYPES", "act_fake_quant", "foldable_groups", "processing_order", "require_hessian", "shared",
    "weight_fake_quant",
]  # fmt: skip

HESSIAN_DTYPES = {"float32": torch.float32, "float64": torch.float64}

# name -> (default, option spec): the options several methods have; a config takes one with
# ``shared(name, default, **changes)`` (its own default, help, choices, old spellings)
_SHARED: dict[str, tuple] = {
    "order": ("act", dict(
        help="processing order of the columns (act: diag(H) descending; gar: group-aware)",
        choices=("natural", "act", "gar", "min-pivot"))),
    "direction": ("front", dict(
        help="process the order from the front or the back", choices=("front", "back"))),
    "damp": (0.01, dict(
        help="Hessian damping, fraction of mean diag(H)", range=(0, 1), old_names=("percdamp",))),
    "solver_dtype": ("float32", dict(
        help="working precision of the GPTQ/Babai solver", choices=tuple(HESSIAN_DTYPES),
        old_names=("dtype",))),
    "block_size": (128, dict(help="GPTQ lazy-batch width (columns updated together)", range=(1, None))),
    "solver": ("gptq", dict(help="inner solver", choices=("gptq", "rtn"))),
    "smooth": (True, dict(help="smooth (SmoothQuant factors) before quantizing")),
    "alpha": (0.5, dict(
        help="migration strength in [0, 1], or 'search' (per group, on --alpha-grid)", parse=parse_alpha,
        type=float)),
    "max_tokens": (2048, dict(help="token sample of the alpha/scale search", range=(1, None))),
    "n_grid": (20, dict(help="AWQ scale-search grid points", range=(1, None))),
    "duo_scaling": (True, dict(help="AWQ duo scaling: scales from activations and weights")),
    "clip_search": (True, dict(help="output-aware clip search per group")),
    "max_shrink": (0.5, dict(help="largest clip shrink the AWQ clip search tries", range=(0, 1))),
    "per_channel": (False, dict(help="FP8 weight scale per output channel (else per tensor)")),
    "pow2": (False, dict(help="power-of-two FP8 scales")),
}  # fmt: skip


def shared(name: str, default=dataclasses.MISSING, **changes):
    """The shared option ``name`` as a config field, with this config's default and spec changes."""
    d, spec = _SHARED[name]
    return option(d if default is dataclasses.MISSING else default, **{**spec, **changes})


def processing_order(H: torch.Tensor, cfg) -> torch.Tensor:
    """The processing order for ``cfg.order``/``cfg.direction`` from the *undamped* ``H``.

    min-pivot pivots on the damped Hessian (the factorisation GPTQ uses), damped here once; every
    method must pass the calibration Hessian as stored, so that gptq and babai see the same order.
    """
    if cfg.order == "min-pivot":
        H = damp_hessian(H, cfg.damp)[0]
    return make_order(H, cfg.order, cfg.group_size, cfg.direction)


def require_hessian(stats: LayerStats, name: str) -> torch.Tensor:
    if stats.hessian is None:
        raise ValueError(
            f"method {name!r} needs calibration Hessians; run it through the calibration pipeline"
        )
    return stats.hessian


def weight_fake_quant(cfg: WeightQuantConfig):
    """RTN with ``cfg``'s grid: the weight quantizer the factor searches score with."""
    grid = IntGrid(cfg.bits, cfg.sym)
    return lambda W: rtn_quantize(W, grid, cfg.group_size, cfg.scale).dequantize(W.dtype)


def act_fake_quant(spec: ActQuantSpec | None):
    """The activation quantizer as a function of a token sample (static scales from that sample)."""
    if spec is None:
        return lambda X: X

    def q(X: torch.Tensor) -> torch.Tensor:
        scale = None
        if spec.static:
            obs = ActObserver(X.shape[-1], spec)
            obs.add(X)
            scale = obs.static_scale()
        return fake_quant(X, spec, scale)

    return q


def foldable_groups(caps, factors):
    """``factors(cap, weights) -> (scales | None, info)`` on foldable groups; the rest unsmoothed."""
    return [
        factors(cap, [cap.weights[n] for n in cap.names])
        if cap.foldable
        else (None, {"reason": "no foldable preceding op"})
        for cap in caps
    ]
