"""Method ``mosaic``: MosaicQuant (dense 4-bit base + sparse 4-bit residual blocks chosen by the
Δ-Hessian score), after SmoothQuant smoothing with a per-layer α search.

- Smoothing (Eq. 3, App. C.1): ``s_j = max|X_j|^α / max|W_j|^(1-α)``, shared across q/k/v and
  across gate/up and folded as :mod:`bitmosaic.pipeline.smoothing` does (norms, ``v_proj``,
  ``up_proj``).  The paper "fully migrates the outliers" of every linear (§1, Eq. 3); under
  grouped-query attention (SmolLM2, Llama 3, Qwen, Gemma 3) ``o_proj``'s input channel ``h·d + j``
  averages ``v_proj`` row ``(h // rep)·d + j``, so ``o_proj`` gets one factor per ``v_proj`` row,
  shared by the query heads of its key-value head (the formula on the merged channel: the largest
  ``max|X|`` and ``max|W|`` over the heads), folded into that row (issue 73).  ``fold_o_proj=False``
  leaves ``o_proj`` unsmoothed under GQA (the behaviour before issue 73).
- α per layer and group: the grid ``alpha_grid`` (default 0.3..1.0, including full migration) is
  searched for the smallest output MSE on a token sample of the float layer's inputs
  ``Σ_i ||X W_iᵀ - Q_x(X / s) Ŵ_i(s)ᵀ||²`` where ``Ŵ_i(s)`` is the full MosaicQuant weight of
  ``W_i · diag(s)`` (Δ-Hessian scores from the smoothed input's ``H_jj / s_j²``) and ``Q_x`` the
  activation quantizer: the objective the paper states (a weight-only objective drives α to 0).
  ``search_budget`` (default: ``budget``) is the residual budget used inside the search, so the
  "no sparse branch, α kept from the full method" ablation is ``budget_frac=0, search_budget=0.1``.
  ``try_no_smooth`` adds ``s = 1`` (no smoothing) as a candidate (issue 25: for down_proj a better α or
  none lowered the output error by 9-20%); where it wins the group is left unsmoothed.
- Each linear (in true-sequential order, on inputs from the already quantized earlier groups):
  :func:`~bitmosaic.algorithms.mosaic.mosaic_decompose` with ``H`` the Hessian of its float
  (smoothed) inputs, packed as :class:`~bitmosaic.modules.mosaic.MosaicQuantLinear`.
- Activations (App. C.1): W4A8 = per-token dynamic INT8; W4A4 = per-group (128, partial last group)
  symmetric INT4 -- a per-token INT4 spec (what ``--scheme W4A4`` parses to) is turned into
  per-group ``a4_group`` unless ``a4_per_group=False``.  The block K-width must divide the
  activation group so each block sees one activation scale per token.
- ``solver="gptq"`` (our extension, not in the paper): the blocks and their compensation chosen on the
  round-to-nearest base as above, then GPTQ on the same absmax grid solves the dense base for ``W``
  less the compensation (:func:`~bitmosaic.algorithms.mosaic.mosaic_decompose_gptq`; the form before
  issue 73, GPTQ first and the residual after, undid GPTQ's error feedback on the chosen blocks).
- Channel baselines (§3 Observation 1, Fig. 5): ``selection="channel-act"`` compensates the outlier
  input channels by the float input's ``max|X_j|`` (the pipeline observes the smoothed input
  ``X / s``, so the maximum is taken times the folded ``s``: the ranking of the unsmoothed
  activations), ``channel`` the columns of largest summed Δ-Hessian (ours); both store the
  residual as dense columns (:mod:`bitmosaic.algorithms.mosaic`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..algorithms.mosaic import SELECTIONS, mosaic_decompose, mosaic_decompose_gptq, parse_block
from ..algorithms.smooth import smooth_scales, smoothing_loss
from ..errors import OptionError
from ..modules.mosaic import MosaicQuantLinear
from .common import act_fake_quant, foldable_groups, shared
from .options import like, option, parse_block_text, parse_floats
from .registry import LayerStats, Method, WeightQuantConfig, register

__all__ = ["MosaicConfig", "mosaic_weight"]

ALPHA_GRID = tuple(round(0.3 + 0.1 * i, 2) for i in range(8))


@dataclass
class MosaicConfig(WeightQuantConfig):
    unused: ClassVar[dict[str, str]] = dict.fromkeys(
        ("group_size", "sym", "scale"),
        "its dense base is 4-bit symmetric per-channel absmax (MosaicQuant Eq. 1-2)",
    )

    bits: int = like(WeightQuantConfig, "bits", 4)
    group_size: int | None = like(WeightQuantConfig, "group_size", None)
    sym: bool = like(WeightQuantConfig, "sym", True)
    budget_frac: float = option(
        0.1, help="fraction of weight blocks given a sparse 4-bit residual", range=(0, 1),
        old_names=("budget",), deprecated=("--budget",),
    )  # fmt: skip
    block: str = option("64x64", help="residual block ROWSxCOLS", parse=parse_block_text)
    selection: str = option(
        "delta-hessian", help="block selection (the others are ablations)", choices=SELECTIONS
    )
    solver: str = shared(
        "solver", "rtn", help="the dense base: rtn (the paper's absmax) | gptq (ours)",
        choices=("rtn", "gptq"), old_names=("base",), deprecated=("--mosaic-base",),
    )  # fmt: skip
    clip_search: bool = shared("clip_search", False, help="clip search for the dense base")
    alpha: float | None = shared("alpha", None)  # None: search per layer and group
    alpha_grid: tuple[float, ...] = option(
        ALPHA_GRID, help="alpha values searched (comma list)", parse=parse_floats
    )
    smooth: bool = shared("smooth")
    fold_o_proj: bool = option(
        True, help="under grouped-query attention smooth o_proj too, with factors shared by the query heads "
        "of each key-value head folded into v_proj (the paper migrates every linear); off: o_proj unsmoothed",
    )  # fmt: skip
    try_no_smooth: bool = option(
        False, help="the alpha search also tries no smoothing (s = 1) and keeps it where its loss is lowest"
    )
    search_budget: float | None = option(
        None,
        help="residual budget inside the alpha search (default: --budget-frac)",
        range=(0, 1),
        type=float,
    )
    max_tokens: int = shared("max_tokens", 1024)
    a4_per_group: bool = option(
        True, help="W4A4: per-group (--a4-group) INT4 activations instead of per-token"
    )
    a4_group: int = option(128, help="W4A4 activation group", range=(1, None))
    damp: float = shared("damp")  # GPTQ base only
    selection_seed: int = option(0, help="seed of --selection random", old_names=("seed",))

    @property
    def needs_act_stats(self) -> bool:
        """The pipeline observes the inputs' per-channel maxima (``selection="channel-act"``)."""
        return self.selection == "channel-act"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bits != 4 or self.group_size is not None or not self.sym:
            raise OptionError(
                "mosaic quantizes weights to 4 bits, symmetric, per channel (use --scheme W4A4|W4A8)"
            )
        if isinstance(self.block, (tuple, list)):
            self.block = "x".join(str(int(b)) for b in self.block)
        bm, bk = parse_block(self.block)
        if self.selection not in SELECTIONS:
            raise OptionError(f"mosaic selection must be one of {SELECTIONS}, got {self.selection!r}")
        if self.solver not in ("rtn", "gptq"):
            raise OptionError(f"mosaic solver (dense base) must be 'rtn' or 'gptq', got {self.solver!r}")
        for name in ("budget_frac", "search_budget"):
            v = getattr(self, name)
            if v is not None and not 0.0 <= v <= 1.0:
                raise OptionError(f"mosaic {name} must be a fraction in [0, 1], got {v}")
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise OptionError(f"alpha must be in [0, 1] (or None to search), got {self.alpha}")
        act = self.act
        if (
            act is not None
            and self.a4_per_group
            and act.fmt == "int"
            and act.bits == 4
            and act.granularity == "token"
        ):
            self.act = act = dataclasses.replace(act, granularity="group", group_size=self.a4_group)
        if act is not None and act.granularity == "group" and act.group_size % bk:
            raise OptionError(
                f"block K-width {bk} must divide the activation group {act.group_size} so each block "
                "sees one activation scale; use a block like 64x64 or 32x32"
            )


