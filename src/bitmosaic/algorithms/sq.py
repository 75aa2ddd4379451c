"""SQ-format algorithms (Huang et al., §3.2) as pure tensor functions.

Algorithm 1 (weights): importance ``I = (W')^2 / d^2`` per weight, the top ``(1 - s)`` of each
bank of each output channel high precision, both parts quantized with their own scale per bank
column, and GPTQ error compensation through the mixed grid (:class:`SQColumnQuantizer`, plugged
into :func:`bitmosaic.algorithms.gptq.gptq_quantize` in natural order so banks stay contiguous).

- ``importance="paper"``: ``d = diag(H^-1)`` of the damped Hessian (Algorithm 1, line 4, as
  printed: the diagonal *squared* in the denominator).
- ``importance="obs"``: ``d = diag(U)`` with ``U`` the upper Cholesky factor of ``H^-1`` (GPTQ's
  factor), i.e. ``w^2 / [H_{j:,j:}^-1]_jj`` -- SparseGPT's OBS saliency at the time the column
  is reached.
- ``mask_timing="upfront"``: the mask is fixed from ``W'`` before GPTQ (the paper as written);
  ``"lazy"``: each bank's mask is chosen from the GPTQ-updated weights when the bank starts
  (SparseGPT's lazy mask selection).

Algorithm 2 (activations): :func:`static_importance` (``I_j = |Ā_j Σ_i W'_ij|`` and the two
ablations), :func:`static_channel_mask` (top ``(1 - s)`` channels per bank) and
:func:`high_first_permutation` (the column reordering of Algorithm 2, line 11); the splits are
:func:`dynamic_split` and :func:`static_split`.

Activation scales (both strategies; the paper leaves their granularity unprinted, §3.2.2): each part
(low, high) gets its own scale per token and scale group -- the whole token, one bank, or ``G``
channels (:func:`bitmosaic.formats.sq_act.act_scale_group`).  With a static mask the bank/group scales
may instead be calibrated once (:func:`static_act_scales`: the largest calibration ``|x_j|`` over the
part's channels of each group), which makes the activation quantizer fully static: no reduction
over the token at inference.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..formats.sq import (
    SQFormat,
    SQTensor,
    bank_topk_mask,
    fp4_decode,
    fp4_encode,
    fp8_decode,
    fp8_encode,
    part_scales,
    round_high,
    round_low,
    sq_quantize,
)
from ..formats.sq_act import ACT_SCALES, act_scale_group
from .gptq import gptq_quantize
from .hessian import gptq_factor
from .types import QuantResult

__all__ = [
    "IMPORTANCE_FORMS",
    "MASK_TIMINGS",
    "STATIC_IMPORTANCE",
    "SQColumnQuantizer",
    "SQWeightResult",
    "dynamic_split",
    "high_first_permutation",
    "sq_gptq",
    "static_act_scales",
    "static_channel_mask",
    "static_split",
    "static_importance",
    "weight_importance_denominator",
]

IMPORTANCE_FORMS = ("paper", "obs")
MASK_TIMINGS = ("upfront", "lazy")
STATIC_IMPORTANCE = ("aw", "a", "abs-aw")


def weight_importance_denominator(Hd: torch.Tensor, U: torch.Tensor, form: str) -> torch.Tensor:
    """``d`` ``[in]`` of ``I = W'^2 / d^2`` (module doc) from the damped Hessian and GPTQ's factor."""
    if form == "paper":
        return torch.diagonal(torch.cholesky_inverse(torch.linalg.cholesky(Hd)))
    if form == "obs":
        return torch.diagonal(U).clone()
    raise ValueError(f"SQ importance must be one of {IMPORTANCE_FORMS}, got {form!r}")


def _bank_format(fmt: SQFormat, size: int) -> SQFormat:
    return fmt if size == fmt.bank else dataclasses.replace(fmt, partial_last_bank=True)


class SQColumnQuantizer:
    """GPTQ's column step through the SQ mixed grid (Algorithm 1 with compensation).

    ``fit(cols)`` is called when a bank starts (GPTQ groups = banks, natural order): it fixes the
    bank's mask (the up-front one, or -- ``lazy`` -- the top ``(1 - s)`` of ``cols^2 / d^2`` on the
    current, error-updated weights) and returns the bank's ``(low_scale, high_scale)``, each part's
    absmax over its own places (these take GPTQ's ``scale``/``zero`` slots; the grid is symmetric,
    there is no zero-point).  ``column_step`` quantizes each column of the bank on the high grid
    where the mask is set and on the low grid elsewhere, and returns the inference value, so GPTQ
    propagates the mixed-grid error.  Codes: INT levels, or FP8/FP4 codes for the FP pair.
    """

    def __init__(self, fmt: SQFormat, out: int, n: int, denom: torch.Tensor, mask: torch.Tensor | None):
        self.fmt = fmt
        self.lazy = mask is None
        self.denom = denom
        self.mask = (
            torch.zeros(out, n, dtype=torch.bool, device=denom.device) if mask is None else mask.clone()
        )
        self._start = 0
        self._cur: tuple[int, int] = (0, 0)

    def fit(self, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, size = self._start, cols.shape[1]
        bf = _bank_format(self.fmt, size)
        if self.lazy:
            d = self.denom[start : start + size].to(cols.dtype)
            self.mask[:, start : start + size] = bank_topk_mask(cols.square() / d.square()[None, :], bf)
        m = self.mask[:, start : start + size]
        ls, hs = part_scales(cols, m, bf, size)
        self._cur = (start, size)
        self._start += size
        return ls[:, 0].to(cols.dtype), hs[:, 0].to(cols.dtype)

    def column_step(self, low_scale: torch.Tensor, high_scale: torch.Tensor):
        start, size = self._cur
        cols = iter(range(start, start + size))
        fmt = self.fmt

        def step(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            m = self.mask[:, next(cols)]
            hi = round_high(w / high_scale, fmt)
            lo = round_low(w / low_scale, fmt) + 0.0  # a low zero is +0 (-0 is v_mask for FP4)
            dq = torch.where(m, hi * high_scale, lo * low_scale)
            if fmt.fp:
                q = torch.where(m, fp8_encode(hi), fp4_encode(lo) if fmt.h_low else 0).to(w.dtype)
            else:
                q = torch.where(m, hi, lo)
            return q, dq

        return step


@dataclass
class SQWeightResult(QuantResult):
    """A :class:`QuantResult` whose weight is the SQ tensor ``sq`` (``scales``: low scales,
    ``zeros``: high scales, ``codes``: mixed INT levels / FP codes, as GPTQ returned them)."""

    sq: SQTensor = field(kw_only=True)

    def lattice_scales(self) -> None:
        return None  # two grids per bank: no single integer lattice, no Babai bound

    def select_rows(self, start: int, stop: int) -> SQWeightResult:
        base = super().select_rows(start, stop)
        t = self.sq
        sq = SQTensor(
            t.fmt,
            t.mask[start:stop],
            t.low[start:stop],
            t.high[start:stop],
            t.low_scale[start:stop],
            t.high_scale[start:stop],
            t.group,
        )
        return SQWeightResult(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(QuantResult)}, sq=sq
        )

    @classmethod
    def cat_rows(cls, parts: list[SQWeightResult]) -> SQWeightResult:
        base = QuantResult.cat_rows(parts)
        t = parts[0].sq
        fields = ("mask", "low", "high", "low_scale", "high_scale")
        sq = SQTensor(t.fmt, *(torch.cat([getattr(p.sq, k) for p in parts]) for k in fields), t.group)
        return SQWeightResult(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(QuantResult)}, sq=sq
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.sq.dequantize(dtype)


def _sq_from_codes(codes: torch.Tensor, mask: torch.Tensor, fmt: SQFormat, ls, hs) -> SQTensor:
    c = codes.to(torch.int32)
    if fmt.fp:
        high = fp8_decode(c.clamp(0, 255) * mask)
        low = fp4_decode(c.clamp(0, 15)) if fmt.h_low else torch.zeros_like(high)
    else:
        high = low = c.float()
    high = high.masked_fill(~mask, 0)
    low = low.masked_fill(mask, 0) + 0.0
    return SQTensor(fmt, mask, low, high, ls.float(), hs.float(), fmt.bank)


def sq_gptq(
    W: torch.Tensor,
    H: torch.Tensor,
    fmt: SQFormat,
    *,
    importance: str = "obs",
    mask_timing: str = "lazy",
    compensate: bool = True,
    percdamp: float = 0.01,
    block_size: int = 128,
) -> SQWeightResult:
    """Algorithm 1 on one (smoothed) weight ``W`` ``[out, in]`` with Hessian ``H`` (from the smoothed
    inputs).  ``compensate=False`` is plain SQ rounding with the same masks (no GPTQ updates)."""
    if mask_timing not in MASK_TIMINGS:
        raise ValueError(f"SQ mask timing must be one of {MASK_TIMINGS}, got {mask_timing!r}")
    out, n = W.shape
    fmt.banks(n)  # validates the reduction width
    W32 = W.float().clone()
    H32 = H.to(W32.device, torch.float32)
    W32[:, torch.diagonal(H32) == 0] = 0
    Hd_diag, U, _, _ = gptq_factor(H32, percdamp, torch.arange(n, device=W32.device))
    Hd = H32.clone()
    torch.diagonal(Hd).copy_(Hd_diag)
    d = weight_importance_denominator(Hd, U, importance)
    del U
    mask = None
    if mask_timing == "upfront" or not compensate:
        mask = bank_topk_mask(W32.square() / d.square()[None, :], fmt)
    if not compensate:
        t = sq_quantize(W32, mask, fmt)
        res = QuantResult(
            codes=torch.zeros(out, n, dtype=torch.int32),
            scales=t.low_scale,
            zeros=t.high_scale,
            g_idx=torch.arange(n) // fmt.bank,
            hessian=Hd,
        )
        return SQWeightResult(**{f.name: getattr(res, f.name) for f in dataclasses.fields(QuantResult)}, sq=t)
    q = SQColumnQuantizer(fmt, out, n, d, mask)
    res = gptq_quantize(W32, H32, None, fmt.bank, quantizer=q, percdamp=percdamp, block_size=block_size)
    sq = _sq_from_codes(res.codes, q.mask, fmt, res.scales, res.zeros)
    res.info.update({"sq": fmt.notation, "importance": importance, "mask_timing": mask_timing})
    return SQWeightResult(**{f.name: getattr(res, f.name) for f in dataclasses.fields(QuantResult)}, sq=sq)


# -- Algorithm 2 ----------------------------------------------------------------------------------
def static_importance(
    W: torch.Tensor, act_mean: torch.Tensor, act_absmean: torch.Tensor | None = None, form: str = "aw"
) -> torch.Tensor:
    """Per-input-channel importance ``[in]`` for static activation masks (Algorithm 2, line 6).

    ``"aw"``: ``|Ā_j Σ_i W'_ij|`` (the paper's score); ``"a"``: ``|Ā_j|`` (the paper's first try,
    reported to degrade); ``"abs-aw"``: ``mean|A_j| Σ_i |W'_ij|`` (a sign-free variant, ours).
    """
    if form == "aw":
        return (act_mean.float() * W.float().sum(0)).abs()
    if form == "a":
        return act_mean.float().abs()
    if form == "abs-aw":
        if act_absmean is None:
            raise ValueError("static importance 'abs-aw' needs mean|A_j|")
        return act_absmean.float() * W.float().abs().sum(0)
    raise ValueError(f"static importance must be one of {STATIC_IMPORTANCE}, got {form!r}")


def static_channel_mask(importance: torch.Tensor, fmt: SQFormat) -> torch.Tensor:
    """Boolean ``[in]``: the top ``(1 - s)`` channels of every bank (one mask per linear)."""
    return bank_topk_mask(importance.reshape(1, -1), fmt)[0]


def high_first_permutation(mask: torch.Tensor) -> torch.Tensor:
    """Column order putting the high channels first, then the low ones (each in original order):
    ``x[:, perm] @ W[:, perm].T == x @ W.T`` and both parts are contiguous slices."""
    return torch.argsort((~mask).to(torch.int8), stable=True)


def dynamic_split(x: torch.Tensor, fmt: SQFormat, scale: str = "token", group: int | None = None) -> SQTensor:
    """Dynamic SQ-format of activations ``x`` ``[tokens, K]``: per token and bank the top
    ``(1 - s)`` by ``|x|`` are high; each part gets its own scale per token and scale group
    (``scale``: token | bank | group of ``group`` channels, :data:`~bitmosaic.formats.sq_act.ACT_SCALES`)."""
    if scale not in ACT_SCALES:
        raise ValueError(f"SQ activation scale must be one of {ACT_SCALES}, got {scale!r}")
    mask = bank_topk_mask(x.abs(), fmt)
    return sq_quantize(x, mask, fmt, group=act_scale_group(fmt, x.shape[-1], scale, group))


def static_act_scales(
    channel_absmax: torch.Tensor, mask: torch.Tensor, fmt: SQFormat, scale: str, group: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibrated ``(low_scale, high_scale)`` ``[ceil(K / g)]`` of a static mask ``[K]``: per scale
    group (one bank, or ``group`` channels) and part, the largest calibration ``max|x_j|`` over the
    part's channels of the group, over the part's grid maximum (fp16-exact)."""
    if scale == "token":
        raise ValueError("calibrated SQ activation scales are per bank or per group, not per token")
    K = mask.shape[-1]
    g = act_scale_group(fmt, K, scale, group)
    lo, hi = part_scales(channel_absmax.float().reshape(1, K), mask.reshape(1, K), fmt, g)
    return lo[0], hi[0]


def static_split(
    x: torch.Tensor,
    mask: torch.Tensor,
    fmt: SQFormat,
    scale: str = "token",
    group: int | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> SQTensor:
    """Static SQ-format of ``x`` ``[tokens, K]`` with one channel ``mask`` ``[K]`` (Algorithm 2):
    each part gets its own scale per token and scale group, or the calibrated ``scales``
    (:func:`static_act_scales`) shared by every token."""
    if scale not in ACT_SCALES:
        raise ValueError(f"SQ activation scale must be one of {ACT_SCALES}, got {scale!r}")
    g = act_scale_group(fmt, x.shape[-1], scale, group)
    if scales is not None:
        scales = tuple(s.float().reshape(1, -1).expand(x.shape[0], -1) for s in scales)
    return sq_quantize(x, mask.reshape(1, -1).expand_as(x), fmt, group=g, scales=scales)
