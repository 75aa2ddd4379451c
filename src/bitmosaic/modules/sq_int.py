"""SQ-format activations in integers on the CPU: :class:`SQIntKernel`, the integer path of
:class:`~bitmosaic.modules.sq.SQActLinear` (its own module so that ``sq.py`` stays the layer; Huang et
al., the SQ-format paper §3-4: the dense low-precision and sparse high-precision parts, here both INT)."""

from __future__ import annotations

import torch

from ..algorithms.sq import dynamic_split
from ..formats.sq import MIN_SCALE, fp16_scale
from ..formats.sq_act import act_scale_group
from ..kernels import ops
from .qlinear import QuantLinear

__all__ = ["SQIntKernel"]


class SQIntKernel:
    """``x -> y``: the SQ-format split's INT levels and scales, then each part's levels (int8) times the
    weight codes in int32 per run of one weight group and one activation scale
    (:func:`~bitmosaic.modules.intact.segmented_int_weight`), scaled by ``s_w s_a`` -- up to float32
    rounding the simulated output.  Where the activation scale changes inside a weight group (per-bank
    scales: a static part's runs of 8 channels in groups of 64) the kernel's runs mode
    (:meth:`~bitmosaic.kernels.intmm.IntActWeight.product_runs`) adds each run's int32 sum times its
    scale into one float sum per group and applies the weight scale and zero-point once per group.
    Dynamic: the split is the simulated path's own function
    (:func:`~bitmosaic.algorithms.sq.dynamic_split`), and the low and the high part each multiply every
    column (zeros at the other part's places: two integer products).  Static: each part's channels are
    gathered in stored (high-first) order and quantized there with the same float32 operations as
    :func:`~bitmosaic.formats.sq.sq_quantize` (absmax over the part's channels of each scale group, the
    fp16 scale, round and clamp), so the same integers without building the full-width split; the two
    slices make one product's worth in all (tested equal to the split's levels)."""

    def __init__(self, layer: QuantLinear, parts: dict) -> None:  # an SQActLinear (sq.py)
        parts = dict(parts)
        self.merged = parts.pop("merged", None)  # both static parts as one weight (SQActLinear._int_parts)
        self.layer, self.parts = layer, parts
        K = layer.in_features
        self.n_scales = -(-K // act_scale_group(layer.fmt, K, layer.act_scale, layer.act_group))
        self.perm = None if layer.sq_perm is None else layer.sq_perm.long()
        # static parts: each part's channels (stored order), for the extension's gathered quantization
        self.chan = {} if self.perm is None else {n: self.perm[p[1]].contiguous() for n, p in parts.items()}
        if self.merged is not None:
            self.chan["merged"] = self.perm.contiguous()

    def nbytes(self) -> int:
        merged = 0 if self.merged is None else self.merged[0].nbytes()
        return sum(p[0].nbytes() for p in self.parts.values()) + merged

    @staticmethod
    def _runs(w, run: int) -> tuple[int, int]:
        """``(number of scale runs, their length)`` of a part's weight ``w``."""
        if not run:
            return w.G, w.group_size
        return w.G * w.runs_per_group(run), run

    def static_part(self, x2: torch.Tensor, part: str, w, cols, act_cols, col_act, run: int = 0):
        """``(levels [M, n], scales [M or 1, n_scales])`` of the static ``part`` (``"high"``/``"low"``) of
        ``x2``: its channels in stored order, quantized as :func:`~bitmosaic.formats.sq.sq_quantize` does."""
        m, M = self.layer, x2.shape[0]
        qmax = m.fmt.qmax_high if part == "high" else m.fmt.qmax_low
        xp = x2.index_select(1, self.perm[cols])
        calibrated = m.act_high_scale if part == "high" else m.act_low_scale
        if calibrated is not None:
            s = calibrated.float().reshape(1, -1)
        else:  # absmax of each scale group over this part's channels (runs of one scale: act_cols)
            nruns, length = self._runs(w, run)
            a = torch.nn.functional.pad(xp.abs(), (0, nruns * length - xp.shape[1]))
            runs = a.reshape(M, nruns, length).amax(-1)
            amax = torch.zeros(M, self.n_scales).scatter_reduce_(1, act_cols.expand(M, -1), runs, "amax")
            s = fp16_scale(amax, qmax)
        return torch.round(xp / s.index_select(1, col_act)).clamp_(-qmax, qmax), s

    def static_levels(self, x2: torch.Tensor, part: str, w, act_cols, run: int = 0):
        """:meth:`static_part`'s integers in the extension (``ops.quantize_gathered``): ``(q [M, KP] int8,
        sums [M, runs] int32, scales per run [1 or M, runs], qz [M, G])`` -- the same levels and scales
        (tested), gathered and quantized in one pass over ``x2``.  ``part="merged"``: both parts at once
        (the high part's columns first, its scale columns first), for the merged weight."""
        m, fmt = self.layer, self.layer.fmt
        nruns, length = self._runs(w, run)
        if part == "merged":
            qmax, qmax2, n1, S = fmt.qmax_high, fmt.qmax_low, fmt.high_count(m.in_features), 2 * self.n_scales
            cal = m.act_high_scale, m.act_low_scale
            scales = None if cal[0] is None else torch.cat([c.float().reshape(1, -1) for c in cal], 1)
        else:
            qmax = fmt.qmax_high if part == "high" else fmt.qmax_low
            qmax2, n1, S = qmax, x2.shape[1], self.n_scales
            calibrated = m.act_high_scale if part == "high" else m.act_low_scale
            scales = None if calibrated is None else calibrated.float().reshape(1, -1)
        return ops.quantize_gathered(
            x2, self.chan[part], act_cols, length, S, qmax, qmax2, n1, scales, w.KP, nruns // w.G, MIN_SCALE,
            True,
        )  # fmt: skip

    def _static_int(self, x2: torch.Tensor, part: str, w, act_cols, run: int) -> torch.Tensor:
        q, sums, sa, qz = self.static_levels(x2, part, w, act_cols, run)
        return w.product_runs(q, qz, sa, run) if run else w.product(q, sums, sa, 1)

    def __call__(self, x: torch.Tensor, quantizer=None) -> torch.Tensor:
        m = self.layer
        x2 = x.reshape(-1, m.in_features).float()
        t = dynamic_split(x2, m.fmt, m.act_scale, m.act_group) if m.strategy == "dynamic" else None
        if t is None and self.merged is not None:  # both static parts in one product
            w, _, act_cols, _, run = self.merged
            y = self._static_int(x2, "merged", w, act_cols, run)
            return y.reshape(*x.shape[:-1], m.out_features).to(x.dtype)
        y = None
        for name, (w, cols, act_cols, col_act, run) in self.parts.items():
            for part in ("high", "low") if name == "both" else (name,):
                if part == "low" and not m.fmt.h_low:
                    continue
                if t is None and w.compiled():  # gathered and quantized in one call
                    yp = self._static_int(x2, part, w, act_cols, run)
                    y = yp if y is None else y.add_(yp)
                    continue
                if t is None:
                    levels, s = self.static_part(x2, part, w, cols, act_cols, col_act, run)
                else:
                    levels, s = (t.high, t.high_scale) if part == "high" else (t.low, t.low_scale)
                q = torch.nn.functional.pad(levels.to(torch.int8), (0, w.KP - levels.shape[1]))
                sa = s.float().reshape(s.shape[0], -1).index_select(1, act_cols).contiguous()
                if run:
                    yp = w.product_runs(q, w.run_sums(q, sa, run), sa, run)
                else:
                    qs = torch.nn.functional.pad(q.to(torch.int32), (0, w.G * w.group_size - w.KP))
                    yp = w.product(q, qs.reshape(q.shape[0], w.G, -1).sum(-1, dtype=torch.int32), sa, 1)
                y = yp if y is None else y.add_(yp)
        return y.reshape(*x.shape[:-1], m.out_features).to(x.dtype)
