"""Weights onto a microscaling grid (issue 75): RTN with block scales searched in their own encoding,
and GPTQ's error feedback over the non-uniform element grid.

Block scales (:func:`search_block_scales`): ``"minmax"`` is the format's reference rule
(:func:`bitmosaic.formats.mx.block_scales`); ``"mse"`` tries candidates *that the stored encoding can
hold* and keeps, per block, the one with the smallest squared error after rounding:

* E8M0: the min-max exponent and its two neighbours (``2^(e-1), 2^e, 2^(e+1)``: one step down clips
  the block maximum for a finer grid, one step up avoids saturating it);
* E4M3 (NVFP4): the E4M3 roundings of ``global · f · amax / 6`` for ``f`` in ``0.5 .. 1.2``;
* FP32 (FP8 block): ``f · amax / 448`` for ``f`` in ``0.8 .. 1``.

GPTQ (:class:`MXColumnQuantizer`): the block scales are fixed from the original weights (static groups,
so a block's columns share one scale whatever the processing order) and each error-updated column is
rounded to the *nearest element value* (ties to even), the error ``w - Q(w)`` being propagated as in
GPTQ (Frantar et al. 2023, Alg. 1).  The solver keeps integer codes, so the element's bit pattern stands
for it there; the "codes" of the returned result are the element values themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats.layout import default_g_idx
from ..formats.mx import (
    MXFormat,
    MXTensor,
    block_amax,
    block_scales,
    decode_elements,
    element_divisor,
    encode_elements,
    expand_blocks,
    get_mx_format,
    nvfp4_global_scale,
    quantize_elements,
)
from .types import QuantResult

__all__ = ["MXQuantResult", "MXColumnQuantizer", "search_block_scales", "mx_rtn", "mx_gptq"]

_E4M3_FACTORS = tuple(0.5 + 0.05 * i for i in range(15))  # 0.5 .. 1.2
_FP32_FACTORS = (1.0, 0.975, 0.95, 0.925, 0.9, 0.875, 0.85, 0.825, 0.8)


@dataclass
class MXQuantResult(QuantResult):
    """A :class:`QuantResult` whose ``codes`` are element values and ``scales`` the element divisors
    (``[out, G]``, one per row and block), so ``dequantize`` is the format's exact one; not an integer
    lattice (no Babai bound).  ``fmt``: the :class:`MXFormat` name; ``global_scale``: NVFP4's."""

    fmt: str = "mxfp4"
    global_scale: torch.Tensor | None = None

    def lattice_scales(self) -> None:
        return None

    def _like(self, base: QuantResult) -> MXQuantResult:
        return MXQuantResult(**{k: getattr(base, k) for k in QuantResult.__dataclass_fields__},
                             fmt=self.fmt, global_scale=self.global_scale)  # fmt: skip

    def select_rows(self, start: int, stop: int) -> MXQuantResult:
        fmt = get_mx_format(self.fmt)
        if start % fmt.block_rows:
            raise ValueError(
                f"{fmt.name} rows are scaled in blocks of {fmt.block_rows}; row {start} splits one"
            )
        return self._like(super().select_rows(start, stop))

    @classmethod
    def cat_rows(cls, parts: list[MXQuantResult]) -> MXQuantResult:
        gs = [p.global_scale for p in parts]
        if gs[0] is not None and any(not torch.equal(g, gs[0]) for g in gs):
            raise ValueError("row blocks of one NVFP4 matrix were quantized with different global scales")
        return parts[0]._like(QuantResult.cat_rows(parts))

    def to_tensor(self) -> MXTensor:
        """The exactly stored form (packed elements, encoded block scales)."""
        fmt = get_mx_format(self.fmt)
        div = self.scales[:: fmt.block_rows].float()
        scale = div * self.global_scale.float() if fmt.global_scale else div
        if fmt.scale == "e4m3":
            scale = scale.to(torch.float8_e4m3fn).float()  # undo the float32 rounding of scale / global
        return MXTensor.from_values(self.codes.float(), scale, fmt, self.global_scale)


