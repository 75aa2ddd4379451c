"""Methods ``hptq`` and ``hrtn`` (Babai paper §5, Algorithms 11 and 12): no-clip quantizers whose
overflow is kept exactly inside a Huffman-coded unbounded integer grid with one scale per matrix or
row, the scale searched until the coded size meets ``target_bits``.

HRTN is the paper's baseline that "mirrors HPTQ but replaces GPTQ with RTN": one method with a
solver variant (one config, one algorithm call with ``use_gptq``, one packed format), so both are
registered here, side by side on one base; neither derives from the other.  The math is in
:mod:`bitmosaic.algorithms.lattice`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..algorithms.lattice import entropy_coded_quantize
from ..errors import OptionError
from ..modules.qmodules import HuffmanQuantLinear
from .common import processing_order, require_hessian, shared
from .options import like, option
from .registry import LayerStats, Method, WeightQuantConfig, register

__all__ = ["EntropyConfig", "HPTQ", "HRTN", "quantize_hptq", "quantize_hrtn"]


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


class _HuffmanCoded(Method):
    """What HPTQ and HRTN share: the config and the packed (Huffman-coded) module."""

    config_cls = EntropyConfig

    def pack(self, res, cfg: EntropyConfig, bias):
        return _pack_huffman(res, cfg, bias)


@register
class HPTQ(_HuffmanCoded):
    name = "hptq"
    description = "no-clip GPTQ, one scale, Huffman-coded ints (HPTQ)"

    def quantize(self, weight, stats: LayerStats, cfg: EntropyConfig, state=None, name=None):
        return quantize_hptq(weight, stats, cfg)


@register
class HRTN(_HuffmanCoded):
    name, needs_hessian = "hrtn", False
    description = "RTN, one scale, Huffman-coded ints (HRTN)"

    def quantize(self, weight, stats: LayerStats, cfg: EntropyConfig, state=None, name=None):
        return quantize_hrtn(weight, stats, cfg)
