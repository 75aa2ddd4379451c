"""Methods ``ssqr``, ``hptq`` and ``hrtn`` (Babai paper §5): no-clip quantizers whose overflow is
kept exactly, as sparse outliers (SSQR) or inside a Huffman-coded unbounded integer grid (HPTQ,
HRTN).  The math is in :mod:`bitmosaic.algorithms.lattice`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..algorithms.lattice import SSQR_GROUPS, entropy_coded_quantize, ssqr_quantize
from ..errors import OptionError
from ..modules.qmodules import HuffmanQuantLinear, SparseOutlierQuantLinear
from .common import processing_order, require_hessian, shared
from .options import like, option
from .registry import LayerStats, Method, WeightQuantConfig, register


@dataclass
class SSQRConfig(WeightQuantConfig):
    outlier_rate: float = option(0.01, help="target density of the exact sparse outliers", range=(0, 0.5))
    order: str = shared("order")  # the paper's experiments use act-order for every method
    direction: str = shared("direction")
    damp: float = shared("damp")
    scale: str = like(WeightQuantConfig, "scale", "mse")  # SSQR starts from MSE scales (fixed)
    # "static": the paper's contiguous groups fitted before GPTQ (Algorithm 9), the default;
    # "dynamic": GPTQ's act-order dynamic groups x the global multiplier (the grouping and scales
    # of the GPTQ baseline).  Measured on SmolLM2 w3 g128 1% outliers (benchmarks/lattice/ssqr_groups.py,
    # 32x512 calibration, 40 windows; commit e41d56e): static 57.55 ppl at 3.62 bpw, dynamic 58.80
    # at 3.67, so the paper's variant stays the default; GPTQ act+MSE g64 gives 47.28 at 3.55 bpw.
    groups: str = option(
        "static", help="static: the paper's groups fitted before GPTQ; dynamic: GPTQ's act-order groups",
        choices=SSQR_GROUPS, deprecated=("--ssqr-groups",),
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scale != "mse":
            raise OptionError(
                f"ssqr: scale={self.scale!r} is not used: SSQR always starts from MSE "
                "scales (Babai paper §5); drop --scale or pass --scale mse"
            )
        if not 0 < self.outlier_rate < 0.5:
            raise OptionError(f"ssqr: outlier_rate must be in (0, 0.5), got {self.outlier_rate}")
        if self.groups not in SSQR_GROUPS:
            raise OptionError(f"ssqr: groups must be one of {SSQR_GROUPS}, got {self.groups!r}")


def _pack_ssqr(res, cfg: SSQRConfig, bias):
    return SparseOutlierQuantLinear.from_result(
        res, bits=cfg.bits, group_size=cfg.group_size, symmetric=cfg.sym, bias=bias
    )


def quantize_ssqr(weight, stats: LayerStats, cfg: SSQRConfig):
    H = require_hessian(stats, "ssqr")
    return ssqr_quantize(
        weight,
        H,
        cfg.bits,
        cfg.group_size,
        cfg.outlier_rate,
        perm=processing_order(H, cfg),
        symmetric=cfg.sym,
        percdamp=cfg.damp,
        groups=cfg.groups,
    )


@dataclass
class EntropyConfig(WeightQuantConfig):
    """``target_bits`` is the goal for the measured Huffman-coded size; ``bits`` is unused."""

    # options of every weight quantizer that these methods do not use (they have one scale per
    # matrix or row and unbounded integers): giving them is an error, never a silent no-op
    unused: ClassVar[dict[str, str]] = dict.fromkeys(
        ("bits", "group_size", "sym", "scale"),
        "HPTQ/HRTN keep unbounded integers with one scale per matrix or row (--scale-per) and "
        "Huffman-code them to --target-bits; drop the flag",
    )

    target_bits: float = option(3.125, help="target Huffman-coded bits per weight", range=(0, 16))
    scale_per: str = option("matrix", help="one scale per matrix or per row", choices=("matrix", "row"))
    order: str = shared("order")
    direction: str = shared("direction")
    damp: float = shared("damp")
    group_size: int | None = like(WeightQuantConfig, "group_size", None)  # one scale per matrix/row

    def __post_init__(self) -> None:
        super().__post_init__()
        base = WeightQuantConfig()
        defaults = {"bits": base.bits, "group_size": None, "sym": base.sym, "scale": base.scale}
        for name, default in defaults.items():
            value = getattr(self, name)
            if value != default:
                raise OptionError(f"hptq/hrtn do not use {name}={value!r}: {self.unused[name]}")
        if self.scale_per not in ("matrix", "row"):
            raise OptionError(f"scale_per must be 'matrix' or 'row', got {self.scale_per!r}")
        if not 0 < self.target_bits <= 16:
            raise OptionError(f"target_bits must be in (0, 16], got {self.target_bits}")


def _pack_huffman(res, cfg, bias):
    return HuffmanQuantLinear.from_result(res, bias=bias)


def quantize_hptq(weight, stats: LayerStats, cfg: EntropyConfig):
    H = require_hessian(stats, "hptq")
    return entropy_coded_quantize(
        weight,
        H,
        cfg.target_bits,
        scale_per=cfg.scale_per,
        use_gptq=True,
        perm=processing_order(H, cfg),
        percdamp=cfg.damp,
    )


def quantize_hrtn(weight, stats: LayerStats, cfg: EntropyConfig):
    return entropy_coded_quantize(weight, None, cfg.target_bits, scale_per=cfg.scale_per, use_gptq=False)


@register
class SSQR(Method):
    name, config_cls = "ssqr", SSQRConfig
    description = "no-clip GPTQ + exact sparse outliers (SSQR)"

    def quantize(self, weight, stats: LayerStats, cfg: SSQRConfig, state=None, name=None):
        return quantize_ssqr(weight, stats, cfg)

    def pack(self, res, cfg: SSQRConfig, bias):
        return _pack_ssqr(res, cfg, bias)


@register
class HPTQ(Method):
    name, config_cls = "hptq", EntropyConfig
    description = "no-clip GPTQ, one scale, Huffman-coded ints (HPTQ)"

    def quantize(self, weight, stats: LayerStats, cfg: EntropyConfig, state=None, name=None):
        return quantize_hptq(weight, stats, cfg)

    def pack(self, res, cfg: EntropyConfig, bias):
        return _pack_huffman(res, cfg, bias)


@register
class HRTN(HPTQ):
    name, needs_hessian = "hrtn", False
    description = "RTN, one scale, Huffman-coded ints (HRTN)"

    def quantize(self, weight, stats: LayerStats, cfg: EntropyConfig, state=None, name=None):
        return quantize_hrtn(weight, stats, cfg)
