"""The run report reuses what the solver computed (step errors, pivots): it must equal the direct
float64 computation of the same metrics."""

from __future__ import annotations

import pytest
import torch

from bitmosaic.algorithms import babai_bound, gptq_quantize, hessian_error, make_order, relative_output_error
from bitmosaic.algorithms.rtn import rtn_quantize
from bitmosaic.formats.grid import IntGrid
from bitmosaic.pipeline.report import error_metrics


def _direct(W, Wq, H, Hd):
    return {
        "rel_out_error": relative_output_error(W.double(), Wq.double(), H.double()),
        "hessian_error": float(hessian_error(W.double(), Wq.double(), Hd.double()).sum()),
    }


@pytest.mark.parametrize("order", ["natural", "act", "min-pivot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gptq_metrics_from_step_errors_equal_direct(layer64, order, dtype):
    W, _, H = layer64
    W, H = W.to(dtype), H.to(dtype)
    W[:, 5] = 0.3  # a dead input below: its weight is zeroed by GPTQ
    H = H.clone()
    H[5, :] = 0
    H[:, 5] = 0
    res = gptq_quantize(W, H, IntGrid(3), 16, perm=make_order(H, order), clip=False)
    Wq = res.dequantize(dtype)
    got = error_metrics(W, Wq, H, res, 0.01)
    ref = _direct(W, Wq, H, res.damped_hessian(H))
    # the dead column's weight error is not an output error (its input is always zero)
    ref_hess = float(
        hessian_error(
            torch.where(torch.diagonal(H) == 0, 0.0, W.double()), Wq.double(), res.damped_hessian(H).double()
        ).sum()
    )
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    assert got["rel_out_error"] == pytest.approx(ref["rel_out_error"], rel=tol)
    assert got["hessian_error"] == pytest.approx(ref_hess, rel=tol)
    bound = float(babai_bound(res.damped_hessian(H).double(), res.lattice_scales(), res.perm).sum())
    assert got["babai_bound"] == pytest.approx(bound, rel=tol)
    assert got["hessian_error"] <= got["babai_bound"] * (1 + tol)


def test_metrics_without_step_errors_equal_direct(layer64):
    W, _, H = layer64
    res = rtn_quantize(W, IntGrid(4), 16)
    Wq = res.dequantize(torch.float64)
    got = error_metrics(W, Wq, H, res, 0.01)
    from bitmosaic.algorithms.hessian import damp_hessian

    ref = _direct(W, Wq, H, damp_hessian(H, 0.01)[0])
    assert got["rel_out_error"] == pytest.approx(ref["rel_out_error"], rel=1e-9)
    assert got["hessian_error"] == pytest.approx(ref["hessian_error"], rel=1e-9)
    assert got["babai_bound"] is None
