"""SSQR, HPTQ and HRTN (Babai paper §5) on synthetic layers; CSR storage; packed modules."""

import pytest
import torch

from bitmosaic.algorithms import gptq_quantize, hessian_error, make_order, rtn_quantize
from bitmosaic.algorithms.lattice import entropy_coded_quantize, outlier_density, ssqr_quantize
from bitmosaic.formats.grid import IntGrid
from bitmosaic.formats.sparse import csr_from_dense
from bitmosaic.modules.qmodules import HuffmanQuantLinear, SparseOutlierQuantLinear, module_from_layer_config
from tests.conftest import correlated_inputs


@pytest.fixture(scope="module")
def heavy_layer():
    """A layer with heavy-tailed weights (the case SSQR and HPTQ are for)."""
    torch.manual_seed(0)  # StudentT samples from the global generator
    X = correlated_inputs(600, 128, seed=4, dtype=torch.float32)
    W = torch.distributions.StudentT(3.0).sample((64, 128)) * 0.02
    H = 2 / X.shape[0] * X.T @ X
    return W, H


def _err(W, Wq, H):
    return float(hessian_error(W.double(), Wq.double(), H.double()).sum())


def test_csr_roundtrip_and_size():
    d = torch.zeros(5, 40)
    d[0, 3], d[2, 39], d[2, 0], d[4, 7] = 1.5, -2.25, 0.125, 3.0
    csr = csr_from_dense(d)
    assert csr.nnz == 4 and csr.col_idx.dtype == torch.int16 and csr.values.dtype == torch.float16
    assert torch.equal(csr.to_dense(), d)
    assert csr.row_ptr.tolist() == [0, 1, 1, 3, 3, 4]
    bits = sum(t.numel() * t.element_size() * 8 for t in csr.tensors())
    assert bits == 6 * 32 + 4 * 16 + 4 * 16  # row pointers + 16-bit indices + fp16 values


@pytest.mark.parametrize("groups", ["static", "dynamic"])
@pytest.mark.parametrize("rate", [0.03, 0.05])
def test_ssqr_meets_outlier_rate_and_beats_gptq(heavy_layer, rate, groups):
    W, H = heavy_layer
    perm = make_order(H, "act")
    res = ssqr_quantize(W, H, 3, 32, rate, perm=perm, groups=groups)
    density = res.info["outlier_rate"]
    assert 0.9 * rate <= density <= rate
    assert res.codes.min() >= 0 and res.codes.max() <= 7
    assert int((res.sparse != 0).sum()) <= round(density * W.numel())
    # baselines: the same grid with GPTQ clipping instead of outliers, and RTN with MSE scales
    if groups == "static":
        clipped = gptq_quantize(W, H, IntGrid(3), 32, perm=perm, scales=res.scales, zeros=res.zeros)
    else:  # the GPTQ baseline of the same grouping: act-order dynamic groups, MSE scales, clipping
        clipped = gptq_quantize(W, H, IntGrid(3), 32, perm=perm, scale_method="mse")
        assert not torch.equal(res.g_idx, torch.arange(W.shape[1]) // 32)  # really dynamic groups
    rtn = rtn_quantize(W, IntGrid(3), 32, "mse")
    e = _err(W, res.dequantize(), H)
    assert e < _err(W, clipped.dequantize(), H)
    assert e < _err(W, rtn.dequantize(), H)


def test_ssqr_dynamic_groups_obey_the_babai_bound(heavy_layer):
    """Dynamic groups x alpha: before outlier extraction the no-clip error obeys Thm. 5 with the
    scales actually used per column."""
    from bitmosaic.algorithms import babai_bound

    W, H = heavy_layer
    perm = make_order(H, "act")
    res = ssqr_quantize(W, H, 3, 32, 0.03, perm=perm, groups="dynamic")
    err = _err(W, res.dequantize(), H)  # outliers exact up to fp16: the no-clip weights
    bound = float(babai_bound(res.damped_hessian(H).double(), res.lattice_scales(), res.perm).sum())
    assert err <= bound * (1 + 1e-3)


@pytest.mark.parametrize("groups", ["static", "dynamic"])
def test_ssqr_records_the_overflow_at_alpha_one(heavy_layer, groups):
    """``overflow_rate_alpha1``: the off-grid share of a no-clip GPTQ on the unwidened MSE scales,
    recomputed here without SSQR's search; ``outliers`` is the stored CSR count."""
    from bitmosaic.algorithms.scales import group_scale_zero

    W, H = heavy_layer
    perm = make_order(H, "act")
    grid = IntGrid(3)
    res = ssqr_quantize(W, H, 3, 32, 0.03, perm=perm, groups=groups)
    if groups == "static":
        s, z = group_scale_zero(W, grid, 32, "mse")
        ref = gptq_quantize(W, H, grid, 32, perm=perm, clip=False, scales=s, zeros=z)
    else:
        ref = gptq_quantize(W, H, grid, 32, perm=perm, clip=False, scale_method="mse")
    want = float(((ref.codes < 0) | (ref.codes > 7)).float().mean())
    assert want > 0.005
    assert res.info["overflow_rate_alpha1"] == pytest.approx(want, abs=1e-9)
    # more overflow than the target at alpha = 1: the search widened the grid, else it narrowed it
    assert (want > 0.03) == (res.info["scale_multiplier"] > 1)
    m = SparseOutlierQuantLinear.from_result(res, bits=3, group_size=32, symmetric=False)
    assert res.info["outliers"] == m.outlier_vals.numel() == int((res.sparse != 0).sum())
    assert res.info["outliers"] == round(res.info["outlier_rate"] * W.numel())


def test_ssqr_module_dense_plus_sparse_matches_reference(heavy_layer):
    W, H = heavy_layer
    res = ssqr_quantize(W, H, 3, 32, 0.02, perm=make_order(H, "act"), groups="static")
    m = SparseOutlierQuantLinear.from_result(res, bits=3, group_size=32, symmetric=False)
    assert torch.equal(m.dequantize_weight(), res.dequantize())
    assert torch.equal(m.dequantize_reference(), res.dequantize())
    nnz = m.outlier_vals.numel()
    dense_bits = 3 + 32 / 32 + 64 * 0  # codes + fp16 scale/zero per group of 32
    expected = dense_bits + (nnz * 32 + 65 * 32) / W.numel()
    assert abs(m.bits_per_weight() - expected) < 1e-9
    m2 = module_from_layer_config(m.layer_config())
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m2.dequantize_weight(), m.dequantize_weight())


