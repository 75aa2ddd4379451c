"""Method ``gptq``: GPTQ (OPTQ, Frantar et al.) on an integer grid, with processing orders, static or
dynamic groups and clip/no-clip.

GPTQ is Babai's nearest plane algorithm on the Hessian lattice, run in the opposite order (Babai
paper §4, Theorem 4; method ``babai``), and ``order="min-pivot"`` is that paper's min-pivot order
(§4, Algorithm 3).  The solve (:func:`~.common.quantize_gptq`) and its fields
(:class:`~.common.GPTQSolverConfig`) are shared with the methods that run a GPTQ solve after
smoothing; this file holds GPTQ's own defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..algorithms.mx import mx_gptq
from ..algorithms.types import QuantResult
from .common import HESSIAN_DTYPES, GPTQSolverConfig, processing_order, quantize_gptq, require_hessian, shared
from .microscale import SPLIT_ROWS, STACK_ROWS, is_mx, mx_post_init
from .options import like
from .registry import LayerStats, Method, WeightQuantConfig, register

__all__ = ["GPTQ", "GPTQConfig"]


@dataclass
class GPTQConfig(GPTQSolverConfig):
    """GPTQ settings.  Defaults: act-order (``diag(H)`` descending) with MSE group scales; groups are
    *auto*: static at 4 bits and more, dynamic at 2 and 3 (the better setting at each width in the
    verdict protocol on SmolLM2, ``benchmarks/results/static_groups*.md``: static 0.995x/0.986x
    dynamic's perplexity at 4 bits on two seeds, 1.045x/1.022x at 3 bits, within noise at 2), so the
    default ``--method gptq --bits 4`` result has no ``g_idx`` and every export format holds it exactly.
    ``order="natural"`` and ``scale="minmax"`` give the original GPTQ.  ``static_groups`` (fixed
    scales from the original weights, fitted when reached, or auto) and ``solver_dtype``: see
    :class:`~.common.GPTQSolverConfig`; auto resolves in :func:`~.common.static_groups_for`."""

    scale: str = like(WeightQuantConfig, "scale", "mse")
    wfmt: str = shared("wfmt")
    mx_rule: str = shared("mx_rule")

    def __post_init__(self) -> None:
        super().__post_init__()
        mx_post_init(self)

    stack_rows, split_rows = STACK_ROWS, SPLIT_ROWS


@register
class GPTQ(Method):
    name, config_cls, row_separable = "gptq", GPTQConfig, True
    may_overwrite_hessian = True
    description = "GPTQ (OPTQ) with orders, groups, clip/no-clip"

    def quantize(self, weight, stats: LayerStats, cfg: GPTQConfig, state=None, name=None) -> QuantResult:
        if is_mx(cfg):  # error feedback over the element grid, block scales fixed first (algorithms/mx.py)
            H = require_hessian(stats, "gptq")
            return mx_gptq(
                weight, H, cfg.wfmt, method=cfg.scale, rule=cfg.mx_rule, perm=processing_order(H, cfg),
                block_size=cfg.block_size, percdamp=cfg.damp, dtype=HESSIAN_DTYPES[cfg.solver_dtype],
                overwrite_hessian=stats.hessian_disposable,
            )  # fmt: skip
        return quantize_gptq(weight, stats, cfg)
