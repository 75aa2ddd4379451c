"""SFMP's module kind on the Triton bit-plane kernel (kernels/triton/bitplane.py, issue 76): the kernel weight
against the CPU's bit-plane weight on the same planes (the GEMV and, above 16 rows, the batched dequantize +
``torch.mm``; SFMP's gathers), and ``bitmosaic.load`` of a saved SFMP model under the device stand-in
(``TRITON_INTERPRET=1`` + ``BITMOSAIC_TRITON_ON_CPU=1``), against the CPU path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.kernels import triton as tk
from bitmosaic.kernels.lut import BitPlaneWeight
from bitmosaic.kernels.select import offers_device, select_kernel
from bitmosaic.kernels.triton.bitplane import GEMV_MAX_ROWS, TritonBitPlaneWeight
from bitmosaic.modules.sfmp import SFMPLinear

from .helpers import accumulation_bound, assert_close_sum, need_triton, pow2_scales, stand_in


def _weights(g, N, K, gs, row_block, exact):
    G = -(-K // gs)
    n_rb = -(-N // row_block)
    bmap = torch.randint(1, 9, (n_rb, G), generator=g).to(torch.uint8)
    cols_bits = bmap.repeat_interleave(row_block, 0)[:N].long().repeat_interleave(gs, 1)[:, :K]
    codes = (torch.rand(N, K, generator=g) * (2.0**cols_bits)).floor().to(torch.int32)
    if exact:
        s, z = pow2_scales(g, (N, G)).float(), torch.randint(0, 4, (N, G), generator=g).float()
    else:
        s, z = torch.rand(N, G, generator=g).half().float() * 0.1, torch.rand(N, G, generator=g) * 4
    args = (codes, bmap, s, z, gs, row_block)
    return TritonBitPlaneWeight.from_codes(*args), BitPlaneWeight.from_codes(*args)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    N=st.integers(1, 40),
    gs=st.sampled_from([32, 64]),
    n_groups=st.integers(1, 3),
    row_block=st.sampled_from([16, 20, 32]),
    M=st.sampled_from([1, 3, GEMV_MAX_ROWS + 1]),
    gather=st.booleans(),
    exact=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_triton_weight_is_the_cpu_bitplane_weight(N, gs, n_groups, row_block, M, gather, exact, seed):
    """Dequantization bitwise equal to the CPU kernel's; the product (with SFMP's column gather and row
    un-permutation) equal on exact inputs, else within the float32 accumulation bound."""
    need_triton()
    g = torch.Generator().manual_seed(seed)
    K = gs * n_groups - (5 if n_groups > 1 else 0)
    tw, cw = _weights(g, N, K, gs, row_block, exact)
    w = cw.dequantize()
    assert torch.equal(tw.dequantize(), w)
    assert torch.equal(tw.dequantize(slice(N // 3, N - 1)), w[N // 3 : N - 1])
    x = torch.randint(-4, 5, (M, K), generator=g).float() if exact else torch.randn(M, K, generator=g)
    cols = torch.randperm(K, generator=g) if gather else None
    rows = torch.randperm(N, generator=g) if gather else None
    y = tw.matmul(x, in_index=cols, out_index=rows)
    xg = x if cols is None else x[:, cols]
    wr = w if rows is None else w[rows]
    if exact:
        assert torch.equal(y, F.linear(xg, wr))
    else:
        assert_close_sum(y, xg @ wr.T, accumulation_bound(xg, wr), torch.float32)


def test_sfmp_declares_the_triton_kernel_for_cuda(monkeypatch):
    """SFMP lists the Triton bit-plane kernel first and as its GPU kernel: picked for CUDA requests (mixed
    widths included), never for the CPU outside the stand-in, where the LUT stays."""
    need_triton()
    monkeypatch.delenv(tk.ON_CPU_ENV, raising=False)
    mixed = torch.tensor([[1, 3], [8, 2]], dtype=torch.uint8)
    assert SFMPLinear.GPU_KERNELS == ("triton_bitplane",) and SFMPLinear.KERNELS[0] == "triton_bitplane"
    for rows in (1, 16, 512):
        assert select_kernel(SFMPLinear.KERNELS, mixed, rows=rows, device="cuda") is TritonBitPlaneWeight
        assert select_kernel(SFMPLinear.KERNELS, mixed, rows=rows) is BitPlaneWeight
    assert offers_device(SFMPLinear.GPU_KERNELS, "cuda") and not offers_device(SFMPLinear.GPU_KERNELS, "cpu")
    monkeypatch.setenv(tk.NO_TRITON_ENV, "1")
    assert not offers_device(SFMPLinear.GPU_KERNELS, "cuda")  # no Triton: F.linear on the GPU


@pytest.fixture(scope="module")
def sfmp_saved(tmp_path_factory):
    from bitmosaic import quantize_
    from bitmosaic.io import save_quantized
    from bitmosaic.methods.sfmp import sfmp_run_info
    from tests.helpers import VOCAB, tiny_llama

    model = tiny_llama(0)
    calib = torch.randint(4, VOCAB, (4, 24), generator=torch.Generator().manual_seed(0))
    opts = {"avg_bits": 2.5, "group_size": 16, "block_rows": 8, "fisher_cache": None, "n_grid": 2}
    rep = quantize_(model, "sfmp", calib, progress=False, **opts)
    out = tmp_path_factory.mktemp("sfmp") / "q"
    save_quantized(model, out, {"method": "sfmp", "config": rep.config, "sfmp": sfmp_run_info(rep)})
    ids = torch.randint(4, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    return out, ids


def test_load_of_an_sfmp_model_runs_the_triton_kernel(sfmp_saved):
    """``bitmosaic.load`` under the stand-in builds every SFMP linear's kernel as the Triton bit-plane weight
    (at load, folds and all), and the logits equal the CPU path's within float32 accumulation order: 24
    rows (the batched path) and one token per sequence (the GEMV)."""
    import bitmosaic

    need_triton()
    path, ids = sfmp_saved
    cpu = bitmosaic.load(path, device="cpu")
    with torch.no_grad():
        want, want1 = cpu(ids).logits, cpu(ids[:, :1]).logits
    assert all(type(m.kernel().weight) is BitPlaneWeight for m in _sfmp(cpu))
    with stand_in():
        gpu = bitmosaic.load(path, device="cpu")
        layers = _sfmp(gpu)
        assert layers and all(type(m._kernel.weight) is TritonBitPlaneWeight for m in layers)  # at load
        assert any(m._emit is not None for m in layers)  # gate/up -> down_proj folded
        with torch.no_grad():
            got, got1 = gpu(ids).logits, gpu(ids[:, :1]).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got1, want1, rtol=1e-4, atol=1e-4)
    assert not torch.equal(got, torch.zeros_like(got))


def _sfmp(model) -> list[SFMPLinear]:
    return [m for m in model.modules() if isinstance(m, SFMPLinear)]
