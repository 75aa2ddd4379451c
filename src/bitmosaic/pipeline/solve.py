"""One solve of the pipeline: the linears of a layer that share one Hessian, quantized and packed.

:func:`quantize_shared` stacks the linears row-wise when the method quantizes rows independently,
runs the method (spread over the ranks of a data-parallel run), packs each linear, checks the
packed weights against the simulated ones, measures the report row's errors and puts the
dequantized weights in place, so later groups calibrate on quantized outputs.

**Disposable Hessians.**  A Hessian nobody reads after the solve (one call owns it, no order
analysis) is handed over with ``LayerStats.hessian_disposable``: a method whose
``may_overwrite_hessian`` is set then factorises it in its own memory instead of beside a
copy (at Llama-3-8B's ``down_proj``, 0.8 GB less at the layer's peak).  What the report needs of
``H`` (``wᵀ H w`` and its diagonal) is taken before.  The rare factorisation that must be retried
with more damping cannot be retried on an overwritten matrix: the solver then raises
:class:`~bitmosaic.algorithms.hessian.HessianSpentError` and the caller recomputes the Hessian
and solves again with a kept one -- the same numbers as a run that never handed it over.  Given
as a :class:`Handed` (the caller keeping no other reference), a disposable Hessian is freed as
soon as the solve returns: packing, the packing check and the error metrics then run without
it (0.8 GB less at ``down_proj``'s post-solve peak, the highest of a Llama-3-8B layer).

**Float copies.**  The layer's weights are read in their own dtype where a float32 copy is not
needed (the finiteness check, the report's metrics: they convert a row block at a time); a
stacked call concatenates them before widening, so the parts and the whole are never float32
copies at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..algorithms.hessian import HessianSpentError
from ..devices import release_host_memory
from ..errors import ScaleOverflowError, check_finite
from ..methods.base import LayerStats
from ..modules.qlinear import UnpackableCodesError
from .distributed import current
from .report import ERROR_METRICS, error_metrics, hessian_summary

__all__ = ["Handed", "HessianSpentError", "SolveJob", "quantize_shared"]


class Handed:
    """A Hessian handed over to :func:`quantize_shared`: the caller keeps no other reference, so
    a disposable solve can free it when it returns (module doc)."""

    __slots__ = ("H",)

    def __init__(self, H: torch.Tensor) -> None:
        self.H = H

    def take(self) -> torch.Tensor:
        H, self.H = self.H, None
        return H


def _narrow(W: torch.Tensor) -> torch.Tensor:
    """``W`` as the solve's float32 copy reads: its own storage when float32 holds its values
    exactly (bf16, fp16, float32), else that copy (e.g. float64 weights are solved in float32)."""
    return W if W.dtype in (torch.bfloat16, torch.float16, torch.float32) else W.float()


@dataclass
class SolveJob:
    """What one :func:`quantize_shared` call solves: linears ``names`` of ``layer`` (under the qualified
    prefix ``prefix``) with ``method`` and ``config``; ``check``: verify the packed weights against the
    simulated ones; ``act_stats``: their input observer; ``state``: the run state the method's
    ``prepare`` returned; ``dist``: a data-parallel run's rank (the solves are spread over the ranks,
    :meth:`Dist.solve`); ``input_scales``: the factors a transform folded into their input
    (``LayerStats``)."""

    method: object
    config: object
    layer: nn.Module
    names: list[str]
    prefix: str
    check: bool = True
    act_stats: object = None
    state: object = None
    dist: object = None
    input_scales: torch.Tensor | None = None


def quantize_shared(job: SolveJob, H, disposable: bool = False) -> list[tuple[str, nn.Module, dict]]:
    """Quantize the linears of ``job`` that share Hessian ``H``; stacked into one call when the method
    allows it.  Returns (name, packed module, report row) and puts the dequantized weights in place.
    ``disposable``: the caller needs ``H`` no more (module doc); may raise HessianSpentError."""
    method, config, layer, names, prefix = job.method, job.config, job.layer, job.names, job.prefix
    percdamp, state = config.percdamp, job.state
    H = H.take() if isinstance(H, Handed) else H
    lins = [layer.get_submodule(n) for n in names]
    own = [_narrow(lin.weight.data) for lin in lins]  # no float32 copies (module doc)
    for n, W in zip(names, own, strict=True):
        check_finite(W, f"the weight of {prefix}.{n}")
    # a config may keep rows apart (stack_rows/split_rows: a format scaled over row blocks or a tensor);
    # one whose choice depends on the linear's name (a GGUF preset's per-tensor mix) solves alone
    stacked = method.row_separable and len(names) > 1 and getattr(config, "stack_rows", True)
    stacked = stacked and not getattr(config, "solve_alone", False)
    split = method.row_separable and getattr(config, "split_rows", True)
    if stacked:
        calls = [(names, torch.cat(own).float())]
    else:
        calls = [((n,), W.float()) for n, W in zip(names, own, strict=True)]
    disposable = disposable and H is not None and len(calls) == 1 and method.may_overwrite_hessian
    summaries = {n: hessian_summary(W, H) for n, W in zip(names, own, strict=True)} if disposable else {}
    stats = LayerStats(
        hessian=H, act=job.act_stats, hessian_disposable=disposable, input_scales=job.input_scales
    )
    names_of = [call_names for call_names, _ in calls]
    weights = [W for _, W in calls]
    del own, calls

    def solve(i: int, W: torch.Tensor):
        name = f"{prefix}.{names_of[i][0]}" if len(names_of[i]) == 1 else None
        return method.quantize(W, stats, config, state, name)

    try:
        solved = (job.dist or current()).solve(weights, solve, split)
    except ScaleOverflowError as e:  # name the layer(s): the grid code does not know them
        which = ", ".join(f"{prefix}.{n}" for n in names)
        raise ScaleOverflowError(f"layer {which}: {e}") from None
    del weights  # memory: the stacked copies; the metrics below read the layer's own weights
    measured = H is not None  # the report's errors: from the summaries once H is spent
    if disposable:  # spent: nobody reads it again (module doc)
        H = stats.hessian = None
    release_host_memory()
    out = []
    for call_names, (res, seconds) in zip(names_of, solved, strict=True):
        seconds /= len(call_names)
        row0 = 0
        for n in call_names:
            lin = layer.get_submodule(n)
            rows = lin.weight.shape[0]
            r = res.select_rows(row0, row0 + rows) if len(call_names) > 1 else res
            Wn = _narrow(lin.weight.data)  # error_metrics widens a row block at a time
            row0 += rows
            Wq = r.dequantize(torch.float32)
            try:
                qlin = method.pack(r, config, lin.bias)
            except UnpackableCodesError as e:
                raise UnpackableCodesError(f"layer {prefix}.{n}: {e}") from None
            if job.check and not torch.equal(qlin.dequantize_weight(torch.float32), Wq.to("cpu")):
                raise RuntimeError(f"internal: packed weights of {prefix}.{n} differ from the simulated ones")
            row = {"name": f"{prefix}.{n}", "shape": list(Wn.shape)}
            if measured:
                row.update(error_metrics(Wn, Wq, None if disposable else H, r, percdamp, summaries.get(n)))
            else:
                row.update(dict.fromkeys(ERROR_METRICS))
            row["bits_per_weight"] = qlin.bits_per_weight()
            row["storage_bits"] = getattr(qlin, "storage_bits", None)
            if hasattr(qlin, "bits_breakdown"):
                row["bits_breakdown"] = qlin.bits_breakdown()
            row.update(r.info)
            row["seconds"] = seconds
            if stacked:
                row["stacked_with"] = [m for m in call_names if m != n]
            lin.weight.data.copy_(Wq.to(lin.weight.dtype))
            out.append((n, qlin, row))
    return out
