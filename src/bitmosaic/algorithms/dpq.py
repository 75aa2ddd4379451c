"""Dual Precision Quantization (DPQ; Gafni, Karnieli & Hanani): W4A8 with FP8 compute.

Weights are stored as INT4 with per-group scale/zero and dequantized at inference to FP8 (E4M3),
which multiplies FP8 activations; an FP8 weight scale ``s_w`` maps back to 16-bit (paper §3,
Fig. 3).  The inference weight of a stored code ``q`` is therefore two-level:

    w_8  = nearest_Z(w / s_w)                      (Eq. 7, s_w = max|W| / Z_max, Eq. 6)
    q    = clamp(round(w_8 / s) + z, 0, 15)        (Eq. 9, s/z from the FP8-domain group, Eq. 8)
    ŵ_8  = nearest_Z((q - z) * s)                  (Eq. 10, see below)
    ŵ_16 = ŵ_8 * s_w                               (Eq. 11)

DPQ runs GPTQ with this step and propagates ``w - ŵ_16`` -- the error of *both* levels against the
original weight -- through the inverse Hessian (Eq. 12, Algorithm 1); see :class:`DualPrecisionQuantizer`.
Group scales are searched by MSE with clipping, the Hessian is damped and factored by Cholesky
(§3.3), and GAR (:func:`bitmosaic.algorithms.orders.gar_order`, §3.2) is passed as ``perm``.

Eq. 10 as printed has no rounding; we round the product to the FP8 grid because that is what an
INT4 -> FP8 dequantizer outputs, so the weight used in inference is exactly on the E4M3 grid.

``Z`` is the E4M3 grid: ``"e4m3"`` (±448, Gaudi 3 / OCP) or ``"e4m3-240"`` (±240, Gaudi 2's
IEEE-style variant, §4.1); ``"e5m2"`` is accepted for experiments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..formats.fp import fp_round, get_float_format
from ..formats.grid import IntGrid, dequantize_codes, fp16_exact, quantize_codes
from .bounds import hessian_error
from .gptq import IntColumnQuantizer, gptq_quantize
from .scales import ScaleMethod, find_scale_zero
from .types import QuantResult

__all__ = ["INT4", "DPQResult", "DualPrecisionQuantizer", "dpq_quantize", "fp8_on_top", "fp8_weight_scale"]

_FP16_MIN_SUBNORMAL = 2.0**-24
INT4 = IntGrid(4, symmetric=False)  # the paper's storage grid: unsigned codes 0..15 (§2.1, Eq. 8)


def _float32_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest float32 ``>= x`` (float64 in): a stored scale never shrinks the headroom."""
    y = x.to(torch.float32)
    low = y.to(x.dtype) < x
    return torch.where(low, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def fp8_weight_scale(
    W: torch.Tensor,
    fmt: str = "e4m3",
    per_channel: bool = False,
    margin: float = 1.0,
    pow2: bool = False,
) -> torch.Tensor:
    """FP8 weight scale ``s_w = max|W| * margin / Z_max`` (DPQ paper Eq. 6; Eq. 3 of §2.2).

    Returns float32 ``[1, 1]`` (per tensor, the paper's setting, §4.1) or ``[out, 1]``
    (``per_channel``), rounded *up* to float32 so ``|W| / s_w <= Z_max / margin`` holds exactly.

    ``margin`` (>= 1) is our option, not the paper's: DPQ's error compensation (Eq. 12) changes
    the not-yet-quantized weights, and those that grow beyond ``max|W|`` would saturate at
    ``Z_max`` in Eq. 7.  ``margin > 1`` keeps ``Z_max (1 - 1/margin)`` of headroom for them, at the
    cost of a coarser FP8 grid relative to the weights.  ``margin = 1`` is Eq. 6.

    ``pow2``: ``s_w = 2^ceil(log2 s_w)``, the power-of-two scales that Gaudi applies by shifting
    the exponent bias instead of multiplying (§2.2); rounding up keeps the headroom.

    All-zero rows (per channel) or tensors get ``s_w = 1 / Z_max`` (any positive value works).
    """
    if W.dim() != 2:
        raise ValueError(f"W must be a 2-D [out, in] weight, got shape {tuple(W.shape)}")
    f = get_float_format(fmt)
    margin = float(margin)
    if not (margin >= 1.0 and margin < float("inf")):
        raise ValueError(f"margin must be a finite number >= 1, got {margin!r}")
    A = W.detach().to(torch.float64).abs()
    if not torch.isfinite(A).all():
        raise ValueError("W has non-finite values; cannot compute an FP8 scale")
    amax = A.amax(dim=1, keepdim=True) if per_channel else A.amax().reshape(1, 1)
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    s = amax * margin / f.max_value
    if pow2:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    s = _float32_ceil(s)
    if not (torch.isfinite(s).all() and (s > 0).all()):
        raise ValueError("FP8 weight scale is outside the float32 range (weights too large or too small)")
    return s


class DualPrecisionQuantizer:
    """GPTQ column step for DPQ (paper §3.1, Algorithm 1 lines 4-10): INT4 codes of FP8 weights.

    ``fp8_scale_rows``: ``s_w`` broadcastable to ``[out]`` (``[1, 1]``, ``[out, 1]``, ``[out]``).

    - ``fit(cols)``: ``w_8 = nearest_Z(cols / s_w)`` (Eq. 7), then the group's INT scale/zero on
      ``w_8`` by ``find_scale_zero`` (Eq. 8; ``scale_method="mse"`` is the §3.3 MSE search).
    - ``quantize(w, s, z)``: Eq. 7, ``q = round(w_8 / s) + z`` clamped to the grid (Eq. 9; clipping
      §3.3), ``ŵ_8 = nearest_Z((q - z) s)`` (Eq. 10, rounded, see module doc), ``ŵ_16 = ŵ_8 s_w``
      (Eq. 11).  Returns ``(q, ŵ_16)``, so GPTQ propagates ``w - ŵ_16`` (Eq. 12).
    - ``column_step(s, z)``: the same, bound to one group: Eq. 10's FP8 rounding depends on the
      code alone, so ``ŵ_16`` is computed once per group for each of the ``2^b`` codes (a
      ``[out, 2^b]`` table, the same arithmetic on the same values) and looked up per column; only
      Eq. 7 (which depends on the compensated weight) and Eq. 9 stay per column.  Without clipping
      the codes are unbounded and ``quantize`` is used.

    ``saturated`` counts the weights whose error-updated value exceeded ``Z_max s_w`` in Eq. 7
    (clamped to ``±Z_max``); ``margin`` in :func:`fp8_weight_scale` is the remedy.

    ``nearest=True`` is a labelled ablation, not the paper: each weight takes the code whose *final*
    value ``nearest_Z((q - z) s) s_w`` (Eqs. 10-11) is nearest to it, instead of Eq. 7's FP8 rounding
    followed by Eq. 9's INT rounding (two roundings, which can land one code away).  Needs ``clip``.
    """

    def __init__(
        self,
        fp8_scale_rows: torch.Tensor,
        fmt: str = "e4m3",
        grid: IntGrid = INT4,
        scale_method: ScaleMethod = "mse",
        clip: bool = True,
        nearest: bool = False,
    ) -> None:
        if nearest and not clip:
            raise ValueError("the nearest-code ablation picks among the grid's codes; it needs clip=True")
        s = torch.as_tensor(fp8_scale_rows).reshape(-1)
        if s.numel() == 0 or not (torch.isfinite(s).all() and (s > 0).all()):
            raise ValueError("fp8_scale_rows must be finite and positive")
        self.fp8_scale_rows = s
        self.format = get_float_format(fmt)
        self.grid = grid
        self.scale_method: ScaleMethod = scale_method
        self.clip = clip
        self.nearest = nearest
        self._saturated = torch.zeros((), dtype=torch.long, device=s.device)
        self._pending: list[torch.Tensor] = []  # w / s_w of quantized columns, counted in batches

    @property
    def saturated(self) -> torch.Tensor:
        self._count_saturated()
        return self._saturated

    def _count_saturated(self) -> None:
        if self._pending:
            x = torch.stack(self._pending)
            self._pending.clear()
            self._saturated += (x.abs() > self.format.max_value).sum()

    def _note(self, x: torch.Tensor) -> None:
        self._pending.append(x)
        if len(self._pending) >= 256:
            self._count_saturated()

    def fit(self, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w8 = fp_round(cols / self.fp8_scale_rows[:, None], self.format)
        return find_scale_zero(w8, self.grid, self.scale_method)

    def quantize(
        self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.nearest:
            return self.column_step(scale, zero)(w)
        x = w / self.fp8_scale_rows
        self._note(x)
        w8 = fp_round(x, self.format)
        q = quantize_codes(w8, scale, zero, self.grid.maxq, clip=self.clip)
        w8_hat = fp_round(dequantize_codes(q, scale, zero), self.format)
        return q, w8_hat * self.fp8_scale_rows

    def column_step(self, scale: torch.Tensor, zero: torch.Tensor):
        """Eqs. 7-11 for one group: Eq. 10's FP8 rounding once per group for the ``maxq + 1`` codes
        (a ``[out, 2^b]`` table), Eqs. 7 and 9 per column (see class doc)."""
        if not self.clip:  # unbounded codes: no finite table
            return lambda w: self.quantize(w, scale, zero)
        s_w, fmt, maxq = self.fp8_scale_rows, self.format, self.grid.maxq
        codes = torch.arange(maxq + 1, dtype=scale.dtype, device=scale.device)
        w16_tab = fp_round(dequantize_codes(codes[None, :], scale[:, None], zero[:, None]), fmt)
        w16_tab = (w16_tab * s_w.reshape(-1, 1)).reshape(-1)  # row r, code q at r * (maxq + 1) + q
        offset = torch.arange(scale.shape[0], dtype=torch.int32, device=scale.device) * (maxq + 1)

        def step(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = w / s_w
            self._note(x)
            q = torch.div(fp_round(x, fmt), scale).round_().add_(zero).clamp_(0, maxq)  # Eqs. 7, 9
            return q, w16_tab.index_select(0, torch.add(offset, q.to(torch.int32)))  # Eqs. 10-11

        def nearest(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # the ablation
            self._note(w / s_w)
            q = (w.reshape(-1, 1) - w16_tab.view(-1, maxq + 1)).abs().argmin(dim=1)  # first of ties
            return q.to(scale.dtype), w16_tab.view(-1, maxq + 1).gather(1, q[:, None]).reshape(-1)

        return nearest if self.nearest else step


@dataclass
class DPQResult(QuantResult):
    """A :class:`QuantResult` whose INT codes dequantize to FP8 (Eq. 10) times ``fp8_scale`` (Eq. 11).

    ``scales``/``zeros`` live in the FP8 domain (fp16-exact); ``fp8_scale`` is ``s_w``, float32
    ``[1, 1]`` or ``[out, 1]``; ``fmt`` names the FP8 grid.
    """

    fp8_scale: torch.Tensor = field(kw_only=True)
    fmt: str = field(kw_only=True)

    def lattice_scales(self) -> None:
        return None  # FP8 rounding of (q - z) s leaves the integer lattice: no Babai bound

    def fp8_weight(self) -> torch.Tensor:
        """``ŵ_8 = nearest_Z((q - z) s)`` (Eq. 10), float32 ``[out, in]``: the FP8 GEMM operand.

        ``(q - z) s`` is exact in float32 (small integer times an fp16 value).
        """
        g = self.g_idx.long()
        v = dequantize_codes(self.codes.float(), self.scales.float()[:, g], self.zeros.float()[:, g])
        return fp_round(v, self.fmt)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``ŵ_16 = ŵ_8 s_w`` (Eq. 11), the weight inference uses, cast to ``dtype``.

        The product is formed in float32 (float64 when ``dtype`` is float64, where it is exact),
        i.e. in the precision the quantizer's error compensation ran in.
        """
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        W = self.fp8_weight().to(wide) * self.fp8_scale.to(wide)
        if self.sparse is not None:
            W = W + self.sparse.to(wide)
        return W.to(dtype)


def _naive_fp8(
    res: QuantResult, fmt: str, per_channel: bool, margin: float, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """FP8 applied on top of INT4 GPTQ (the paper's "naive GPTQ" W4A8 baseline, §4.2, Table 2).

    ``s_w`` from the INT4-dequantized weight (Eq. 6); group scales re-expressed in the FP8 domain,
    ``s' = fp16(s / s_w)`` per row, so that ``nearest_Z((q - z) s') s_w`` approximates ``(q - z) s``.
    """
    W_int = res.dequantize(torch.float64)
    s_w = fp8_weight_scale(W_int, fmt, per_channel=per_channel, margin=margin, pow2=pow2)
    s8 = res.scales.to(torch.float64) / s_w.to(torch.float64)
    s8 = fp16_exact(s8.clamp(min=_FP16_MIN_SUBNORMAL)).to(res.scales.dtype)
    g = res.g_idx.long()
    v = dequantize_codes(res.codes.to(torch.float64), s8.double()[:, g], res.zeros.double()[:, g])
    saturated = int((v.abs() > get_float_format(fmt).max_value).sum())
    return s_w, s8, saturated


def dpq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    *,
    fmt: str = "e4m3",
    group_size: int | None = 128,
    perm: torch.Tensor | None = None,
    per_channel: bool = False,
    margin: float = 1.0,
    pow2: bool = False,
    scale_method: ScaleMethod = "mse",
    clip: bool = True,
    naive: bool = False,
    nearest: bool = False,
    block_size: int = 128,
    percdamp: float = 0.01,
    dtype: torch.dtype | None = None,
    grid: IntGrid | None = None,
) -> DPQResult:
    """W4A8 DPQ of ``W`` (``[out, in]``) against Hessian ``H`` (paper Algorithm 1).

    Default: ``s_w`` from ``W`` (Eq. 6, dead inputs' weights excluded as GPTQ zeroes them), then
    GPTQ with :class:`DualPrecisionQuantizer`, so both quantization levels' error is compensated
    (Eq. 12).  ``naive=True``: the paper's "naive GPTQ" baseline (§4.2, Table 2): INT4 GPTQ on
    ``W`` (only the INT4 error compensated), FP8 applied afterwards (see :func:`_naive_fp8`).

    When DPQ beats naive: Eq. 7 rounds each weight to FP8 *before* the INT4 decision, so every
    step carries a second FP8 rounding error, while compensation only lowers an error's cost from
    ``H_ii`` to its Schur pivot ``D_i``.  On synthetic layers DPQ wins consistently when the mean
    ``D_i / H_ii`` is below about 1/2 (strongly correlated inputs, as in LLMs) and loses slightly
    on nearly independent inputs (``D/H ~ 0.85``).

    ``nearest=True``: the labelled nearest-code ablation of :class:`DualPrecisionQuantizer` (not the
    paper's Eqs. 7-9; DPQ only).

    ``perm`` is the processing order (``make_order(H, "gar", group_size)`` for GAR, §3.2; act-order
    gives a non-trivial ``g_idx``).  ``grid`` defaults to INT4 asymmetric (codes 0..15, §2.1).
    In both modes ``.dequantize()`` is exactly the inference weight ``ŵ_8 s_w``, and
    ``step_errors`` is its per-row ``(w - ŵ)^T H_damped (w - ŵ)``.
    """
    grid = grid if grid is not None else INT4
    f = get_float_format(fmt)
    if W.dim() != 2 or H.shape != (W.shape[1], W.shape[1]):
        raise ValueError(f"expected W [out, in] and H [in, in], got {tuple(W.shape)} and {tuple(H.shape)}")
    quantizer: IntColumnQuantizer | DualPrecisionQuantizer
    if naive and nearest:
        raise ValueError("the nearest-code ablation is DPQ's (dual precision); naive GPTQ has one rounding")
    if naive:
        quantizer = IntColumnQuantizer(grid, scale_method, clip)
    else:
        dead = torch.diagonal(H) == 0
        s_w = fp8_weight_scale(W.masked_fill(dead[None, :], 0), f.name, per_channel, margin, pow2)
        quantizer = DualPrecisionQuantizer(s_w, f.name, grid, scale_method, clip, nearest)
    res = gptq_quantize(
        W,
        H,
        grid,
        group_size,
        perm=perm,
        block_size=block_size,
        percdamp=percdamp,
        dtype=dtype,
        quantizer=quantizer,
    )
    if not isinstance(quantizer, DualPrecisionQuantizer):
        return _naive_result(res, W, H, f.name, per_channel, margin, pow2)
    return _dual_result(res, quantizer, f.name, nearest)


def _naive_result(
    res: QuantResult, W: torch.Tensor, H: torch.Tensor, fmt: str, per_channel: bool, margin: float, pow2: bool
) -> DPQResult:
    """The "naive GPTQ" baseline (§4.2, Table 2): FP8 on top of the INT4 GPTQ result ``res``, with
    ``step_errors`` those of the inference weight ``ŵ_8 s_w`` (GPTQ's describe the INT4 weight)."""
    out = fp8_on_top(res, fmt, per_channel, margin, pow2)
    # GPTQ's step errors describe the INT4 weight; report the inference weight's error
    Hd = res.damped_hessian(H)
    W0 = W.to(Hd.dtype).masked_fill((torch.diagonal(H) == 0)[None, :], 0)
    out.step_errors = hessian_error(W0, out.dequantize(Hd.dtype), Hd)
    return out


def _dual_result(res: QuantResult, quantizer: DualPrecisionQuantizer, fmt: str, nearest: bool) -> DPQResult:
    """DPQ's GPTQ result ``res`` (both levels compensated, Eq. 12) with its FP8 weight scale
    ``s_w`` (Eq. 6) and the saturation count of Eq. 7."""
    s_w = quantizer.fp8_scale_rows.reshape(-1, 1)
    return DPQResult(
        codes=res.codes,
        scales=res.scales,
        zeros=res.zeros,
        g_idx=res.g_idx,
        perm=res.perm,
        hessian=res.hessian,
        hessian_diag=res.hessian_diag,
        step_errors=res.step_errors,
        pivots=res.pivots,
        info={
            "fp8_format": fmt,
            "fp8_scale_max": float(s_w.max()),
            "fp8_saturated": int(quantizer.saturated),
            "naive": False,
            "nearest_code": bool(nearest),
        },
        fp8_scale=s_w,
        fmt=fmt,
    )


def fp8_on_top(
    res: QuantResult, fmt: str = "e4m3", per_channel: bool = False, margin: float = 1.0, pow2: bool = False
) -> DPQResult:
    """Any INT result (GPTQ, RTN) made W4A8-FP8-computable without compensation for the FP8 step:
    the "naive" path of :func:`dpq_quantize` and the RTN W4A8 baseline (see :func:`_naive_fp8`)."""
    f = get_float_format(fmt)
    s_w, scales, saturated = _naive_fp8(res, f.name, per_channel, margin, pow2)
    return DPQResult(
        codes=res.codes,
        scales=scales,
        zeros=res.zeros,
        g_idx=res.g_idx,
        perm=res.perm,
        hessian=res.hessian,
        hessian_diag=res.hessian_diag,
        step_errors=None,
        info={
            "fp8_format": f.name,
            "fp8_scale_max": float(s_w.max()),
            "fp8_saturated": saturated,
            "naive": True,
        },
        fp8_scale=s_w,
        fmt=f.name,
    )
