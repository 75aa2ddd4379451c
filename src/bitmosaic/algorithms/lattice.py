"""Overflow-tolerant quantizers built on no-clip GPTQ (Babai paper §5, App. D.1).

Without clipping, back-to-front GPTQ is Babai's nearest plane algorithm and its error obeys the
bound of Theorem 5; clipping breaks that bound.  Two ways to keep small scales *and* no clipping:

- **SSQR** (scale-adjusted SpQR): per-group scales from the MSE search, multiplied by one global
  factor ``alpha``; GPTQ runs without clipping; every integer that lands outside the ``b``-bit grid
  becomes a sparse outlier (stored exactly in CSR, fp16 values) while the dense code keeps the
  clamped value.  ``alpha`` is found by binary search so that the outlier density meets a target
  (Algorithm 9): a larger ``alpha`` widens the grid and lowers the density.  Groups are either the
  paper's static contiguous groups (scales fitted on the original weights before GPTQ; the
  default), or GPTQ's *dynamic* groups: formed
  by processing position under act-order, each scale fitted by MSE on the error-updated weights
  when its group starts, then multiplied by ``alpha``.  That is the grouping and scale choice of
  the GPTQ baseline, so the two differ only in clipping vs sparse outliers.  The Babai bound still
  holds: every no-clip step rounds to the nearest point of a grid of step ``s_j`` (Theorem 5 needs
  nothing else), with ``s_j`` the scale actually used for column ``j``.
- **HPTQ** / **HRTN**: one scalar scale per matrix (or per output row) and unbounded integers from
  no-clip GPTQ (HPTQ, Algorithm 11) or RTN (HRTN, Algorithm 12), Huffman-coded; the scale is found
  by a binary search until the *real* encoded size (stream + code table + row offsets + scales)
  meets a target average bit-width.

The SSQR result's ``info`` (a per-layer row of the run report) has the density reached
(``outlier_rate``), the outlier count, ``alpha`` (``scale_multiplier``) and ``overflow_rate_alpha1``:
the density at ``alpha = 1`` (the MSE scales unchanged, no clipping), the search's first point.

The searches bisect ``log(alpha)``; both quantities are monotone in the scale up to rounding noise,
so the search keeps the best *feasible* point seen (density <= target, bits <= target).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..formats.grid import IntGrid, fp16_ceil
from ..formats.huffman import estimate_bits
from ..formats.layout import default_g_idx
from .gptq import IntColumnQuantizer, gptq_quantize
from .scales import find_scale_zero, group_scale_zero
from .types import QuantResult

__all__ = ["ssqr_quantize", "entropy_coded_quantize", "outlier_density", "order_bound_table"]

# HPTQ/HRTN integers are unbounded; an IntGrid is only used for its arithmetic (clip=False).
_UNBOUNDED = IntGrid(8, symmetric=True)


def outlier_density(codes: torch.Tensor, maxq: int) -> float:
    return float(((codes < 0) | (codes > maxq)).float().mean())


def _bisect_log(f, target: float, lo: float, hi: float, iters: int, tol: float):
    """Bisection on ``log(x)`` for ``f(x)`` just below ``target`` (``f`` decreasing, ``f(x)[0]`` the value).

    Returns every evaluation ``{x: f(x)}``; stops once a value lands in ``[target (1 - tol), target]``.
    """
    evals = {}

    def ev(x):
        if x not in evals:
            evals[x] = f(x)
        return evals[x]

    # widen the bracket until it straddles the target
    for _ in range(30):
        if ev(lo)[0] >= target:
            break
        lo /= 2
    for _ in range(30):
        if ev(hi)[0] <= target:
            break
        hi *= 2
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        val = ev(mid)[0]
        if target * (1 - tol) <= val <= target:  # feasible and close enough
            break
        if val > target:
            lo = mid
        else:
            hi = mid
    return evals


def _pick_feasible(evals: dict, target: float):
    """The evaluation closest to the target from below (or the lowest one if none is below)."""
    feasible = [(v[0], x) for x, v in evals.items() if v[0] <= target]
    if feasible:
        _, x = max(feasible)
    else:
        _, x = min((v[0], x) for x, v in evals.items())
    return x, evals[x]


@dataclass(frozen=True)
class _WidenedMSE(IntColumnQuantizer):
    """GPTQ's dynamic-group step with MSE scales widened by SSQR's global factor ``alpha``."""

    alpha: float = 1.0

    def fit(self, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, z = find_scale_zero(cols, self.grid, "mse")
        return fp16_ceil(s * self.alpha), z


SSQR_GROUPS = ("dynamic", "static")


def ssqr_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    bits: int,
    group_size: int | None,
    outlier_rate: float,
    *,
    perm: torch.Tensor | None = None,
    symmetric: bool = False,
    percdamp: float = 0.01,
    max_iter: int = 10,
    tol: float = 0.1,
    groups: str = "static",
) -> QuantResult:
    """SSQR: dense ``bits``-bit codes + sparse exact outliers at density ``<= outlier_rate``.

    ``groups="static"`` is the paper's Algorithm 9 (contiguous groups, MSE scales of the original
    weights x ``alpha``); ``"dynamic"`` uses GPTQ's dynamic groups (module doc).
    """
    if not 0 < outlier_rate < 0.5:
        raise ValueError(f"outlier rate must be in (0, 0.5), got {outlier_rate}")
    if groups not in SSQR_GROUPS:
        raise ValueError(f"SSQR groups must be one of {SSQR_GROUPS}, got {groups!r}")
    grid = IntGrid(bits, symmetric)
    W = W.float()
    if groups == "static":
        S0, Z0 = group_scale_zero(W, grid, group_size, "mse")

    def run(alpha: float):
        if groups == "static":
            s = fp16_ceil(S0 * alpha)
            res = gptq_quantize(
                W, H, grid, group_size, perm=perm, clip=False, scales=s, zeros=Z0, percdamp=percdamp
            )
        else:
            q = _WidenedMSE(grid, "mse", clip=False, alpha=alpha)
            res = gptq_quantize(W, H, grid, group_size, perm=perm, quantizer=q, percdamp=percdamp)
        return outlier_density(res.codes, grid.maxq), res

    evals = _bisect_log(run, outlier_rate, 1.0, 1.0, max_iter, tol)  # evaluates alpha = 1 first
    alpha, (density, res) = _pick_feasible(evals, outlier_rate)
    noclip = res.dequantize(torch.float32)
    over = (res.codes < 0) | (res.codes > grid.maxq)
    res.codes = res.codes.clamp(0, grid.maxq)
    dense = res.dequantize(torch.float32)
    sparse = torch.zeros_like(dense)
    sparse[over] = (noclip - dense)[over].half().float()  # fp16 outlier values, as stored
    res.sparse = sparse
    res.info = {
        "scale_multiplier": alpha,
        "outlier_rate": density,
        "outliers": int(over.sum()),
        # the overflow of no-clip GPTQ on the MSE scales themselves (alpha = 1, Algorithm 9's
        # starting point, before any search): the share of weights that land off the b-bit grid
        # after the error updates -- what a clipping GPTQ on those scales would clip instead
        # (up to the updates, which clipping changes)
        "overflow_rate_alpha1": evals[1.0][0],
        "search_evals": len(evals),
        "ssqr_groups": groups,
    }
    return res


def entropy_coded_quantize(
    W: torch.Tensor,
    H: torch.Tensor | None,
    target_bits: float,
    *,
    scale_per: str = "matrix",
    use_gptq: bool = True,
    perm: torch.Tensor | None = None,
    percdamp: float = 0.01,
    max_iter: int = 12,
    tol: float = 0.005,
) -> QuantResult:
    """HPTQ (``use_gptq=True``) / HRTN: one scale per matrix or row, Huffman-coded integers.

    The returned result's ``info`` has the measured ``encoded_bits_per_weight`` (stream, code table,
    row offsets and the fp16 scales).
    """
    if scale_per not in ("matrix", "row"):
        raise ValueError(f"scale_per must be 'matrix' or 'row', got {scale_per!r}")
    if use_gptq and H is None:
        raise ValueError("HPTQ needs a Hessian; use HRTN (use_gptq=False) without calibration")
    W = W.float()
    out, n = W.shape
    base = W.abs().amax(dim=1, keepdim=True) if scale_per == "row" else W.abs().amax().expand(out, 1)
    base = base.clamp(min=1e-8)
    n_scales = out if scale_per == "row" else 1
    zeros = torch.zeros(out, 1, device=W.device)
    g_idx = default_g_idx(n, None, device=W.device)

    def quantize(c: float) -> QuantResult:
        s = fp16_ceil(base * c)
        if use_gptq:
            return gptq_quantize(
                W, H, _UNBOUNDED, None, perm=perm, clip=False, scales=s, zeros=zeros, percdamp=percdamp
            )
        return QuantResult(torch.round(W / s).to(torch.int32), s, zeros.clone(), g_idx)

    def bits_of(res: QuantResult) -> float:
        lo, hi = int(res.codes.min()), int(res.codes.max())
        if lo < -32768 or hi > 32767:
            return float("inf")  # the table stores 16-bit symbols: scale too small
        return (estimate_bits(res.codes.cpu().numpy()) + 16 * n_scales) / (out * n)

    def rtn_bits(c):
        r = QuantResult(torch.round(W / fp16_ceil(base * c)).to(torch.int32), base, zeros, g_idx)
        return bits_of(r), None

    # Bracket with cheap RTN, then refine with the real quantizer near the RTN solution.
    rtn_evals = _bisect_log(rtn_bits, target_bits, 2.0**-6, 2.0**-1, 30, tol / 4)
    c0, _ = _pick_feasible(rtn_evals, target_bits)

    def real(c):
        r = quantize(c)
        return bits_of(r), r

    if use_gptq:
        evals = _bisect_log(real, target_bits, c0 / 1.25, c0 * 1.25, max_iter, tol)
    else:
        evals = {c0: real(c0)}
    c, (bpw, res) = _pick_feasible(evals, target_bits)
    res.info = {"scale_multiplier": c, "encoded_bits_per_weight": bpw, "search_evals": len(evals)}
    return res


def order_bound_table(
    W: torch.Tensor,
    H: torch.Tensor,
    grid: IntGrid,
    group_size: int | None,
    orders: tuple[str, ...] = ("natural", "act", "min-pivot"),
    *,
    percdamp: float = 0.01,
    scale_method: str = "mse",
) -> dict[str, dict[str, float]]:
    """The Babai bound ``1/4 sum D_jj s_j^2`` and the measured no-clip GPTQ error per order.

    All orders use the same static scales, so differences come from ``D`` alone (paper §4.5,
    App. C.3); ``trace_D`` is the scale-free proxy the paper tabulates.  ``D`` is GPTQ's own
    factorisation (``QuantResult.pivots``, processing order), not a second one.
    """
    from .bounds import hessian_error
    from .hessian import damp_hessian
    from .orders import make_order

    W64 = W.double()
    Hd = damp_hessian(H.double(), percdamp)[0]
    s, z = group_scale_zero(W64, grid, group_size, scale_method)
    g = default_g_idx(W.shape[1], group_size, device=W.device)
    table = {}
    for order in orders:
        perm = make_order(Hd, order, group_size)
        res = gptq_quantize(W64, Hd, grid, group_size, perm=perm, clip=False, scales=s, zeros=z, percdamp=0.0)
        D = res.pivots  # processing order
        table[order] = {
            "bound": float(0.25 * (s[:, g][:, perm] ** 2 * D[None, :]).sum()),
            "noclip_error": float(hessian_error(W64, res.dequantize(torch.float64), Hd).sum()),
            "trace_D": float(D.sum()),
        }
    return table
