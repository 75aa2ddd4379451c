"""The run report of the calibration pipeline: one row per quantized linear plus totals.

Per row (see the README): ``rel_out_error`` = ``‖XWᵀ−XŴᵀ‖²/‖XWᵀ‖²`` on the calibration inputs
(undamped ``H``), ``hessian_error`` = ``Σ_rows (w−ŵ)ᵀ H_d (w−ŵ)`` with the damped ``H_d`` the solver
used, ``babai_bound`` = ``¼ Σ D_kk s_k²`` (Babai paper Thm. 5) for no-clip-capable orders.

What a solver already computed is reused rather than recomputed: GPTQ's step errors *are*
``(w−ŵ)ᵀ H_d (w−ŵ)`` per row (GPTQ paper Eq. 3; Babai paper Lemma 2) and its Cholesky pivots are
the LDL diagonal ``D`` of the bound, so a GPTQ row costs one float32 matmul (the denominator
``w H wᵀ``) instead of a float64 recomputation and a second factorisation.
"""

from __future__ import annotations

import resource
import statistics
from dataclasses import dataclass, field

import torch

from ..algorithms.bounds import babai_bound
from ..algorithms.hessian import damp_hessian
from ..algorithms.types import QuantResult

__all__ = ["RunReport", "peak_rss_mb", "error_metrics", "ERROR_METRICS", "expert_summary", "expert_lines"]

# the per-linear error columns of a report row (module doc); ``None`` where a run did not measure them
ERROR_METRICS = ("rel_out_error", "hessian_error", "babai_bound")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclass
class RunReport:
    method: str
    config: dict
    layers: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    peak_device_mb: float | None = None
    device: str = "cpu"
    bits_per_weight: float = 0.0
    calibration: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "config": self.config,
            "calibration": self.calibration,
            "device": self.device,
            "seconds": self.seconds,
            "peak_rss_mb": self.peak_rss_mb,
            "peak_device_mb": self.peak_device_mb,
            "bits_per_weight": self.bits_per_weight,
            "layers": self.layers,
        }


def expert_summary(rows: list[dict], settings) -> dict | None:
    """The mixture-of-experts part of a report (``calibration["experts"]``), read from the rows of the
    expert projections (``expert_tokens``, ``expert_fallback``; so a resumed streamed run has it too):
    the run's ``moe_*`` settings, per MoE layer the experts and the min/median/max calibration rows
    routed to one (``'all'``: every row), and each expert that fell back with its rule.  ``None`` when
    no row is an expert's (a dense model, or a run that did not calibrate)."""
    layers: dict[str, dict[int, int]] = {}
    fell: dict[str, dict] = {}
    for row in rows:
        if "expert_tokens" not in row:
            continue
        expert, proj = row["name"].rsplit(".", 1)
        layer, index = expert.rsplit(".", 1)
        layers.setdefault(layer, {}).setdefault(int(index), row["expert_tokens"])
        if "expert_fallback" in row:
            entry = fell.setdefault(expert, {"expert": expert, "tokens": row["expert_tokens"],
                                             "rule": row["expert_fallback"], "linears": []})  # fmt: skip
            entry["linears"].append(proj)
    if not layers:
        return None
    per_layer = {}
    for name, counts in layers.items():
        t = sorted(counts.values())
        per_layer[name] = {"experts": len(t), "min": t[0], "median": statistics.median(t), "max": t[-1]}
    return {
        "calib": settings.moe_calib,
        "min_tokens": settings.moe_min_tokens,
        "fallback_rule": settings.moe_fallback,
        "layers": per_layer,
        "fallback": list(fell.values()),
    }


def expert_lines(summary: dict | None, most: int = 20) -> list[str]:
    """What ``bitmosaic quantize`` prints of :func:`expert_summary` (at most ``most`` fallback lines)."""
    if not summary:
        return []
    out = [f"experts ({summary['calib']} statistics): calibration rows per expert, min/median/max"]
    for name, s in summary["layers"].items():
        out.append(f"  {name}: {s['experts']} experts, {s['min']}/{s['median']:g}/{s['max']}")
    fell = summary["fallback"]
    if fell:
        out.append(f"{len(fell)} experts under --moe-min-tokens {summary['min_tokens']} fell back:")
        out += [f"  {f['expert']} ({f['tokens']} rows): {f['rule']}" for f in fell[:most]]
        if len(fell) > most:
            out.append(f"  ... {len(fell) - most} more (the --json report lists all)")
    return out


_ROWS = 1 << 22  # elements of an [out, in] temporary at a time (the metrics of a 4096 x 14336
# linear would otherwise take several 0.2-0.5 GB copies)


