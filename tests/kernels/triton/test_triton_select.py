"""The selector and the load path pick the Triton kernels on CUDA by declared capability (issue 76).

Without a GPU the selection is checked as logic (``device="cuda"`` is a request, no tensor is made) and the
load path runs under the device stand-in (``TRITON_INTERPRET=1`` + ``BITMOSAIC_TRITON_ON_CPU=1``): the
selector offers the Triton kernels for CPU modules, which then really run in the interpreter."""

from __future__ import annotations

import pytest
import torch

from bitmosaic.errors import DeviceError
from bitmosaic.kernels import triton as tk
from bitmosaic.kernels.lut import BitPlaneWeight
from bitmosaic.kernels.qmatmul import LowBitWeight
from bitmosaic.kernels.select import KERNEL_ENV, offers_device, select_kernel
from bitmosaic.kernels.triton.blockres import TritonBlockResidualWeight
from bitmosaic.kernels.triton.intmm import TritonIntWeight
from bitmosaic.kernels.triton.sqsplit import TritonSQSplitWeight
from bitmosaic.modules.kernel import LowBitKernel
from bitmosaic.modules.mosaic import MosaicQuantLinear
from bitmosaic.modules.qlinear import QuantLinear
from bitmosaic.modules.qmodules import FP8ComputeQuantLinear, SparseOutlierQuantLinear
from bitmosaic.modules.sq import SQActLinear
from tests.methods.saved_bytes import calib, tiny_llama

from .helpers import need_triton, stand_in

PACKED = QuantLinear.KERNELS


def test_cuda_requests_get_triton_cpu_requests_do_not(monkeypatch):
    need_triton()
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    monkeypatch.delenv(tk.ON_CPU_ENV, raising=False)
    assert PACKED[0] == "triton_int"
    for bits in range(1, 9):
        for rows in (1, 16, 512):
            assert select_kernel(PACKED, bits, rows=rows, device="cuda") is TritonIntWeight
            assert select_kernel(PACKED, bits, rows=rows, device="cuda:0", group_size=128) is TritonIntWeight
            assert select_kernel(PACKED, bits, rows=rows) in (BitPlaneWeight, LowBitWeight)  # the CPU's
    mixed = torch.tensor([[2, 4]], dtype=torch.uint8)
    with pytest.raises(ValueError, match="none of the kernels"):  # one width per matrix only
        select_kernel(PACKED, mixed, device="cuda")
    assert offers_device(PACKED, "cuda") and not offers_device(("triton_int",), "cpu")
    assert not offers_device(("lut", "lowbit"), "cuda")


def test_mosaic_and_sq_kernels_are_selected_on_cuda_only(monkeypatch):
    """Their declared capabilities: one storage width per matrix (2-8 bits), CUDA (the CPU only under the
    stand-in); without Triton neither is offered and the kinds keep their CPU paths."""
    need_triton()
    monkeypatch.delenv(tk.ON_CPU_ENV, raising=False)
    mosaic, sq = MosaicQuantLinear.GPU_KERNELS, SQActLinear.GPU_KERNELS
    for rows in (1, 16, 512):
        assert select_kernel(mosaic, 4, rows=rows, device="cuda", group_size=-1) is TritonBlockResidualWeight
        for bits in (2, 4, 8):
            assert select_kernel(sq, bits, rows=rows, device="cuda:0", group_size=64) is TritonSQSplitWeight
    mixed = torch.tensor([[2, 4]], dtype=torch.uint8)
    for kernels in (mosaic, sq):  # one storage width per matrix
        with pytest.raises(ValueError, match="none of the kernels"):
            select_kernel(kernels, mixed, device="cuda")
    assert offers_device(mosaic, "cuda") and offers_device(sq, "cuda")
    assert not offers_device(mosaic, "cpu") and not offers_device(sq, "cpu")
    with stand_in():
        assert offers_device(mosaic, "cpu") and offers_device(sq, "cpu")
    monkeypatch.setenv(tk.NO_TRITON_ENV, "1")
    assert not offers_device(mosaic, "cuda") and not offers_device(sq, "cuda")


def test_without_triton_nothing_is_offered(monkeypatch):
    """``BITMOSAIC_NO_TRITON=1`` (as on a machine without Triton): the selector does not offer them, the
    CPU choices stay, a CUDA request has no kernel (the module then runs F.linear)."""
    monkeypatch.setenv(tk.NO_TRITON_ENV, "1")
    assert not tk.available() and tk.devices() == ()
    assert select_kernel(PACKED, 4) is LowBitWeight
    assert not offers_device(PACKED, "cuda")
    with pytest.raises(ValueError, match="none of the kernels"):
        select_kernel(PACKED, 4, device="cuda")


def test_stand_in_needs_the_interpreter(monkeypatch):
    need_triton()
    monkeypatch.setenv(tk.ON_CPU_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert tk.devices() == ("cuda",)  # never offered for the CPU outside the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tk.devices() == ("cuda", "cpu")


def test_kinds_that_change_the_product_declare_their_own():
    """A subclass that changes the kernel or the product is not offered the packed kind's GPU kernel; the
    mosaic and static SQ kinds declare their own (kernels/triton/blockres.py, sqsplit.py)."""
    assert QuantLinear.GPU_KERNELS == ("triton_int",)
    assert (
        MosaicQuantLinear.GPU_KERNELS == ("triton_blockres",)
        and "triton_int" not in MosaicQuantLinear.KERNELS
    )
    assert SQActLinear.GPU_KERNELS == ("triton_sq",) and "triton_int" not in SQActLinear.KERNELS
    for own in (SparseOutlierQuantLinear, FP8ComputeQuantLinear):  # SSQR, DPQ: their Triton kernels
        assert own.GPU_KERNELS == ("triton_int",) and own.KERNELS[0] == "triton_int"


def test_load_on_the_device_runs_the_triton_kernels(tmp_path):
    """``bitmosaic.load(path, device=...)`` builds the kernels at load; under the stand-in every packed
    layer holds a Triton weight and the logits match the CPU kernels' within float32 accumulation order."""
    import bitmosaic
    from bitmosaic.io import save_quantized

    need_triton()
    model = tiny_llama()
    bitmosaic.quantize_(
        model, "gptq", calib(), progress=False, bits=4, group_size=32, order="act", static_groups=False
    )
    path = save_quantized(model, tmp_path / "w4", {"method": "gptq"})
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    cpu = bitmosaic.load(path, device="cpu")
    with torch.no_grad():
        want = cpu(ids).logits
    assert all(not isinstance(m.kernel().weight, TritonIntWeight) for m in _packed(cpu))
    with stand_in():
        gpu = bitmosaic.load(path, device="cpu")
        layers = _packed(gpu)
        assert layers and all(isinstance(m._kernel, LowBitKernel) for m in layers)  # built at load
        assert all(isinstance(m._kernel.weight, TritonIntWeight) for m in layers)
        assert any(m._kernel.perm is not None for m in layers)  # act-order gathered in the kernel
        with torch.no_grad():
            got = gpu(ids).logits
        ids1 = ids[:, :1]  # one token: the GEMV
        with torch.no_grad():
            torch.testing.assert_close(gpu(ids1).logits, cpu(ids1).logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.equal(got, torch.zeros_like(got))
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="CUDA is not available"):
            bitmosaic.load(path, device="cuda")


def _packed(model) -> list[QuantLinear]:
    return [m for m in model.modules() if type(m) is QuantLinear]
