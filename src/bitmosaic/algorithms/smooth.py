"""SmoothQuant (Xiao et al., 2023) as pure tensor functions.

SmoothQuant §4 "migrates the quantization difficulty" from activations to weights: a linear
``Y = X W^T`` is rewritten as ``Y = (X diag(s)^-1) (W diag(s))^T`` -- mathematically the same
product -- with per-input-channel smoothing factors (Eq. 4)

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha),

so that outlier channels of ``X`` are divided down and the corresponding weight columns are
multiplied up.  ``alpha`` balances the two (0.5 in the paper for most models).  The division
by ``s`` is folded offline into the op that produces ``X``: the preceding norm's weight
(:func:`fold_scales_into_norm`) or the rows of a preceding linear
(:func:`fold_scales_into_linear_rows`, e.g. ``v_proj -> o_proj``, ``up_proj -> down_proj``).

Rather than fixing ``alpha``, :func:`search_alpha` picks it on calibration data by minimising
the layer's output error after *both* weight and activation quantization.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "SmoothSearch",
    "fold_scales_into_linear_rows",
    "fold_scales_into_norm",
    "gqa_channel_map",
    "search_alpha",
    "shared_scales",
    "smooth_scales",
    "smoothing_loss",
]

DEFAULT_ALPHAS: tuple[float, ...] = tuple(i / 20 for i in range(21))


def _weight_col_absmax(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``max |W_ij|`` over the rows of all ``weights`` (``[out_i, n]`` each) -> ``[n]`` float64."""
    if len(weights) == 0:
        raise ValueError("need at least one weight matrix")
    n = weights[0].shape[1]
    wmax = torch.zeros(n, dtype=torch.float64, device=weights[0].device)
    for W in weights:
        if W.dim() != 2 or W.shape[1] != n:
            raise ValueError(f"every weight must be [out, {n}], got {tuple(W.shape)}")
        wmax = torch.maximum(wmax, W.detach().abs().amax(dim=0).to(torch.float64))
    return wmax


