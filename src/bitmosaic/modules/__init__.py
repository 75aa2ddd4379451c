"""Quantized module kinds: the storage formats as ``nn.Module``s (packed INT codes, CSR outliers,
Huffman streams, FP8 bytes, DPQ's FP8-compute layout) and the activation quantizer they carry.

They depend only on :mod:`bitmosaic.formats`, :mod:`bitmosaic.kernels` and the result type of
:mod:`bitmosaic.algorithms`; methods pack into them and io loads them, so the layering
formats <- algorithms <- modules <- methods <- pipeline/io <- cli has no back-edge.  Every kind
registers itself (``QuantModule.__init_subclass__``); the imports below are the list of kinds, so
the registry is complete whenever ``bitmosaic.modules`` is imported.
"""

from .actquant import attach_input_quant, input_quant_spec
from .base import KINDS, NoIntForm, QuantModule
from .gguf_grid import GGUFGridLinear
from .mosaic import MosaicQuantLinear
from .mx import MXLinear
from .packed_experts import PackedExperts, PackedRoutedExperts, pack_experts
from .qlinear import QuantLinear, UnpackableCodesError, set_weight_cache
from .qmodules import (
    MODULE_KINDS,
    FP8ComputeQuantLinear,
    FP8Linear,
    HuffmanQuantLinear,
    SparseOutlierQuantLinear,
    full_layer_config,
    module_from_layer_config,
)
from .sfmp import SFMPLinear
from .sq import SQActLinear, SQWeightLinear

__all__ = [
    "KINDS",
    "MODULE_KINDS",
    "NoIntForm",
    "FP8ComputeQuantLinear",
    "FP8Linear",
    "GGUFGridLinear",
    "HuffmanQuantLinear",
    "MosaicQuantLinear",
    "MXLinear",
    "PackedExperts",
    "PackedRoutedExperts",
    "QuantLinear",
    "QuantModule",
    "SFMPLinear",
    "SQActLinear",
    "SQWeightLinear",
    "SparseOutlierQuantLinear",
    "UnpackableCodesError",
    "attach_input_quant",
    "full_layer_config",
    "input_quant_spec",
    "module_from_layer_config",
    "pack_experts",
    "set_weight_cache",
]