def mosaic_weight(
    W: torch.Tensor, H: torch.Tensor | None, cfg: MosaicConfig, budget: float | None = None, report=True,
    act_amax: torch.Tensor | None = None,
):  # fmt: skip
    """The full MosaicQuant result of one (smoothed) weight under ``cfg`` (``act_amax``: the float
    input's ``max|X_j|``, for ``selection="channel-act"``): the paper's round-to-nearest base, or
    (``solver="gptq"``) GPTQ solving the base around the residual branch
    (:func:`~bitmosaic.algorithms.mosaic.mosaic_decompose_gptq`)."""
    chosen = dict(budget=cfg.budget_frac if budget is None else budget, block=cfg.block,
                  selection=cfg.selection, seed=cfg.selection_seed, act_amax=act_amax)  # fmt: skip
    if cfg.solver == "gptq":
        if H is None:
            raise OptionError("mosaic solver='gptq' needs a Hessian")
        return mosaic_decompose_gptq(
            W, H, damp=cfg.damp, clip_search=cfg.clip_search, report=report, **chosen
        )
    return mosaic_decompose(W, H, clip_search=cfg.clip_search, report=report, **chosen)


def mosaic_transform(caps, cfg: MosaicConfig):
    qx = act_fake_quant(cfg.act)
    budget = cfg.budget_frac if cfg.search_budget is None else cfg.search_budget

    def factors(cap, weights):
        amax = cap.observer.channel_absmax
        tie = None if cap.foldable else cap.tie  # GQA o_proj: one factor per v_proj row
        if not cfg.smooth:
            return None, {"alpha": None, "reason": "smoothing off"}
        shared_by = {} if tie is None else {"shared_by_heads": True}
        if cfg.alpha is not None:
            return smooth_scales(amax, weights, cfg.alpha, tie=tie), {"alpha": cfg.alpha, **shared_by}
        # the search runs where the weights are (the run's device); the token sample and the channel
        # statistics may have been kept on the CPU: move them there, and give the scales back beside amax
        dev = weights[0].device
        X = cap.sample.to(dev, torch.float32)
        H = cap.hessian.to(dev, torch.float32)
        amax_d = amax.to(dev)
        ref = [X @ W.float().T for W in weights]
        best = (None, float("inf"), None)
        losses = {}
        candidates = [
            (float(a), smooth_scales(amax_d, weights, float(a), tie=tie).float()) for a in cfg.alpha_grid
        ]
        if cfg.try_no_smooth:  # s = 1: the layer as it is
            candidates.append((None, torch.ones_like(amax_d, dtype=torch.float32)))
        for a, s in candidates:
            Hs = H / (s[:, None] * s[None, :])

            def qw(Wt, Hs=Hs):
                res = mosaic_weight(Wt, Hs, cfg, budget, report=False, act_amax=amax_d)
                return res.dequantize(torch.float32)

            loss = smoothing_loss(X, weights, s, qw, qx, dtype=torch.float32, reference=ref)
            losses["none" if a is None else a] = loss
            if loss < best[1]:
                best = (a, loss, s)
        if best[0] is None and best[2] is not None:  # no smoothing (s = 1) won
            return None, {"alpha": None, "reason": "no smoothing had the lowest loss", "loss": best[1],
                          "losses": losses}  # fmt: skip
        return best[2].to(amax.device), {"alpha": best[0], "loss": best[1], "losses": losses, **shared_by}

    return foldable_groups(caps, factors, tied=cfg.fold_o_proj)


def quantize_mosaic(weight, stats: LayerStats, cfg: MosaicConfig):
    if stats.hessian is None:
        raise OptionError("mosaic needs calibration statistics (a Hessian)")
    amax = None
    if cfg.selection == "channel-act":
        if stats.act is None:
            raise OptionError("mosaic selection 'channel-act' needs the inputs' channel maxima (calibration)")
        amax = stats.act.channel_absmax.float()
        if stats.input_scales is not None:  # the observer saw X / s: max|X_j| = max|X_j / s_j| * s_j
            amax = amax * stats.input_scales.float().to(amax.device)
    return mosaic_weight(weight, stats.hessian, cfg, act_amax=amax)


@register
class MosaicQuant(Method):
    name, config_cls = "mosaic", MosaicConfig
    description = "MosaicQuant: dense 4-bit base + Δ-Hessian-selected sparse 4-bit residual blocks"

    def quantize(self, weight, stats, cfg, state=None, name=None):
        return quantize_mosaic(weight, stats, cfg)

    def pack(self, res, cfg, bias):
        return MosaicQuantLinear.from_result(res, bias=bias)

    def transform(self, caps, cfg, state):
        return mosaic_transform(caps, cfg)