def _block_sum(E: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    R, C = fmt.scale_shape(*E.shape)
    pr, pc = R * fmt.block_rows - E.shape[0], C * fmt.block - E.shape[1]
    E = torch.nn.functional.pad(E, (0, pc, 0, pr)) if pr or pc else E
    return E.reshape(R, fmt.block_rows, C, fmt.block).sum(dim=(1, 3))


def _block_error(W: torch.Tensor, scale: torch.Tensor, fmt: MXFormat, gs) -> torch.Tensor:
    div = expand_blocks(element_divisor(scale, fmt, gs), fmt, W.shape)
    E = W - quantize_elements(W / div, fmt) * div
    return _block_sum(E * E, fmt)


def _candidates(amax: torch.Tensor, base: torch.Tensor, fmt: MXFormat, rule: str, gs):
    if fmt.scale == "e8m0":
        return [base * 0.5, base * 2.0]
    if fmt.scale == "e4m3":
        return [block_scales(amax * f, fmt, rule=rule, global_scale=gs) for f in _E4M3_FACTORS]
    return [block_scales(amax * f, fmt) for f in _FP32_FACTORS[1:]]


def search_block_scales(
    W: torch.Tensor, fmt: str | MXFormat, *, method: str = "mse", rule: str = "floor", global_scale=None
) -> torch.Tensor:
    """Block scale values ``[R, C]`` (representable in ``fmt``'s scale encoding) for ``W``."""
    fmt = get_mx_format(fmt)
    if method not in ("minmax", "mse"):
        raise ValueError(f"block scale search must be 'minmax' or 'mse', got {method!r}")
    W = W.float()
    amax = block_amax(W, fmt)
    best = block_scales(amax, fmt, rule=rule, global_scale=global_scale)
    if method == "minmax":
        return best
    err = _block_error(W, best, fmt, global_scale)
    for cand in _candidates(amax, best, fmt, rule, global_scale):
        if fmt.scale == "e8m0":
            cand = cand.clamp(2.0**-127, 2.0**127)
        e = _block_error(W, cand, fmt, global_scale)
        better = e < err
        best, err = torch.where(better, cand, best), torch.where(better, e, err)
    return best


def _global(W: torch.Tensor, fmt: MXFormat) -> torch.Tensor | None:
    return nvfp4_global_scale(W.detach().float().abs().amax()) if fmt.global_scale else None


def _result(W, values, div_rows, fmt, gs, **extra) -> MXQuantResult:
    out, n = W.shape
    return MXQuantResult(
        codes=values,
        scales=div_rows,
        zeros=torch.zeros_like(div_rows),
        g_idx=default_g_idx(n, fmt.block, W.device),
        fmt=fmt.name,
        global_scale=gs,
        **extra,
    )


def mx_rtn(
    W: torch.Tensor, fmt: str | MXFormat, *, method: str = "mse", rule: str = "floor"
) -> MXQuantResult:
    """Round-to-nearest of ``W`` (``[out, in]``) onto ``fmt`` with searched block scales."""
    fmt = get_mx_format(fmt)
    W = W.float()
    gs = _global(W, fmt)
    scale = search_block_scales(W, fmt, method=method, rule=rule, global_scale=gs)
    div = element_divisor(scale, fmt, gs)
    values = quantize_elements(W / expand_blocks(div, fmt, W.shape), fmt)
    return _result(W, values, div.repeat_interleave(fmt.block_rows, 0)[: W.shape[0]], fmt, gs)


@dataclass(frozen=True)
class MXColumnQuantizer:
    """GPTQ's per-column step on a microscaling grid (see :class:`~.gptq.ColumnQuantizer`): ``fit`` gives
    one block column's element divisors per row, ``quantize`` rounds to the nearest element value."""

    fmt: MXFormat
    method: str = "mse"
    rule: str = "floor"
    global_scale: torch.Tensor | None = None

    def fit(self, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gs = None if self.global_scale is None else self.global_scale.to(cols.device)
        scale = search_block_scales(cols, self.fmt, method=self.method, rule=self.rule, global_scale=gs)
        div = element_divisor(scale[:, 0], self.fmt, gs).repeat_interleave(self.fmt.block_rows)[
            : cols.shape[0]
        ]
        return div.to(cols.dtype), torch.zeros_like(div, dtype=cols.dtype)

    def fit_groups(self, W: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`fit` of every block column of ``W`` in one search (``[out, G]`` each, the same numbers:
        each block's error is the sum of its own ``block`` contiguous squares either way); ``None`` for
        blocks of several rows (FP8 block: one call per block column, whose 128 x 128 sums torch may
        order by shape)."""
        if self.fmt.block_rows != 1 or g != self.fmt.block:
            return None
        gs = None if self.global_scale is None else self.global_scale.to(W.device)
        scale = search_block_scales(W, self.fmt, method=self.method, rule=self.rule, global_scale=gs)
        div = element_divisor(scale, self.fmt, gs).to(W.dtype)
        return div, torch.zeros_like(div)

    def quantize(self, w, scale, zero):
        """``(element code, value · divisor)``: GPTQ keeps integer codes, so the element's bit pattern
        (E2M1 nibble or FP8 byte) stands for it; :func:`mx_gptq` decodes them back to values.  The values
        are rounded onto the grid here, so the encoder's grid check is skipped (once per column)."""
        v = quantize_elements(w / scale, self.fmt)
        return encode_elements(v, self.fmt, check=False).to(w.dtype), v.to(w.dtype) * scale


def mx_gptq(W, H, fmt: str | MXFormat, *, method="mse", rule="floor", perm=None, block_size=128,
            percdamp=0.01, dtype=None, overwrite_hessian=False) -> MXQuantResult:  # fmt: skip
    """GPTQ of ``W`` against ``H`` onto ``fmt`` (static block scales, nearest-element rounding)."""
    from .gptq import gptq_quantize

    fmt = get_mx_format(fmt)
    gs = _global(W, fmt)
    q = MXColumnQuantizer(fmt, method, rule, gs)
    res = gptq_quantize(
        W, H, None, fmt.block, perm=perm, static_groups=True, block_size=block_size, percdamp=percdamp,
        dtype=dtype, quantizer=q, overwrite_hessian=overwrite_hessian,
    )  # fmt: skip
    values = decode_elements(res.codes.to(torch.uint8), fmt)
    out = _result(W, values, res.scales, fmt, gs)
    out.perm, out.hessian_diag, out.step_errors, out.pivots = (
        res.perm,
        res.hessian_diag,
        res.step_errors,
        res.pivots,
    )
    return out