def _row_chunks(E: torch.Tensor):
    step = max(1, _ROWS // max(E.shape[1], 1))
    return (E[r : r + step] for r in range(0, E.shape[0], step))


def _row_quadratic(E: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """Per-row ``e H eᵀ`` in float32 (float64 inputs stay float64), summed in float64."""
    dt = torch.float64 if E.dtype == torch.float64 or H.dtype == torch.float64 else torch.float32
    H = H.to(dt)
    out = [((e @ H) * e).sum(dim=1, dtype=torch.float64) for e in (c.to(dt) for c in _row_chunks(E))]
    return torch.cat(out) if out else E.new_zeros(0, dtype=torch.float64)


@torch.no_grad()
def hessian_summary(W: torch.Tensor, H: torch.Tensor) -> tuple[float, torch.Tensor]:
    """``(wᵀ H w summed over rows, diag H)``: what :func:`error_metrics` reads of ``H`` for a result
    that carries its step errors (GPTQ's), taken before a solve that overwrites ``H``."""
    H = H.to(W.device)
    return float(_row_quadratic(W, H).sum()), torch.diagonal(H).clone()


def error_metrics(
    W: torch.Tensor,
    Wq: torch.Tensor,
    H: torch.Tensor | None,
    res: QuantResult,
    percdamp: float,
    summary: tuple[float, torch.Tensor] | None = None,
) -> dict:
    """``rel_out_error``, ``hessian_error`` and ``babai_bound`` of one linear (module doc).
    ``summary``: :func:`hessian_summary` of ``W`` and ``H``, taken before ``H`` was overwritten;
    ``H`` is then not read (``None`` allowed) unless the result lacks its step errors."""
    den, diag = summary if summary is not None else hessian_summary(W, H)
    dead = diag == 0
    wide = torch.float64 if W.dtype == torch.float64 else torch.float32

    def diff(a: int | None = None, b: int | None = None) -> torch.Tensor:  # W - Wq, rows a:b
        return W[a:b].to(wide) - Wq[a:b].to(wide)

    step = max(1, _ROWS // max(W.shape[1], 1))
    blocks = [(r, r + step) for r in range(0, W.shape[0], step)]  # memory: no full-size difference
    step_errors = getattr(res, "step_errors", None)
    Hd, Hd_diag = None, getattr(res, "hessian_diag", None) if res.hessian is None else None

    def damped():
        if H is None and res.hessian is None:
            raise RuntimeError("internal: error metrics need the Hessian the solve overwrote")
        Hd = res.damped_hessian(H) if hasattr(res, "damped_hessian") else res.hessian
        if Hd is None:
            Hd = damp_hessian(H.float() if H.dtype != torch.float64 else H, percdamp)[0]
        return Hd.to(W.device)

    if Hd_diag is None or step_errors is None or getattr(res, "sparse", None) is not None:
        Hd = damped()  # the whole damped matrix (GPTQ's results keep only its diagonal: 0.8 GB at 14336)
        Hd_diag = torch.diagonal(Hd)
    if step_errors is not None and getattr(res, "sparse", None) is None:
        # step errors were measured on W with dead columns zeroed: (w_z - ŵ)ᵀ H_d (w_z - ŵ)
        hess = float(step_errors.double().sum())
        lam = (Hd_diag.to(W.device, torch.float64) - diag.to(torch.float64)).masked_fill(dead, 0)
        # the undamped H is zero on dead columns (lam masks them), so they add nothing to the output error
        colsq = sum(diff(a, b).square().sum(dim=0, dtype=torch.float64) for a, b in blocks)
        num = hess - float((colsq * lam).sum())
    else:
        E = diff()
        hess = float(_row_quadratic(E, Hd).sum())
        num = float(_row_quadratic(E, H.to(W.device)).sum())
        del E
    bound = None
    pivoted = getattr(res, "perm", None) is not None and getattr(res, "pivots", None) is not None
    if pivoted and _plain_lattice(res):
        # the base lattice (group scales per column), built a row block at a time
        perm = res.perm.to(res.scales.device)
        g_idx = res.g_idx.to(res.scales.device).long()
        piv = res.pivots.to(device=res.scales.device, dtype=torch.float64)[None, :]
        bound = 0.0
        for a, b in blocks:
            s = res.scales[a:b][:, g_idx].to(torch.float64)[:, perm]
            bound += float(0.25 * (s * s * piv).sum())
        return _metrics(num, den, hess, bound)
    lattice = res.lattice_scales() if hasattr(res, "lattice_scales") else None
    if getattr(res, "perm", None) is not None and lattice is not None:
        if getattr(res, "pivots", None) is not None:
            perm = res.perm.to(lattice.device)
            piv = res.pivots.to(device=lattice.device, dtype=torch.float64)[None, :]
            bound = 0.0
            for c in _row_chunks(lattice):
                s = c.to(torch.float64)[:, perm]
                bound += float(0.25 * (s * s * piv).sum())
        else:
            bound = float(babai_bound((Hd if Hd is not None else damped()).double(), lattice, res.perm).sum())
    return _metrics(num, den, hess, bound)


def _metrics(num: float, den: float, hess: float, bound: float | None) -> dict:
    return {
        "rel_out_error": max(num, 0.0) / den if den > 0 else 0.0,
        "hessian_error": hess,
        "babai_bound": bound,
    }


def _plain_lattice(res) -> bool:
    """``res``'s lattice is :class:`QuantResult`'s own (group scales per column, no override)."""
    return type(res).lattice_scales is QuantResult.lattice_scales and getattr(res, "scales", None) is not None
