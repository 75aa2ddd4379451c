"""What several methods share, declared once: the options they have in common (``shared(name)``;
each config may give its own default, help and choices), the small config bases several methods'
configs stand on (:class:`GPTQSolverConfig`: the fields of a GPTQ solve; :class:`SmoothingConfig`:
SmoothQuant smoothing before an RTN or GPTQ solve), the solves and transform they share
(:func:`quantize_gptq`, :func:`smoothing_transform`) and small helpers of the method layer
(processing orders, the Hessian check, the fake quantizers smoothing searches score with).  Method
files import this, never each other: no method's config derives from another method's config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..algorithms.gptq import gptq_quantize
from ..algorithms.hessian import damp_hessian
from ..algorithms.observers import ActObserver
from ..algorithms.orders import groups_contiguous, make_order
from ..algorithms.rtn import rtn_quantize
from ..algorithms.smooth import search_alpha, smooth_scales, smoothing_loss
from ..algorithms.types import QuantResult
from ..formats.act import ActQuantSpec, fake_quant
from ..formats.grid import IntGrid
from .base import LayerStats, WeightQuantConfig
from .options import like, option, parse_alpha, parse_floats

__all__ = [
    "ALPHA_GRID", "GPTQSolverConfig", "HESSIAN_DTYPES", "STATIC_GROUPS_MIN_BITS", "SmoothingConfig",
    "act_fake_quant", "foldable_groups", "processing_order", "quantize_gptq", "require_hessian", "shared",
    "smoothing_transform", "static_groups_for", "weight_fake_quant",
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
    "wfmt": ("int", dict(
        help="weight format: int (the INT grid) or a microscaling format (mxfp4, nvfp4, mxfp8, mxfp8-e5m2, "
        "fp8-block; fixes bits and group size; --scheme NVFP4A16 etc. set it)",
        choices=("int", "mxfp4", "nvfp4", "mxfp8", "mxfp8-e5m2", "fp8-block"))),
    "mx_rule": ("floor", dict(
        help="E8M0 shared exponent: floor (OCP MX spec) or round (compressed-tensors/vLLM)",
        choices=("floor", "round"))),
    "sq": ("16-(8/4)-0.75", dict(
        help="SQ format bank-(high/low)-sparsity, e.g. 16-(8/4)-0.5 or 64-(fp8/fp4)-0.875")),
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


def foldable_groups(caps, factors, tied: bool = False):
    """``factors(cap, weights) -> (scales | None, info)`` on foldable groups; the rest unsmoothed.
    ``tied``: also on groups foldable with factors shared within the classes of ``cap.tie`` (GQA
    ``o_proj``; ``factors`` must then return scales constant on each class)."""
    return [
        factors(cap, [cap.weights[n] for n in cap.names])
        if cap.foldable or (tied and getattr(cap, "tie", None) is not None)
        else (None, {"reason": "no foldable preceding op"})
        for cap in caps
    ]


# -- the GPTQ solve: gptq; smoothquant and sq-acts with their GPTQ solver; sq-weights' fields ----------
@dataclass
class GPTQSolverConfig(WeightQuantConfig):
    """The fields of a GPTQ solve, for the configs of the methods that run one (each gives its own
    defaults).  ``static_groups=True`` fixes every group's scale from the original weights of its
    contiguous columns (the Babai-equivalent lattice; llm-compressor's ``actorder: weight``),
    ``False`` fits each group on the error-updated weights when it is reached (under act-order:
    groups by processing position, with a permuted ``g_idx`` that only GPTQ checkpoints hold),
    ``None`` (auto) resolves per layer in :func:`static_groups_for`; ``solver_dtype`` is the solver's
    working precision."""

    order: str = shared("order")
    direction: str = shared("direction")
    static_groups: bool | None = option(
        None,
        help="fix every group's scale from the original weights before the updates (contiguous groups, "
        "no g_idx: every export format holds it); --no-static-groups: fit each group on the updated "
        "weights when reached (act-order then needs a g_idx: GPTQ export only); auto: static at 4+ bits "
        "under act/min-pivot orders, dynamic at 2-3 bits (measured best at each width)",
        type=bool,
    )
    block_size: int = shared("block_size")
    damp: float = shared("damp")
    solver_dtype: str = shared("solver_dtype")


# auto groups: static from this width up (benchmarks/results/static_groups*.md, verdict protocol)
STATIC_GROUPS_MIN_BITS = 4


def static_groups_for(cfg: GPTQSolverConfig, perm: torch.Tensor) -> bool:
    """``cfg.static_groups``, with ``None`` (auto) resolved for the processing order ``perm``: dynamic
    when the order keeps the contiguous groups together (natural, GAR: no ``g_idx`` either way);
    where it scatters them (act, min-pivot), static from ``STATIC_GROUPS_MIN_BITS`` bits up, dynamic
    below (measured: at 3 bits a group fitted on the error-updated weights is worth its ``g_idx``)."""
    if cfg.static_groups is not None:
        return bool(cfg.static_groups)
    if groups_contiguous(perm, cfg.group_size):
        return False
    return cfg.bits >= STATIC_GROUPS_MIN_BITS


def quantize_gptq(weight, stats: LayerStats, cfg: GPTQSolverConfig) -> QuantResult:
    """GPTQ on ``cfg``'s integer grid, order and groups (the Hessian from the calibration)."""
    H = require_hessian(stats, "gptq")
    perm = processing_order(H, cfg)
    return gptq_quantize(
        weight,
        H,
        IntGrid(cfg.bits, cfg.sym),
        cfg.group_size,
        perm=perm,
        clip=cfg.clip,
        scale_method=cfg.scale,
        static_groups=static_groups_for(cfg, perm),
        block_size=cfg.block_size,
        percdamp=cfg.damp,
        dtype=HESSIAN_DTYPES[cfg.solver_dtype],
        overwrite_hessian=stats.hessian_disposable,
    )


# -- SmoothQuant smoothing before the weight solve: smoothquant, sq-weights, sq-acts -----------------
ALPHA_GRID = tuple(i / 20 for i in range(21))


@dataclass
class SmoothingConfig(GPTQSolverConfig):
    """SmoothQuant smoothing (alpha fixed or searched per group) before an RTN or GPTQ solve: the
    fields of the smoothing methods (each gives its own defaults)."""

    # the smoothing methods' own weight quantizer settings (SmoothQuant's RTN): not GPTQ's act-order +
    # MSE defaults, which would change their results and slow the alpha search tenfold
    scale: str = like(WeightQuantConfig, "scale", "minmax")
    order: str = shared("order", "natural")
    static_groups: bool | None = like(GPTQSolverConfig, "static_groups", False)  # the paper's (dynamic) GPTQ
    alpha: float | None = shared("alpha")
    alpha_grid: tuple[float, ...] = option(
        ALPHA_GRID, help="alpha values searched (comma list)", parse=parse_floats
    )
    solver: str = shared(
        "solver", "rtn", help="the weight quantizer after smoothing: rtn (the paper) | gptq",
        old_names=("weights",), deprecated=("--smooth-weights",),
    )  # fmt: skip
    max_tokens: int = shared("max_tokens")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.solver not in ("rtn", "gptq"):
            raise ValueError(f"smoothquant solver (weights) must be 'rtn' or 'gptq', got {self.solver!r}")
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1] (or None to search), got {self.alpha}")