def gqa_channel_map(n_in: int, n_kv_channels: int, head_dim: int) -> torch.Tensor:
    """``[n_in]`` index of the ``v_proj`` output channel each ``o_proj`` input channel is a weighted
    average of, under grouped-query attention: query head ``h`` reads key-value head
    ``h // (n_q / n_kv)`` (transformers' ``repeat_kv``), so input ``h*d + j`` of ``o_proj`` comes from
    channel ``(h // rep)*d + j`` of ``v_proj``.  Factors constant on each class of this map (one per
    ``head_dim`` channel of a key-value head, shared by its query heads) fold exactly into ``v_proj``'s
    rows (issue 73: the MosaicQuant paper migrates the outliers of every linear, §1, Eq. 3)."""
    if head_dim <= 0 or n_kv_channels % head_dim or n_in % n_kv_channels:
        raise ValueError(
            f"o_proj width {n_in} is not a whole number of copies of v_proj's {n_kv_channels} channels "
            f"in heads of {head_dim}"
        )
    rep = n_in // n_kv_channels
    c = torch.arange(n_in)
    return (c // (rep * head_dim)) * head_dim + c % head_dim


def _class_max(x: torch.Tensor, tie: torch.Tensor) -> torch.Tensor:
    """The largest ``x`` (non-negative) over each class of ``tie`` -> ``[classes]``."""
    tie = tie.to(x.device)
    return torch.zeros(int(tie.max()) + 1, dtype=x.dtype, device=x.device).scatter_reduce(0, tie, x, "amax")


def shared_scales(s: torch.Tensor, tie: torch.Tensor, rtol: float = 0.0) -> torch.Tensor:
    """The factors ``t`` (one per class of ``tie``) with ``s == t[tie]``; a ValueError when ``s`` is
    not constant on a class (it could not be folded into the op producing the classes)."""
    tie = tie.to(s.device)
    t = _class_max(s, tie)
    if not torch.allclose(t[tie], s, rtol=rtol, atol=0.0):
        raise ValueError(
            "smoothing factors differ within a group of channels that share one producer channel"
        )
    return t


def smooth_scales(
    act_absmax: torch.Tensor,
    weights: Sequence[torch.Tensor],
    alpha: float,
    eps: float = 1e-5,
    tie: torch.Tensor | None = None,
) -> torch.Tensor:
    """SmoothQuant's per-channel factors (Xiao et al. 2023, §4, Eq. 4) -> ``[n]``.

    ``s_j = act_absmax_j^alpha / wmax_j^(1-alpha)`` with ``wmax_j`` the largest ``|W_ij|`` over
    all ``weights`` sharing this input (e.g. q/k/v after one norm).  Channels where either
    maximum is 0 get ``s_j = 1`` (nothing to migrate); ``s`` is clamped to ``>= eps``.  Computed
    in float64, returned in ``act_absmax``'s dtype.  ``tie`` (``[n]`` class indices, e.g.
    :func:`gqa_channel_map`): one factor per class, from the largest ``act_absmax`` and ``wmax`` over
    its channels (the formula on the class's merged channel), so that ``s`` folds into the producer.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    a = act_absmax.detach().to(torch.float64).abs()
    wmax = _weight_col_absmax(weights).to(a.device)
    if a.shape != wmax.shape:
        raise ValueError(f"act_absmax has shape {tuple(a.shape)}, weights have {wmax.numel()} inputs")
    if tie is not None:
        tie = tie.to(a.device)
        a, wmax = _class_max(a, tie), _class_max(wmax.to(a.dtype), tie)
    s = a.pow(alpha) / wmax.pow(1.0 - alpha)
    dead = (a == 0) | (wmax == 0) | ~torch.isfinite(s)
    s = torch.where(dead, torch.ones_like(s), s).clamp(min=eps)
    if tie is not None:
        s = s[tie]
    return s.to(act_absmax.dtype)


def smoothing_loss(
    X: torch.Tensor,
    weights: Sequence[torch.Tensor],
    s: torch.Tensor,
    quantize_w: Callable[[torch.Tensor], torch.Tensor],
    quantize_x: Callable[[torch.Tensor], torch.Tensor],
    *,
    dtype: torch.dtype = torch.float64,
    reference: Sequence[torch.Tensor] | None = None,
) -> float:
    """``sum_i ||X W_i^T - Q_x(X / s) Q_w(W_i * s)^T||_F^2``, computed in ``dtype``.

    ``X``: ``[t, n]`` calibration activations; ``quantize_w``/``quantize_x`` return the
    fake-quantized (dequantized) weight / activation matrix and may be the identity.  With
    ``s = 1`` this is the unsmoothed W+A quantization error.  ``reference`` may pass the float
    outputs ``X W_i^T`` (in ``dtype``) when the loss is evaluated for many ``s``.
    """
    Xd = X.detach().to(dtype)
    sd = s.detach().to(device=Xd.device, dtype=dtype)
    Xq = quantize_x(Xd / sd).to(dtype)
    total = 0.0
    for i, W in enumerate(weights):
        Wd = W.detach().to(device=Xd.device, dtype=dtype)
        Wq = quantize_w(Wd * sd).to(dtype)
        ref = reference[i] if reference is not None else Xd @ Wd.T
        diff = ref - Xq @ Wq.T
        total += float(diff.pow(2).sum(dtype=torch.float64))
    return total


@dataclass
class SmoothSearch:
    """Result of :func:`search_alpha`: the chosen ``alpha``, its ``scales`` and every loss."""

    alpha: float
    scales: torch.Tensor
    losses: dict[float, float] = field(default_factory=dict)


def search_alpha(
    X: torch.Tensor,
    act_absmax: torch.Tensor,
    weights: Sequence[torch.Tensor],
    quantize_w: Callable[[torch.Tensor], torch.Tensor],
    quantize_x: Callable[[torch.Tensor], torch.Tensor],
    alphas: Sequence[float] = DEFAULT_ALPHAS,
) -> SmoothSearch:
    """Grid-search SmoothQuant's migration strength ``alpha`` (Xiao et al. 2023, §4, Eq. 4).

    Every ``alpha`` gives scales by :func:`smooth_scales`; the one with the smallest
    :func:`smoothing_loss` -- the layer's output MSE on ``X`` after weight AND activation
    quantization, which is what MosaicQuant needs (the paper fixes ``alpha`` per model) -- is
    kept; ties go to the smaller ``alpha``.  ``act_absmax`` is usually ``X.abs().amax(0)``
    but may come from a larger calibration set than the ``X`` used for the loss.
    """
    if len(alphas) == 0:
        raise ValueError("need at least one alpha")
    losses: dict[float, float] = {}
    best_alpha: float | None = None
    best_loss = float("inf")
    best_scales: torch.Tensor | None = None
    # float32 with the float outputs computed once: the losses only need to be compared
    Xf = X.detach().float()
    reference = [Xf @ W.detach().float().T for W in weights]
    for alpha in sorted(float(a) for a in alphas):
        s = smooth_scales(act_absmax, weights, alpha)
        loss = smoothing_loss(X, weights, s, quantize_w, quantize_x, dtype=torch.float32, reference=reference)
        losses[alpha] = loss
        if best_alpha is None or loss < best_loss:
            best_alpha, best_loss, best_scales = alpha, loss, s
    assert best_alpha is not None and best_scales is not None
    return SmoothSearch(alpha=best_alpha, scales=best_scales, losses=losses)


def fold_scales_into_norm(norm_weight: torch.Tensor, s: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """New norm weight whose output is the old output divided by ``s`` (SmoothQuant §4).

    The norm multiplies by ``offset + w`` (``offset = 1`` for Gemma-style RMSNorm, 0 otherwise),
    so the new weight is ``(offset + w) / s - offset``.  A norm bias, if any, must be divided by
    ``s`` too (not handled here).
    """
    w = norm_weight.detach().to(torch.float64)
    s64 = s.detach().to(device=w.device, dtype=torch.float64)
    return ((offset + w) / s64 - offset).to(norm_weight.dtype)


def fold_scales_into_linear_rows(
    W_prev: torch.Tensor, b_prev: torch.Tensor | None, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Divide the output rows of the linear feeding the smoothed input by ``s`` (SmoothQuant §4).

    ``W_prev``: ``[n, k]`` (``n`` = the smoothed channels), ``b_prev``: ``[n]`` or None.  Used
    when the producer is a linear with nothing nonlinear in between (``v_proj -> o_proj`` through
    the attention average; ``up_proj -> down_proj`` through the gate's elementwise product).
    """
    if W_prev.dim() != 2 or W_prev.shape[0] != s.numel():
        raise ValueError(f"W_prev must be [{s.numel()}, k], got {tuple(W_prev.shape)}")
    s64 = s.detach().to(device=W_prev.device, dtype=torch.float64)
    W_new = (W_prev.detach().to(torch.float64) / s64[:, None]).to(W_prev.dtype)
    b_new = None if b_prev is None else (b_prev.detach().to(torch.float64) / s64).to(b_prev.dtype)
    return W_new, b_new
