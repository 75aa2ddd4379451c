"""Microscaling weight formats for the methods that take a non-uniform grid (issue 75).

``rtn`` and ``gptq`` take ``wfmt`` (``--wfmt``, or ``--scheme NVFP4A16 | MXFP4A16 | MXFP8A16 | FP8_BLOCK``
as llm-compressor names them): ``int`` is the INT grid as before; a microscaling format
(:mod:`bitmosaic.formats.mx`) fixes the bits and the block (group) size, ``--scale minmax|mse`` picks
the block scale search (:func:`bitmosaic.algorithms.mx.search_block_scales`) and ``--mx-rule`` the
E8M0 exponent rule.  The result packs into the ``mx`` module kind (:class:`bitmosaic.modules.mx.MXLinear`).

Every other method solves on the INT grid (its scale search, lattice, or integer kernel is the method),
so it refuses a microscaling scheme in one line (:func:`refuse_mx`).
"""

from __future__ import annotations

from ..errors import OptionError
from ..formats.mx import get_mx_format, scheme_weight_format

__all__ = ["MX_METHODS", "STACK_ROWS", "SPLIT_ROWS", "mx_post_init", "is_mx", "refuse_mx", "scheme_options"]

MX_METHODS = ("rtn", "gptq")  # the methods whose configs take ``wfmt``


# config properties the pipeline reads (pipeline/solve.py): linears sharing a Hessian may be stacked
# row-wise (not FP8 block's 128-row blocks; NVFP4's stacked q/k/v or gate/up then share one tensor scale,
# as vLLM's fused layers need), and a solve may be split into row blocks over processes (not with a
# tensor scale or row blocks)
STACK_ROWS = property(lambda cfg: getattr(cfg, "wfmt", "int") != "fp8-block")
SPLIT_ROWS = property(lambda cfg: getattr(cfg, "wfmt", "int") not in ("nvfp4", "fp8-block"))


def is_mx(cfg) -> bool:
    return getattr(cfg, "wfmt", "int") != "int"


def mx_post_init(cfg) -> None:
    """A microscaling ``wfmt`` fixes ``bits`` (the element width) and ``group_size`` (the block)."""
    if not is_mx(cfg):
        return
    f = get_mx_format(cfg.wfmt)
    cfg.bits, cfg.group_size = f.elem_bits, f.block


def refuse_mx(method: str, config_cls, scheme: str) -> None:
    """One line saying why ``method`` cannot quantize to the microscaling grid of ``scheme``."""
    fmt = scheme_weight_format(scheme)
    if fmt is None or "wfmt" in {f for f in getattr(config_cls, "__dataclass_fields__", {})}:
        return
    raise OptionError(
        f"method {method!r} cannot use the {fmt} grid of --scheme {scheme}: it solves on the INT grid only "
        f"(its scales, lattice or integer kernel are the method); use --method {' or '.join(MX_METHODS)}"
    )


def scheme_options(method: str, config_cls, scheme: str | None) -> dict:
    """The config options a microscaling ``scheme`` sets (``{"wfmt": ...}``), or a refusal; ``{}`` for
    the W?A? schemes."""
    fmt = scheme_weight_format(scheme)
    if fmt is None:
        return {}
    refuse_mx(method, config_cls, scheme)
    return {"wfmt": fmt}
