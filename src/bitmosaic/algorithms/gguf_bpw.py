"""A GGUF type per tensor under a bits-per-weight budget, by measured salience (issue 72, item 4; the role of
llama-quantize's target-bpw and AutoRound's AutoScheme).

Each candidate type's cost is its exact storage (``gguf.GGML_QUANT_SIZES``: bytes per block, e.g. Q4_K 4.5
bits a weight, IQ4_XS 4.25, Q8_0 8.5).  Its damage is measured on the tensor: the salience-weighted squared
error ``sum(S * (W - Q_T(W))**2)`` of the type's own rounding of the float weights -- ``S`` the Fisher
diagonal (SFMP's salience, Nie et al. §4.1: the second-order loss change of a weight perturbation), ``Q_T``
the k-quant fit of :mod:`.gguf_kquants`, the IQ4 scale search of :mod:`.gguf_grid` with its nearest
indices, or the ``gguf`` package's own rounding for the legacy 32-blocks.  :func:`allocate` then spends the
budget greedily on the lower convex hull of each tensor's (bits, error) points: every tensor starts at its
cheapest type, and the upgrade with the largest error drop per added bit is taken while the total stays
within the budget (the Lagrangian solution of the knapsack on the hull, as in mixed-precision bit
allocation), so the result never exceeds it.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from ..formats import gguf_iq as iq
from . import gguf_kquants as kq

__all__ = ["type_bits", "rounded", "type_errors", "allocate"]


def type_bits(typ: str) -> float:
    """Stored bits per weight of GGUF type ``typ``."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[typ]]
    return 8 * size / block


def rounded(W: torch.Tensor, typ: str) -> torch.Tensor:
    """``W`` ``[out, in]`` as type ``typ`` stores it, rounded from the float weights (no calibration)."""
    W = W.float()
    if typ in kq.K_TYPES:
        return kq.dequantize(kq.fit_weights(W, kq.K_TYPES[typ]), kq.K_TYPES[typ])
    if typ in iq.IQ_TYPES:
        from .gguf_grid import iq_scales

        t = iq.IQ_TYPES[typ]
        d, l = iq_scales(W, torch.ones(W.shape[1]), t)
        dl = (d.float().repeat_interleave(t.nsub, dim=1) * l.float()).repeat_interleave(iq.SUB, dim=1)
        kv = iq.grid(W.device, torch.float32)
        y = torch.where(dl != 0, W / torch.where(dl != 0, dl, 1), 0)
        return dl * kv[torch.bucketize(y.contiguous(), (kv[1:] + kv[:-1]) / 2)]  # the nearest grid value
    from gguf import quants

    qt = quants.GGMLQuantizationType[typ]
    data = quants.quantize(W.numpy(), qt)
    return torch.from_numpy(np.asarray(quants.dequantize(data, qt), dtype=np.float32).reshape(W.shape))


def type_errors(W: torch.Tensor, S: torch.Tensor, types) -> dict[str, float]:
    """``{type: sum(S * (W - rounded(W, type))**2)}`` for the candidate ``types``."""
    W, S = W.detach().float().cpu(), S.detach().float().cpu()
    return {t: float((S * (W - rounded(W, t)) ** 2).sum()) for t in types}


def _hull(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The lower convex hull of ``(bits, error, type)`` points, cheapest first, error falling."""
    pts = sorted(points)
    out: list[tuple[float, float, str]] = []
    for p in pts:
        if out and p[1] >= out[-1][1]:
            continue  # costs more and is no better
        while len(out) >= 2:
            (b0, e0, _), (b1, e1, _) = out[-2], out[-1]
            if (e0 - e1) * (p[0] - b1) <= (e1 - p[1]) * (b1 - b0):  # the middle point is not convex
                out.pop()
            else:
                break
        out.append(p)
    return out


def allocate(costs: dict[str, dict[str, tuple[float, float]]], budget_bits: float) -> dict[str, str]:
    """``{tensor: type}`` with total bits <= ``budget_bits``: ``costs[tensor][type] = (bits, error)`` (the
    tensor's total stored bits and its measured error as that type); module doc.  Raises ``ValueError``
    when even the cheapest types exceed the budget."""
    hulls = {n: _hull([(b, e, t) for t, (b, e) in c.items()]) for n, c in costs.items()}
    at = dict.fromkeys(hulls, 0)
    total = sum(h[0][0] for h in hulls.values())
    if total > budget_bits:
        raise ValueError(f"the cheapest types need {total:.0f} bits, over the budget of {budget_bits:.0f}")
    heap: list[tuple[float, str]] = []

    def push(n):
        h, i = hulls[n], at[n]
        if i + 1 < len(h):
            (b0, e0, _), (b1, e1, _) = h[i], h[i + 1]
            heapq.heappush(heap, (-(e0 - e1) / (b1 - b0), n))

    for n in hulls:
        push(n)
    while heap:
        _, n = heapq.heappop(heap)
        h, i = hulls[n], at[n]
        step = h[i + 1][0] - h[i][0]
        if total + step <= budget_bits:
            total += step
            at[n] = i + 1
            push(n)
    return {n: hulls[n][at[n]][2] for n in hulls}
