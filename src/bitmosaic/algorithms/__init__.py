"""The math of quantization as pure functions on tensors (no models, no I/O, no globals)."""

from .babai import babai_nearest_plane
from .bounds import babai_bound, hessian_error, ldl_diagonal, relative_output_error
from .gptq import gptq_quantize
from .hessian import DampingError, HessianAccumulator, damp_hessian
from .orders import ORDERS, apply_direction, groups_contiguous, make_order, min_pivot_sequence
from .rtn import rtn_quantize
from .scales import find_scale_zero, group_scale_zero
from .types import QuantResult

__all__ = [
    "ORDERS",
    "DampingError",
    "HessianAccumulator",
    "QuantResult",
    "apply_direction",
    "babai_bound",
    "babai_nearest_plane",
    "damp_hessian",
    "find_scale_zero",
    "gptq_quantize",
    "group_scale_zero",
    "groups_contiguous",
    "hessian_error",
    "ldl_diagonal",
    "make_order",
    "min_pivot_sequence",
    "relative_output_error",
    "rtn_quantize",
]
