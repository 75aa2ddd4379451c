"""Method ``sfmp``: SFMP (Nie et al.), search-free block-wise mixed precision.

Pipeline (§4.6): the Fisher diagonal ``S`` of every decoder linear is computed on the float model
(the pipeline's Fisher service: §4.1 Eqs. 1-2, App. C, Alg. 1) in the ``prepare`` hook;
:func:`sfmp_allocate` then
reorders rows/columns by salience (§4.4), cuts ``W̃`` into ``m_b x n_b`` blocks and makes ONE global
allocation of ``floor(b)``/``ceil(b)`` over all blocks of all decoder linears (§4.2-4.3, Alg. 2),
``b`` coming from ``avg_bits``, ``bpw`` or ``budget_mb`` with the measured overhead.  Each linear is
then quantized block by block at its widths:

* ``solver="awq"`` (the paper's choice, §5; an option): asymmetric, fp16 scale+zero per group; AWQ's scale
  search scores every candidate with each linear's own mixed-width *permuted* quantizer (min-max
  RTN at the block widths on ``W̃``) and the output-aware clip search runs per (row, group) at its
  block's width on ``W̃`` with the permuted Hessian.  AWQ's duo-scaling weight magnitude is taken
  over the original contiguous groups (it only shapes the candidate family, not the objective).
* ``solver="gptq"`` (our extension, the default since it gave lower perplexity than awq at all six
  budgets of ``benchmarks/results/sfmp.md``, by 5-69%): GPTQ on ``W̃`` in its natural order
  (= Fisher column order), each row's group at its block's width
  (:class:`~bitmosaic.algorithms.sfmp.MixedRowQuantizer`), dynamic group scales (MSE by default), no
  AWQ scaling.

Packed into :class:`~bitmosaic.modules.sfmp.SFMPLinear`.  The plans are the run's state
(:class:`SFMPState`), never written into the config; ``finalize`` folds the permutations between
gate/up and down_proj (exact).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..algorithms.awq import awq_search_scales
from ..algorithms.gptq import gptq_quantize
from ..algorithms.orders import act_order
from ..algorithms.sfmp import (
    BlockPlan,
    MixedRowQuantizer,
    allocate_bits,
    bits_from_budget,
    block_salience,
    group_bits,
    inverse_perm,
    mixed_clip_search,
    mixed_codes,
    mixed_fake_quant,
    mixed_scale_zero,
    permute,
    reorder_perms,
)
from ..errors import OptionError
from ..formats.grid import IntGrid
from ..formats.layout import default_g_idx, normalize_group_size
from ..modules.sfmp import SFMPLinear, SFMPResult
from ..modules.sfmp_model import fold_model_permutations
from .common import shared
from .options import option, parse_block, parse_none
from .registry import LayerStats, Method, MethodContext, WeightQuantConfig, register

__all__ = [
    "SFMP",
    "SFMPConfig",
    "SFMPState",
    "sfmp_allocate",
    "sfmp_budget",
    "quantize_sfmp",
    "plan_for",
    "sfmp_run_info",
]


@dataclass
class SFMPConfig(WeightQuantConfig):
    """SFMP settings.  Exactly one of ``avg_bits`` (code bits ``b``), ``bpw`` (total stored bits
    per weight) or ``budget_mb`` (MiB of the quantized linears) sets the budget."""

    unused: ClassVar[dict[str, str]] = dict.fromkeys(
        ("bits", "sym", "scale"), "sfmp takes --avg-bits/--bpw/--budget-mb and is always asymmetric"
    )

    avg_bits: float | None = option(
        None, help="budget: average code bits b (e.g. 2.75)", range=(1, 8), type=float
    )
    bpw: float | None = option(
        None, help="budget: total stored bits per weight (b + overhead)", range=(1, 16), type=float
    )
    budget_mb: float | None = option(
        None, help="budget: MiB of the stored quantized linears", range=(0, None), type=float
    )
    block_rows: int = option(
        512, help="block ROWSxCOLS (sfmp: m_b x n_b, COLS a multiple of the group; default 512xGROUP)",
        flag="--block", parse=parse_block, sets=("block_rows", "block_cols"),
    )  # fmt: skip
    block_cols: int | None = option(
        None, help="block columns n_b (set with --block ROWSxCOLS; default: the group size)", flag="--block",
        parse=parse_block, sets=("block_rows", "block_cols"),
    )  # fmt: skip
    row_reorder: bool = option(
        True, help="reorder rows by salience (--no-row-reorder keeps the natural order)"
    )
    col_reorder: bool = option(
        True, help="reorder columns by salience (--no-col-reorder keeps the natural order)"
    )
    rank: str = option(
        "mean", help="block ranking: mean (weight-count budget) or the paper's sum", choices=("mean", "sum")
    )
    # default gptq: lower perplexity than the paper's awq at all six budgets of benchmarks/results/sfmp.md
    solver: str = shared(
        "solver", "gptq", help="the solver inside each block: gptq (ours, the default: measured better at "
        "every budget) | awq (the paper's, Sec. 5)",
        choices=("awq", "gptq"), deprecated=("--sfmp-solver",),
    )  # fmt: skip
    n_grid: int = shared("n_grid")
    duo_scaling: bool = shared("duo_scaling")
    clip_search: bool = shared("clip_search")
    max_shrink: float = shared("max_shrink")
    max_tokens: int = shared("max_tokens")
    gptq_scale: str = option("mse", help="sfmp --solver gptq: group scale search", choices=("minmax", "mse"))
    # issue 73 item 6: with columns reordered, solving W̃ in its own order is also a solve in Fisher
    # order (akin to act-order); "act" fixes the solve order whatever the layout, so the reorder
    # ablation can tell the allocation's gain from GPTQ's order
    gptq_order: str = option(
        "layout", choices=("layout", "act"),
        help="sfmp --solver gptq: the columns' solve order: layout (W̃'s own order, dynamic groups; the "
        "default) or act (GPTQ's act-order, the same order for every layout, with the layout's groups "
        "fixed up front: static)",
    )  # fmt: skip
    damp: float = shared("damp")
    block_size: int = shared("block_size")
    fisher_samples: int | None = option(
        None,
        help="samples for the Fisher salience (default: every calibration sample)",
        range=(1, None),
        type=int,
    )
    fisher_cache: str | None = option(
        "auto", help="Fisher cache folder, auto (~/.cache/bitmosaic/fisher) or none", parse=parse_none
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sym:
            raise OptionError("sfmp is asymmetric (fp16 scale and zero per group); drop --sym")
        if self.solver != "gptq" and self.gptq_order != "layout":
            raise OptionError(
                f"sfmp --gptq-order {self.gptq_order} orders GPTQ's solve: it needs --solver gptq "
                f"(got {self.solver!r})"
            )
        given = [k for k in ("avg_bits", "bpw", "budget_mb") if getattr(self, k) is not None]
        if len(given) != 1:  # checked here: before minutes of Fisher salience, not after
            raise OptionError(
                "sfmp needs exactly one budget: --avg-bits B, --bpw X or --budget-mb M "
                f"(avg_bits=, bpw=, budget_mb=); got {', '.join(given) or 'none'}"
            )
        if self.solver not in ("awq", "gptq"):
            raise OptionError(f"sfmp solver must be 'awq' or 'gptq', got {self.solver!r}")
        if self.rank not in ("mean", "sum"):
            raise OptionError(f"sfmp rank must be 'mean' or 'sum', got {self.rank!r}")
        if self.block_rows < 1:
            raise OptionError(f"block rows (m_b) must be >= 1, got {self.block_rows}")
        g = self.group_size
        if g is not None and self.block_cols is not None and self.block_cols % g:
            raise OptionError(
                f"block columns n_b={self.block_cols} must be a multiple of the group size {g} "
                "(each group has one width); use --block MbxNb with Nb a multiple of --group-size"
            )

    def to_dict(self) -> dict:
        """The settings, without the unused ``bits``/``scale`` (a saved ``"bits": 4`` misread a
        mixed-width model)."""
        skip = ("bits", "scale")
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        d["act"] = None if self.act is None else dataclasses.asdict(self.act)
        return d

    @property
    def scheme(self) -> str:
        what = next(
            (f"{k}={v}" for k, v in (("b", self.avg_bits), ("bpw", self.bpw), ("MiB", self.budget_mb)) if v),
            "unset",
        )
        return f"SFMP({self.solver}, {what})"


def _plan_shape(cfg: SFMPConfig, K: int) -> tuple[int, int]:
    g = normalize_group_size(cfg.group_size, K)
    nb = cfg.block_cols or g
    if nb >= K:  # one (partial) column block: round up to whole groups
        return g, -(-K // g) * g
    if nb % g:
        raise OptionError(f"block columns {nb} are not a multiple of the group size {g}")
    return g, nb


@dataclass
class SFMPState:
    """The run state of SFMP: one :class:`BlockPlan` per qualified linear name."""

    plans: dict[str, BlockPlan] = field(default_factory=dict)


def _plan(cfg: SFMPConfig, N: int, K: int, rp, cp) -> BlockPlan:
    g, nb = _plan_shape(cfg, K)
    return BlockPlan(N, K, min(cfg.block_rows, N), nb, g, rp, cp)


def _budget(plans: dict[str, BlockPlan], cfg: SFMPConfig) -> dict:
    return bits_from_budget(plans, avg_bits=cfg.avg_bits, bpw=cfg.bpw, budget_mb=cfg.budget_mb)


def sfmp_budget(shapes: dict[str, tuple[int, int]], cfg: SFMPConfig) -> dict:
    """The average code bits ``b`` that ``cfg``'s budget gives on linears of ``shapes``
    (``{name: (out, in)}``), with the overhead of ``cfg``'s layout measured (§4.2: fp16 scale+zero
    per row and group, the permutation indices of the reordered directions, the bit map), as
    :func:`sfmp_allocate` computes it -- without a Fisher salience: the overhead depends on the
    shapes, the group, the blocks and which directions are reordered, not on the orders themselves.
    ``{"b", "overhead_bpw", "weights"}``.  E.g. the ``b`` of ``bpw=3.27`` with rows and columns
    reordered, to give other layouts the same code bits (``avg_bits=b``)."""
    plans = {}
    for n, (N, K) in shapes.items():
        rp = torch.arange(N) if cfg.row_reorder else None
        plans[n] = _plan(cfg, N, K, rp, torch.arange(K) if cfg.col_reorder else None)
    return _budget(plans, cfg)


def sfmp_allocate(saliences: dict[str, torch.Tensor], cfg: SFMPConfig) -> tuple[SFMPState, dict]:
    """Plans for every linear named in ``saliences`` (their Fisher diagonals ``[out, in]``, original
    order): permutations (Eq. 12), blocks, the budget's ``b`` and ONE global allocation (Eq. 10).
    Returns the state (the plans) and the allocation summary.

    With ``avg_bits`` (the equal-code-bits budget) ``b`` counts the codes only: the overhead
    (scales, permutations, bit map) is reported beside it (``overhead_bpw``, ``bpw_target``), so
    layouts with and without reordering or with other blocks get the same code bits; the allocation
    reaches ``b_reached <= b``, short of it by less than one block."""
    plans, sums = {}, {}
    for name, S in saliences.items():
        N, K = S.shape
        rp, cp = reorder_perms(S, cfg.row_reorder, cfg.col_reorder)
        plans[name] = _plan(cfg, N, K, rp, cp)
        sums[name] = block_salience(
            permute(S.float(), rp, cp), plans[name].block_rows, plans[name].block_cols
        )
    budget = _budget(plans, cfg)
    alloc = allocate_bits(sums, plans, budget["b"], cfg.rank)
    per_linear = {n: p.average_bits() for n, p in plans.items()}
    summary = {**budget, **alloc, "bpw_target": budget["b"] + budget["overhead_bpw"]}
    summary["per_linear"] = per_linear
    return SFMPState(plans), summary


def plan_for(state: SFMPState | None, name: str | None) -> BlockPlan:
    if state is None or name is None or name not in state.plans:
        raise OptionError(
            f"sfmp has no allocation for linear {name!r}: it must run through the calibration pipeline, "
            "which computes the Fisher salience and the global bit allocation first"
        )
    return state.plans[name]


def _permuted_quantizer(plan: BlockPlan):
    """``W -> Q(W)`` in the original order: permute, min-max RTN at the block widths, un-permute."""
    gb = group_bits(plan)
    rinv = None if plan.row_perm is None else inverse_perm(plan.row_perm)
    cinv = None if plan.col_perm is None else inverse_perm(plan.col_perm)

    def q(W: torch.Tensor) -> torch.Tensor:
        Wt = permute(W, plan.row_perm, plan.col_perm)
        return permute(mixed_fake_quant(Wt, gb.to(W.device), plan.group_size), rinv, cinv)

    return q


def sfmp_transform(caps, cfg: SFMPConfig, state: SFMPState):
    """AWQ's scale search with each linear's own mixed-width permuted quantizer (solver awq)."""
    out = []
    for cap in caps:
        if cfg.solver != "awq" or not cap.foldable:
            out.append(
                (None, {"reason": "gptq solver" if cfg.solver != "awq" else "no foldable preceding op"})
            )
            continue
        names = list(cap.names)
        qs = [_permuted_quantizer(plan_for(state, f"{cap.prefix}.{n}")) for n in names]
        res = awq_search_scales(
            cap.observer.channel_absmean,
            [cap.weights[n] for n in names],
            cap.hessian,
            qs,
            n_grid=cfg.n_grid,
            duo_scaling=cfg.duo_scaling,
            group_size=cfg.group_size,
        )
        gain = 1.0 - min(res.losses.values(), default=res.identity_loss) / max(res.identity_loss, 1e-30)
        out.append(((None if res.ratio is None else res.scales), {"ratio": res.ratio, "loss_gain": gain}))
    return out


def quantize_sfmp(weight, stats: LayerStats, cfg: SFMPConfig, plan: BlockPlan) -> SFMPResult:
    """One linear at its plan's block widths (the plan from :func:`sfmp_allocate`)."""
    W = weight.float()
    if stats.hessian is None:
        raise OptionError("sfmp needs calibration Hessians; run it through the calibration pipeline")
    H = stats.hessian.float().to(W.device)
    rp, cp = plan.row_perm, plan.col_perm
    Wt = permute(W, rp, cp)
    Ht = H if cp is None else H.index_select(0, cp.to(H.device)).index_select(1, cp.to(H.device))
    gb = group_bits(plan).to(W.device)
    gs = plan.group_size
    if cfg.solver == "awq":
        if cfg.clip_search:
            scales, zeros = mixed_clip_search(Wt, Ht, gb, gs, cfg.n_grid, cfg.max_shrink)
        else:
            scales, zeros = mixed_scale_zero(Wt, gb, gs)
        scales, zeros = scales.to(W.dtype), zeros.to(W.dtype)
        codes_t = mixed_codes(Wt, scales, zeros, gb, gs)
    else:  # "act": act-order on the permuted Hessian, i.e. the same columns' order for every layout
        solve = act_order(Ht) if cfg.gptq_order == "act" else None
        r = gptq_quantize(
            Wt, Ht, IntGrid(8), gs, quantizer=MixedRowQuantizer(gb, cfg.gptq_scale), perm=solve,
            static_groups=solve is not None, block_size=cfg.block_size, percdamp=cfg.damp,
        )  # fmt: skip
        codes_t, scales, zeros = r.codes, r.scales, r.zeros
    rinv = None if rp is None else inverse_perm(rp)
    codes = permute(codes_t, rinv, None if cp is None else inverse_perm(cp)).to(torch.int32)
    if rinv is not None:
        scales, zeros = (
            scales.index_select(0, rinv.to(scales.device)),
            zeros.index_select(0, rinv.to(zeros.device)),
        )
    g_idx = default_g_idx(W.shape[1], gs, device=W.device)
    if cp is not None:
        g_idx = g_idx[inverse_perm(cp).to(W.device)]
    info = {"code_bits": plan.average_bits(), "solver": cfg.solver}
    return SFMPResult(codes, scales, zeros, g_idx, plan=plan, info=info)