@pytest.mark.parametrize("target", [2.125, 3.125, 4.125])
def test_hptq_meets_target_bits_from_real_bytes(heavy_layer, target):
    W, H = heavy_layer
    res = entropy_coded_quantize(W, H, target, perm=make_order(H, "act"))
    m = HuffmanQuantLinear.from_result(res)
    real = m.bits_per_weight()
    assert abs(real - res.info["encoded_bits_per_weight"]) < 1e-9  # search measured the real stream
    assert real <= target and real > target - 0.35
    assert torch.equal(m.dequantize_weight(), res.dequantize())
    assert res.scales.unique().numel() == 1  # one scale per matrix


def test_hptq_beats_hrtn_at_same_bits(heavy_layer):
    W, H = heavy_layer
    hp = entropy_coded_quantize(W, H, 3.125, perm=make_order(H, "act"))
    hr = entropy_coded_quantize(W, None, 3.125, use_gptq=False)
    assert hr.info["encoded_bits_per_weight"] <= 3.125
    assert _err(W, hp.dequantize(), H) < _err(W, hr.dequantize(), H)


def test_hrtn_per_row_scales(heavy_layer):
    W, _ = heavy_layer
    res = entropy_coded_quantize(W, None, 3.125, use_gptq=False, scale_per="row")
    m = HuffmanQuantLinear.from_result(res)
    assert m.scales.shape[0] == W.shape[0] and m.bits_per_weight() <= 3.125
    m2 = module_from_layer_config(m.layer_config())
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m2.dequantize_weight(), res.dequantize())


def test_outlier_density_counts_out_of_grid():
    c = torch.tensor([[-1, 0, 7, 8], [3, 3, 3, 3]])
    assert outlier_density(c, 7) == 2 / 8


def test_bad_rates_are_clear(heavy_layer):
    W, H = heavy_layer
    with pytest.raises(ValueError, match="outlier rate"):
        ssqr_quantize(W, H, 3, 32, 0.0)
    with pytest.raises(ValueError, match="scale_per"):
        entropy_coded_quantize(W, None, 3.0, use_gptq=False, scale_per="group")
