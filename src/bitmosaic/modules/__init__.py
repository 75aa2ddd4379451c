"""Quantized module kinds: the storage formats as ``nn.Module``s (packed INT codes, CSR outliers,
Huffman streams, FP8 bytes, DPQ's FP8-compute layout) and the activation quantizer they carry.

They depend only on :mod:`bitmosaic.formats`, :mod:`bitmosaic.kernels` and the result type of
:mod:`bitmosaic.algorithms`; methods pack into them and models load them, so the layering
formats <- algorithms <- modules <- methods <- models <- cli has no back-edge.
"""

from .actquant import attach_input_quant, input_quant_spec
from .base import KINDS, NoIntForm, QuantModule
from .mosaic import MosaicQuantLinear
from .qlinear import QuantLinear, UnpackableCodesError, set_weight_cache
from .qmodules import (  # imports every kind: the registry is complete
    MODULE_KINDS,
    FP8ComputeQuantLinear,
    FP8Linear,
    HuffmanQuantLinear,
    SparseOutlierQuantLinear,
    full_layer_config,
    module_from_layer_config,
)

__all__ = [
    "KINDS",
    "MODULE_KINDS",
    "NoIntForm",
    "FP8ComputeQuantLinear",
    "FP8Linear",
    "HuffmanQuantLinear",
    "MosaicQuantLinear",
    "QuantLinear",
    "QuantModule",
    "SparseOutlierQuantLinear",
    "UnpackableCodesError",
    "attach_input_quant",
    "full_layer_config",
    "input_quant_spec",
    "module_from_layer_config",
    "set_weight_cache",
]
