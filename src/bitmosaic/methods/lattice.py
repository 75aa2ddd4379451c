"""Methods ``ssqr``, ``hptq`` and ``hrtn`` (Babai paper §5): no-clip quantizers whose overflow is
kept exactly, as sparse outliers (SSQR) or inside a Huffman-coded unbounded integer grid (HPTQ,
HRTN).  The math is in :mod:`bitmosaic.algorithms.lattice`."""

from __future__ import annotations

from dataclasses import dataclass

from ..algorithms.lattice import entropy_coded_quantize, ssqr_quantize
from ..models.qmodules import HuffmanQuantLinear, SparseOutlierQuantLinear
from .gptq import _processing_order, _require_hessian
from .registry import LayerStats, WeightQuantConfig, register_method


@dataclass
class SSQRConfig(WeightQuantConfig):
    outlier_rate: float = 0.01
    order: str = "act"  # the paper's experiments use act-order for every method
    direction: str = "front"
    percdamp: float = 0.01
    scale_method: str = "mse"  # SSQR initialises its scales with the MSE search (fixed)


def _pack_ssqr(res, cfg: SSQRConfig, bias):
    return SparseOutlierQuantLinear.from_result(
        res, bits=cfg.bits, group_size=cfg.group_size, symmetric=cfg.symmetric, bias=bias
    )


@register_method(
    "ssqr", SSQRConfig, description="no-clip GPTQ + exact sparse outliers (SSQR)", pack=_pack_ssqr
)
def quantize_ssqr(weight, stats: LayerStats, cfg: SSQRConfig):
    H = _require_hessian(stats, "ssqr")
    return ssqr_quantize(
        weight,
        H,
        cfg.bits,
        cfg.group_size,
        cfg.outlier_rate,
        perm=_processing_order(H, cfg),
        symmetric=cfg.symmetric,
        percdamp=cfg.percdamp,
    )


@dataclass
class EntropyConfig(WeightQuantConfig):
    """``target_bits`` is the goal for the measured Huffman-coded size; ``bits`` is unused."""

    target_bits: float = 3.125
    scale_per: str = "matrix"  # "matrix" | "row"
    order: str = "act"
    direction: str = "front"
    percdamp: float = 0.01
    group_size: int | None = None  # one scale per matrix/row: no groups


def _pack_huffman(res, cfg, bias):
    return HuffmanQuantLinear.from_result(res, bias=bias)


@register_method(
    "hptq",
    EntropyConfig,
    description="no-clip GPTQ, one scale, Huffman-coded ints (HPTQ)",
    pack=_pack_huffman,
)
def quantize_hptq(weight, stats: LayerStats, cfg: EntropyConfig):
    H = _require_hessian(stats, "hptq")
    return entropy_coded_quantize(
        weight,
        H,
        cfg.target_bits,
        scale_per=cfg.scale_per,
        use_gptq=True,
        perm=_processing_order(H, cfg),
        percdamp=cfg.percdamp,
    )


@register_method(
    "hrtn",
    EntropyConfig,
    needs_hessian=False,
    description="RTN, one scale, Huffman-coded ints (HRTN)",
    pack=_pack_huffman,
)
def quantize_hrtn(weight, stats: LayerStats, cfg: EntropyConfig):
    return entropy_coded_quantize(weight, None, cfg.target_bits, scale_per=cfg.scale_per, use_gptq=False)
