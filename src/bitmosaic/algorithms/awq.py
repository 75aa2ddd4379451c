"""AWQ (Lin et al., 2024), weight-only, as pure tensor functions.

AWQ §3.2 "searching to scale": the salient input channels (large average activation) are
protected by scaling their weight columns up before quantization and the activations down,
``Q(W diag(s)) diag(s)^-1 X``.  The scales are searched over a one-parameter family

    s = x_absmean^r / w_mag^(1-r)   (duo scaling)   or   s = x_absmean^r,   r in [0, 1),

keeping the ``r`` with the smallest output error.  A second search (the clip search) then shrinks
the per-group quantization range of the scaled weights, again scored by output error.

Here both searches score candidates with a Hessian ``H`` instead of stored activations:
for ``H = c * X^T X``, ``trace(E H E^T) = c * ||X E^T||_F^2`` is exactly (up to ``c``) the summed
squared output error over all calibration tokens of the weight error ``E``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..formats.grid import IntGrid, dequantize_codes, quantize_codes
from ..formats.layout import normalize_group_size, num_groups
from .scales import range_scale_zero

__all__ = ["AWQSearch", "awq_clip_search", "awq_search_scales", "awq_weight_magnitude"]


def _group_slices(n: int, group_size: int | None) -> list[slice]:
    g = normalize_group_size(group_size, n)
    return [slice(k * g, min((k + 1) * g, n)) for k in range(num_groups(n, group_size))]


def awq_weight_magnitude(weights: Sequence[torch.Tensor], group_size: int | None) -> torch.Tensor:
    """AWQ's normalised weight magnitude per input channel (Lin et al. 2024, §3.2) -> ``[n]``.

    Each ``|W_ij|`` is divided by the largest ``|W|`` of its row within its (contiguous) group
    (``group_size=None``: the whole row), then averaged over all rows of all ``weights``.  Values
    lie in ``[0, 1]``; a group that is entirely zero contributes 0.  Returned in float64.
    """
    if len(weights) == 0:
        raise ValueError("need at least one weight matrix")
    n = weights[0].shape[1]
    total = torch.zeros(n, dtype=torch.float64, device=weights[0].device)
    rows = 0
    for W in weights:
        if W.dim() != 2 or W.shape[1] != n:
            raise ValueError(f"every weight must be [out, {n}], got {tuple(W.shape)}")
        A = W.detach().to(torch.float64).abs()
        for sl in _group_slices(n, group_size):
            block = A[:, sl]
            gmax = block.amax(dim=1, keepdim=True)
            norm = torch.where(gmax > 0, block / gmax.clamp(min=torch.finfo(torch.float64).tiny), 0.0)
            total[sl] += norm.sum(dim=0)
        rows += W.shape[0]
    return total / rows


def _hessian_loss(
    weights: Sequence[torch.Tensor],
    H: torch.Tensor,
    s: torch.Tensor,
    quantize_w: Callable[[torch.Tensor], torch.Tensor] | Sequence[Callable[[torch.Tensor], torch.Tensor]],
) -> float:
    """``sum_i trace(E_i H E_i^T)``, ``E_i = W_i - Q_i(W_i * s) / s`` (all float64); ``quantize_w``
    is one quantizer for all weights or one per weight."""
    qs = [quantize_w] * len(weights) if callable(quantize_w) else list(quantize_w)
    if len(qs) != len(weights):
        raise ValueError(f"got {len(qs)} weight quantizers for {len(weights)} weights")
    total = 0.0
    for W, q in zip(weights, qs, strict=True):
        Wq = q(W * s).to(torch.float64) / s
        E = W - Wq
        total += float(((E @ H) * E).sum())
    return total


@dataclass
class AWQSearch:
    """Result of :func:`awq_search_scales`.

    ``scales``: ``[n]`` (all ones when the identity was kept); ``ratio``: the chosen ``r`` or
    None for the identity; ``losses``: Hessian loss per ``r``; ``identity_loss``: loss at ``s=1``.
    """

    scales: torch.Tensor
    ratio: float | None
    losses: dict[float, float] = field(default_factory=dict)
    identity_loss: float = float("inf")


def awq_search_scales(
    x_absmean: torch.Tensor,
    weights: Sequence[torch.Tensor],
    H: torch.Tensor,
    quantize_w: Callable[[torch.Tensor], torch.Tensor] | Sequence[Callable[[torch.Tensor], torch.Tensor]],
    n_grid: int = 20,
    duo_scaling: bool = True,
    *,
    group_size: int | None = None,
) -> AWQSearch:
    """AWQ's activation-aware scale search (Lin et al. 2024, §3.2 "searching to scale").

    For ``r = i / n_grid`` (``i = 0 .. n_grid-1``) the candidate is
    ``s = x_absmean^r / (w_mag^(1-r) + 1e-4)`` (``duo_scaling``; ``w_mag`` from
    :func:`awq_weight_magnitude` with ``group_size``) or ``s = x_absmean^r``, clamped to
    ``>= 1e-4`` and normalised by ``sqrt(max(s) * min(s))``.  Its loss is
    ``sum_i trace(E_i H E_i^T)`` with ``E_i = W_i - quantize_w(W_i * s) / s``: for
    ``H = c * X^T X`` this is exactly ``c`` times the summed squared output error over all
    calibration tokens, so no activations need storing (``quantize_w`` may also be a sequence, one
    quantizer per weight: SFMP's per-linear mixed-width permuted quantizers).  The identity
    ``s = 1`` is evaluated too and returned (``ratio=None``) when strictly best, so the result never
    loses to plain RTN.

    ``x_absmean``: ``[n]`` mean ``|x|`` per input channel; ``weights``: the ``[out_i, n]``
    linears sharing that input (their losses are summed); ``quantize_w``: weight -> its
    fake-quantized version.  Computed in float64; ``scales`` returned in ``x_absmean``'s dtype.
    """
    if n_grid < 1:
        raise ValueError(f"n_grid must be >= 1, got {n_grid}")
    if len(weights) == 0:
        raise ValueError("need at least one weight matrix")
    H64 = H.detach().to(torch.float64)
    dev = H64.device
    W64 = [W.detach().to(device=dev, dtype=torch.float64) for W in weights]
    x = x_absmean.detach().to(device=dev, dtype=torch.float64).abs()
    if x.shape != (H64.shape[0],) or any(W.shape[1] != x.numel() for W in W64):
        raise ValueError("x_absmean, H and the weights' input dimension must agree")
    w_mag = awq_weight_magnitude(W64, group_size) if duo_scaling else None

    ones = torch.ones_like(x)
    identity_loss = _hessian_loss(W64, H64, ones, quantize_w)
    losses: dict[float, float] = {}
    best_ratio: float | None = None
    best_loss = float("inf")
    best_s = ones
    for i in range(n_grid):
        r = i / n_grid
        if w_mag is not None:
            s = x.pow(r) / (w_mag.pow(1.0 - r) + 1e-4)
        else:
            s = x.pow(r)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        loss = _hessian_loss(W64, H64, s, quantize_w)
        losses[r] = loss
        if loss < best_loss:  # strict: ties keep the smaller ratio
            best_ratio, best_loss, best_s = r, loss, s
    # Our decision (AutoAWQ always applies the best searched ratio): keep the identity when it
    # is strictly better, so on this objective AWQ is never worse than plain RTN.
    if best_ratio is None or identity_loss < best_loss:
        best_ratio, best_s = None, ones
    return AWQSearch(
        scales=best_s.to(x_absmean.dtype), ratio=best_ratio, losses=losses, identity_loss=identity_loss
    )


def awq_clip_search(
    W: torch.Tensor,
    H: torch.Tensor,
    grid: IntGrid,
    group_size: int | None,
    n_grid: int = 20,
    max_shrink: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ's clipping-range search (Lin et al. 2024, §3.2), scored by the group's output error.

    For every row and contiguous group the candidates are ``m = amax|w_g| * (1 - i/n_grid)``,
    ``i = 0 .. int(max_shrink * n_grid) - 1``; the range becomes ``[max(min, -m), min(max, m)]``
    mapped onto ``grid`` by :func:`~bitmosaic.algorithms.scales.range_scale_zero` (fp16-exact
    scales).  A candidate is scored by ``e H_gg e^T`` with ``e = w_g - Q(w_g)`` (codes clipped
    to ``0..maxq``) and ``H_gg`` the group's diagonal block of ``H``: for ``H = c * X^T X`` that
    is the squared error of the group's partial output summed over tokens, which is what AWQ's
    clip search measures per group.  ``i = 0`` is the min-max range, so no (row, group) ends up
    worse than min-max.  Returns ``(scales, zeros)``, each ``[out, G]``.
    """
    if W.dim() != 2 or H.shape != (W.shape[1], W.shape[1]):
        raise ValueError(f"W must be [out, n] and H [n, n], got {tuple(W.shape)} and {tuple(H.shape)}")
    out_dtype = W.dtype if W.dtype in (torch.float32, torch.float64) else torch.float32
    W64 = W.detach().to(torch.float64)
    H64 = H.detach().to(device=W64.device, dtype=torch.float64)
    slices = _group_slices(W64.shape[1], group_size)
    n_cand = max(1, int(max_shrink * n_grid))
    scales = W64.new_empty(W64.shape[0], len(slices))
    zeros = W64.new_empty(W64.shape[0], len(slices))
    for k, sl in enumerate(slices):
        w = W64[:, sl]
        Hgg = H64[sl, sl]
        wmin, wmax = w.amin(dim=1), w.amax(dim=1)
        amax = w.abs().amax(dim=1)
        best = torch.full_like(amax, float("inf"))
        best_scale = torch.empty_like(amax)
        best_zero = torch.empty_like(amax)
        for i in range(n_cand):
            m = amax * (1.0 - i / n_grid)
            sc, z = range_scale_zero(torch.maximum(wmin, -m), torch.minimum(wmax, m), grid)
            q = dequantize_codes(
                quantize_codes(w, sc[:, None], z[:, None], grid.maxq), sc[:, None], z[:, None]
            )
            e = w - q
            err = ((e @ Hgg) * e).sum(dim=1)
            better = torch.ones_like(err, dtype=torch.bool) if i == 0 else err < best
            best = torch.where(better, err, best)
            best_scale = torch.where(better, sc, best_scale)
            best_zero = torch.where(better, z, best_zero)
        scales[:, k], zeros[:, k] = best_scale, best_zero
    return scales.to(out_dtype), zeros.to(out_dtype)
