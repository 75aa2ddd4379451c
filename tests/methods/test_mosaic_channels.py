"""MosaicQuant's channel baselines (§3 Observation 1, Fig. 5): the paper's outlier channels by
``max|X_j|`` (``channel-act``) and ours (``channel``), both stored as dense columns whose bits per
weight are exactly the stored bytes; the kernel, save/reload and the pipeline's ``max|X_j|``."""

from __future__ import annotations

import pytest
import torch

from bitmosaic import quantize_
from bitmosaic.algorithms.mosaic import (
    channel_count,
    column_block_width,
    delta_distortion,
    mosaic_decompose,
)
from bitmosaic.io import load_quantized, save_quantized
from bitmosaic.modules.mosaic import MosaicQuantLinear
from tests.conftest import correlated_inputs
from tests.methods.test_waq_pipeline import tiny


def _layer(out=70, n=200, seed=0, tokens=300):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, n, generator=g)
    X = correlated_inputs(tokens, n, seed=seed + 100).float()
    X[:, torch.randperm(n, generator=g)[:6]] *= 10.0  # outlier input channels
    return W, X


def _stored_bits(m: MosaicQuantLinear) -> int:
    """Every saved tensor's bytes but the bias: what a checkpoint of the layer holds."""
    return sum(t.numel() * t.element_size() * 8 for k, t in m.state_dict().items() if k != "bias")


@pytest.mark.parametrize("selection", ["channel-act", "channel"])
@pytest.mark.parametrize("block", [(32, 32), (16, 64)])
def test_channel_residual_is_dense_columns_counted_exactly(selection, block):
    W, X = _layer()
    H = X.T @ X
    amax = X.abs().amax(0)
    res = mosaic_decompose(W, H, budget=0.1, block=block, selection=selection, act_amax=amax)
    k = channel_count(0.1, tuple(W.shape), block)
    cols = res.columns
    assert cols is not None and cols.numel() == k and bool((cols[1:] > cols[:-1]).all())
    if selection == "channel-act":  # the k largest max|X_j|
        assert set(cols.tolist()) == set(torch.topk(amax, k).indices.tolist())
    touched = (res.sparse != 0).any(0)
    assert bool(touched[cols].any()) and not bool(touched[~torch.isin(torch.arange(W.shape[1]), cols)].any())
    # half a step: the residual of the chosen columns is quantized on the gathered matrix
    R = res.residual[:, cols]
    step = res.res_scales.repeat_interleave(res.block[1], 1)[:, : cols.numel()]
    assert bool(((R - res.sparse[:, cols]).abs() <= step / 2 + 1e-7).all())
    m = MosaicQuantLinear.from_result(res)
    assert torch.equal(m.dequantize_weight(torch.float32), res.dequantize(torch.float32))
    # bits per weight == the stored bytes; and the layout: codes, scales, block and column indices
    assert m.bits_per_weight() * W.numel() == _stored_bits(m)
    bm, bk = res.block
    assert bk == column_block_width(k, block[1]) and bk % 8 == 0 and bk * -(-k // block[1]) >= k
    nblk = -(-W.shape[0] // bm) * -(-k // bk)
    dense = W.numel() * 4 + W.shape[0] * 16
    assert _stored_bits(m) == dense + nblk * (32 + bm * bk * 4 + bm * 16) + k * 32


def test_paper_channels_recover_less_than_block_selection_here():
    """The exact ΔD of a channel selection is that of its (full-column) element mask."""
    W, X = _layer(seed=3)
    H = (X.T @ X).double()
    amax = X.abs().amax(0)
    res = mosaic_decompose(W, H, budget=0.1, block=(32, 32), selection="channel-act", act_amax=amax)
    M = res.sparse != 0
    dd = delta_distortion(res.residual.double(), res.sparse.double(), M, H)
    assert res.info["delta_D"] == pytest.approx(dd, rel=1e-4)
    assert res.info["columns_compensated"] == res.columns.numel()
    with pytest.raises(ValueError, match="max"):
        mosaic_decompose(W, H, budget=0.1, block=(32, 32), selection="channel-act")


@pytest.mark.parametrize("tokens", [1, 7, 150])
def test_column_kernel_equals_the_reference(tokens):
    W, X = _layer(seed=1)
    amax = X.abs().amax(0)
    res = mosaic_decompose(W, X.T @ X, budget=0.15, block=(16, 32), selection="channel-act", act_amax=amax)
    m = MosaicQuantLinear.from_result(res)
    x = torch.randn(2, tokens, W.shape[1], generator=torch.Generator().manual_seed(tokens))
    ref = torch.nn.functional.linear(x, m.dequantize_reference(torch.float32))
    y = m.kernel()(x)
    assert y.shape == ref.shape and float((y - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_old_layer_configs_without_columns_load():
    cfg = MosaicQuantLinear.from_result(mosaic_decompose(*_two(), budget=0.2, block=(32, 32))).layer_config()
    assert "n_columns" not in cfg
    m = MosaicQuantLinear.from_layer_config(cfg)
    assert m.res_columns is None and "res_columns" not in m.state_dict()


def _two():
    W, X = _layer(seed=2)
    return W, X.T @ X


def test_pipeline_ranks_the_float_inputs_max_and_saves_columns(tmp_path):
    """Layer 0 sees the float embeddings: ``channel-act`` must pick the top ``max|X_j|`` of those,
    although the pipeline observes the smoothed input ``X / s`` (the folded ``s`` is undone)."""
    calib = torch.randint(0, 128, (6, 32), generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    m = tiny(2)
    seen = []
    hook = m.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda mod, a: seen.append(a[0]))
    with torch.inference_mode():
        m(calib)
    hook.remove()
    amax = torch.cat([s.reshape(-1, s.shape[-1]) for s in seen]).abs().amax(0)
    rep = quantize_(m, "mosaic", calib, scheme="W4A4", block="32x32", budget_frac=0.25, alpha=0.5,
                    selection="channel-act", progress=False)  # fmt: skip
    q = m.model.layers[0].self_attn.q_proj
    assert isinstance(q, MosaicQuantLinear) and q.res_columns is not None
    k = q.res_columns.numel()
    assert set(q.res_columns.tolist()) == set(torch.topk(amax, k).indices.tolist())
    row = next(r for r in rep.layers if r["name"].endswith("layers.0.self_attn.q_proj"))
    assert row["transform"]["folded"] and row["columns_compensated"] == k
    assert row["bits_per_weight"] * q.in_features * q.out_features == _stored_bits(q)
    with torch.inference_mode():
        out = m(ids).logits
    m2, _ = load_quantized(save_quantized(m, tmp_path / "q", {"method": "mosaic"}), load_tokenizer=False)
    assert torch.equal(m2.model.layers[0].self_attn.q_proj.res_columns, q.res_columns)
    with torch.inference_mode():
        assert torch.equal(m2(ids).logits, out)
