"""Method ``smoothquant`` (Xiao et al., 2023, §4 Eq. 4): per-channel factors folded into the preceding
ops, then weight quantization.

``s_j = max|X_j|^α / max|W_j|^(1-α)``, α fixed (0.5, the paper's default) or searched per group on a
grid to minimise the group's output error after weight *and* activation quantization on a token
sample.  The weights are then quantized with RTN (the paper's setting) or GPTQ (``solver="gptq"``,
the combination SQ-format and MosaicQuant use).  The smoothing fields and transform are shared with
the SQ-format methods (:class:`~.common.SmoothingConfig`, :func:`~.common.smoothing_transform`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..algorithms.rtn import rtn_quantize
from ..algorithms.types import QuantResult
from ..formats.grid import IntGrid
from .common import SmoothingConfig, quantize_gptq, smoothing_transform
from .registry import LayerStats, Method, register

__all__ = ["SmoothQuant", "SmoothQuantConfig", "quantize_smoothquant"]


@dataclass
class SmoothQuantConfig(SmoothingConfig):
    """SmoothQuant settings: the smoothing fields with their defaults (α 0.5, RTN with min-max scales
    in natural order; with ``solver="gptq"``, the paper's dynamic groups)."""


def quantize_smoothquant(weight, stats: LayerStats, cfg: SmoothQuantConfig) -> QuantResult:
    if cfg.solver == "gptq":
        return quantize_gptq(weight, stats, cfg)
    return rtn_quantize(weight, IntGrid(cfg.bits, cfg.sym), cfg.group_size, cfg.scale, cfg.clip)


@register
class SmoothQuant(Method):
    name, config_cls = "smoothquant", SmoothQuantConfig
    description = "SmoothQuant: migrate activation outliers into weights (alpha fixed/searched), RTN or GPTQ"

    def quantize(self, weight, stats, cfg, state=None, name=None):
        return quantize_smoothquant(weight, stats, cfg)

    def transform(self, caps, cfg, state):
        return smoothing_transform(caps, cfg)