def sfmp_run_info(report) -> dict:
    """What an SFMP run *asked for and planned* (from its run report): the budget given (``avg_bits`` /
    ``bpw`` / ``budget_mb``), the target ``b`` it gave, the measured overhead, the candidate widths
    ``floor(b)``/``ceil(b)``, the configured group and block, the reordering, solver, rank and the
    Fisher salience's cost.  ``{}`` for a run without an allocation."""
    alloc = report.calibration.get("allocation")
    if not alloc:
        return {}
    cfg = report.config
    keys = ("avg_bits", "bpw", "budget_mb")
    fisher = {k: alloc.get("fisher", {}).get(k) for k in ("seconds", "samples", "cached", "given")}
    return {
        "budget": {k: cfg.get(k) for k in keys if cfg.get(k) is not None},
        "b_target": alloc["b"],
        "bpw_target": alloc["bpw_target"],
        "overhead_bpw": alloc["overhead_bpw"],
        "candidate_widths": sorted({alloc["low"], alloc["high"]}),
        "b_planned": alloc["b_reached"],
        "group_size": cfg.get("group_size"),
        "block": [cfg.get("block_rows"), cfg.get("block_cols") or cfg.get("group_size")],
        **{k: cfg.get(k) for k in ("row_reorder", "col_reorder", "solver", "rank", "gptq_order")},
        "fisher": {k: v for k, v in fisher.items() if v is not None},
    }


