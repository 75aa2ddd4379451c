"""Calibration statistics of a linear layer's input activations.

:class:`ActObserver` sees every calibration batch entering a linear and keeps, per input
channel, ``max|x_j|`` (SmoothQuant's ``max|X_j|``), ``mean|x_j|`` (AWQ's activation magnitude)
and ``mean x_j`` (the SQ-format static-mask statistic), plus what static activation scales need:
the tensor and per-group maxima and, for ``calib="percentile"``, the per-batch percentile of
``|x|`` (averaged over batches -- a percentile of the whole calibration set would need all
activations at once; the per-batch average is the usual streaming estimate).
"""

from __future__ import annotations

import torch

from ..formats.act import ActQuantSpec, scale_from_amax

__all__ = ["ActObserver"]


def _percentile(a: torch.Tensor, q: float, dim: int = -1) -> torch.Tensor:
    """The ``q``-th percentile of ``a`` along ``dim`` (nearest rank; ``kthvalue`` has no size limit)."""
    n = a.shape[dim]
    k = min(n, max(1, int(round(q / 100.0 * n))))
    return a.kthvalue(k, dim=dim).values


class ActObserver:
    """Running input statistics of one linear (``n`` input channels)."""

    def __init__(self, n: int, spec: ActQuantSpec | None = None) -> None:
        self.n = n
        self.spec = spec
        self.tokens = 0
        self.channel_absmax = torch.zeros(n)
        self.channel_abssum = torch.zeros(n, dtype=torch.float64)
        self.channel_sum = torch.zeros(n, dtype=torch.float64)
        self.group_amax: torch.Tensor | None = None
        self.pct_sum: torch.Tensor | None = None
        self.batches = 0

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if x.shape[-1] != self.n:
            raise ValueError(f"observer for {self.n} channels got input with {x.shape[-1]}")
        a = x.abs()
        self.tokens += x.shape[0]
        self.batches += 1
        self.channel_absmax = torch.maximum(self.channel_absmax, a.amax(dim=0).cpu())
        self.channel_abssum += a.sum(dim=0, dtype=torch.float64).cpu()
        self.channel_sum += x.sum(dim=0, dtype=torch.float64).cpu()
        spec = self.spec
        if spec is None or not spec.static:
            return
        if spec.mx is not None:  # NVFP4's calibrated tensor scale: the running maximum (static_minmax)
            return
        if spec.granularity == "group":
            g = spec.group_size
            G = -(-self.n // g)
            pad = G * g - self.n
            ap = torch.nn.functional.pad(a, (0, pad)) if pad else a
            per_group = ap.reshape(-1, G, g).permute(1, 0, 2).reshape(G, -1)
            stat = per_group.amax(dim=1) if spec.calib == "max" else _percentile(per_group, spec.percentile)
            if spec.calib == "max":
                prev = self.group_amax
                self.group_amax = stat.cpu() if prev is None else torch.maximum(prev, stat.cpu())
            else:
                self.pct_sum = stat.cpu() if self.pct_sum is None else self.pct_sum + stat.cpu()
        elif spec.calib == "percentile":
            stat = _percentile(a.reshape(-1), spec.percentile).reshape(1).cpu()
            self.pct_sum = stat if self.pct_sum is None else self.pct_sum + stat

    @property
    def channel_absmean(self) -> torch.Tensor:
        return (self.channel_abssum / max(self.tokens, 1)).float()

    @property
    def channel_mean(self) -> torch.Tensor:
        return (self.channel_sum / max(self.tokens, 1)).float()

    def static_amax(self) -> torch.Tensor:
        """The calibrated ``amax`` of a static spec: ``[1]`` per tensor (and for NVFP4's tensor scale),
        ``[G]`` per group."""
        spec = self.spec
        if spec is None or not spec.static:
            raise ValueError("static_amax needs a static activation spec")
        if self.batches == 0:
            raise ValueError("observer saw no calibration data")
        if spec.calib == "percentile":
            return self.pct_sum / self.batches
        if spec.granularity == "group" and spec.mx is None:
            return self.group_amax
        return self.channel_absmax.amax().reshape(1)

    def static_scale(self) -> torch.Tensor:
        return scale_from_amax(self.static_amax(), self.spec)