def smoothing_transform(caps, cfg: SmoothingConfig, smooth: bool = True):
    """SmoothQuant's factors per foldable group: ``cfg.alpha``, or the alpha of ``cfg.alpha_grid``
    with the least output error after weight and activation quantization on the group's token
    sample (the group left unsmoothed where none beats no smoothing); ``smooth=False`` (a config's
    ``--no-smooth``) smooths no group."""
    if not smooth:
        return [(None, {"reason": "smoothing off"}) for _ in caps]
    qw, qx = weight_fake_quant(cfg), act_fake_quant(cfg.act)

    def factors(cap, weights):
        amax = cap.observer.channel_absmax
        if cfg.alpha is not None:
            return smooth_scales(amax, weights, cfg.alpha), {"alpha": cfg.alpha}
        res = search_alpha(cap.sample, amax, weights, qw, qx, cfg.alpha_grid)
        # Our decision (the paper has no search): keep the group unsmoothed when no alpha
        # beats it on the searched objective, so the search can never make a group worse.
        base = smoothing_loss(cap.sample, weights, torch.ones_like(res.scales), qw, qx, dtype=torch.float32)
        info = {"alpha": res.alpha, "loss": res.losses[res.alpha], "unsmoothed_loss": base}
        if base <= res.losses[res.alpha]:
            return None, {**info, "alpha": None}
        return res.scales, info

    return foldable_groups(caps, factors)