@register
class SFMP(Method):
    name, config_cls = "sfmp", SFMPConfig
    description = "SFMP: Fisher-salience block-wise mixed precision, row/col reordering, AWQ or GPTQ"
    # a precomputed Fisher diagonal per linear, or the tokens to estimate it from instead of calib
    prepare_inputs: ClassVar[tuple[str, ...]] = ("salience", "salience_tokens")

    def prepare(self, model, cfg: SFMPConfig, ctx: MethodContext) -> SFMPState:
        """Fisher salience of every decoder linear on the *float* model (before any AWQ scaling), the
        first ``fisher_samples`` samples, then ONE global allocation (§4.6)."""
        salience, info = ctx.fisher(
            ctx.names,
            given=ctx.inputs.get("salience"),
            tokens=ctx.inputs.get("salience_tokens"),
            samples=cfg.fisher_samples,
            cache=cfg.fisher_cache,
        )
        state, summary = sfmp_allocate(salience, cfg)
        summary["fisher"] = info
        ctx.record("allocation", summary)
        return state

    def transform(self, caps, cfg: SFMPConfig, state: SFMPState):
        return sfmp_transform(caps, cfg, state)

    def quantize(self, weight, stats: LayerStats, cfg: SFMPConfig, state=None, name=None) -> SFMPResult:
        return quantize_sfmp(weight, stats, cfg, plan_for(state, name))

    def pack(self, res: SFMPResult, cfg, bias):
        return SFMPLinear.from_result(res, bias=bias)

    def finalize(self, model, cfg: SFMPConfig, state: SFMPState, ctx: MethodContext) -> None:
        ctx.record("permutations_folded", fold_model_permutations(model, ctx.arch))

    def saved_info(self, report) -> dict:
        return {"sfmp": sfmp_run_info(report)}

    def summary_lines(self, report) -> list[str]:
        alloc = report.calibration.get("allocation")
        if not alloc:
            return []
        fisher = alloc["fisher"]
        return [
            f"sfmp: b target {alloc['b']:.4f}, reached {alloc['b_reached']:.4f} "
            f"({alloc['low']}/{alloc['high']} bits), "
            f"overhead {alloc['overhead_bpw']:.4f} BPW, Fisher {fisher.get('seconds', 0):.1f}s"
            f"{' (cached)' if fisher.get('cached') else ''}"
        ]
