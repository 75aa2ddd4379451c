"""The FP4 LUT GEMV of the ``mx`` kind (issue 75 item 5, kernels/fp4lut.py, csrc/fp4gemv.cpp) against the
exact product and the reference dequantize-then-matmul.

The bound (Higham, *Accuracy and Stability of Numerical Algorithms*, Eq. 3.5 / Lemma 3.1): every term
``W_nj x_j`` of the kernel's sum meets at most ``K + 2`` float32 roundings (the table entry ``e2m1(c) x_j``,
at most ``block - 1`` additions inside its block, the product by the block divisor, at most ``K / block``
additions across blocks), so with ``u = 2^-24`` and ``γ_n = n u / (1 - n u)``

    |y_kernel[n] - y_exact[n]| <= γ_{K+2} · Σ_j |W_nj| |x_j|,

``y_exact`` the float64 product of the exact weight (E2M1 value times the float32 divisor).  The reference
(``F.linear`` of the float32 dequantized weight: one rounding in ``v · d``, one per product, ``K - 1``
additions) obeys the same bound, so kernel and reference differ by at most ``2 γ_{K+2} Σ |W||x|``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from bitmosaic.formats.mx import (
    E2M1_VALUES,
    MXTensor,
    decode_elements,
    element_divisor,
    get_mx_format,
    mx_dequantize,
    mx_quantize,
    unpack_fp4,
)
from bitmosaic.kernels import build
from bitmosaic.kernels.fp4lut import FP4LutWeight, MXTiledWeight, extension
from bitmosaic.kernels.isa import available_isas
from bitmosaic.kernels.select import KERNEL_ENV, select_kernel
from bitmosaic.modules.base import resident_bytes
from bitmosaic.modules.mx import MXLinear

compiled = pytest.mark.skipif(extension() is None, reason="no C++ compiler: the FP4 LUT is not built")
U = 2.0**-24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def exact_parts(t: MXTensor) -> torch.Tensor:
    """The exact weight in float64: E2M1 value (exact) times the float32 divisor (exact in float64)."""
    codes = unpack_fp4(t.elements).to(torch.int64)
    v = E2M1_VALUES.double()[codes & 7] * torch.where((codes & 8) != 0, -1.0, 1.0).double()
    div = mx_dequantize(MXTensor(t.fmt, t.shape, torch.full_like(t.elements, 0x22), t.scales, t.global_scale))
    return v * div.double()  # code 2 = 1.0 in both nibbles: the dequantized ones are the divisors


def check_bound(y: torch.Tensor, W64: torch.Tensor, x: torch.Tensor, factor: float = 1.0) -> None:
    x64 = x.double().reshape(-1, W64.shape[1])
    exact = x64 @ W64.T
    mag = x64.abs() @ W64.abs().T
    bound = factor * gamma(W64.shape[1] + 2) * mag + 1e-37
    err = (y.double().reshape(exact.shape) - exact).abs()
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound).max()):.3g}"


def _case(fmt: str, N: int, K: int, M: int, seed: int, spread: bool = True):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=g) * 0.05
    if spread:  # blocks over many binades, exact zeros, one large outlier
        W *= torch.exp2(torch.randint(-6, 4, (N, 1), generator=g).float())
        W[:, : min(K, 16)] *= 0
        W[0, -1] = 3.0
    x = torch.randn(M, K, generator=g)
    return mx_quantize(W, fmt, rule="round" if seed % 2 else "floor"), x


def test_layout_round_trips_the_stored_bytes_and_values():
    t, _ = _case("nvfp4", 37, 96, 1, 0)
    w = FP4LutWeight.from_tensor(t)
    assert torch.equal(w.packed_rows(0, 37), t.elements)
    assert torch.equal(w.packed_rows(5, 21), t.elements[5:21])
    assert torch.equal(w.dequantize(), mx_dequantize(t))  # bit for bit the reference values
    assert torch.equal(w.dequantize(slice(17, 33)), mx_dequantize(t)[17:33])
    with pytest.raises(ValueError, match="E2M1"):
        FP4LutWeight.from_tensor(mx_quantize(torch.randn(8, 64), "mxfp8"))


@compiled
@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    fmt=st.sampled_from(["mxfp4", "nvfp4"]),
    N=st.integers(1, 70),
    blocks=st.integers(1, 20),
    tail=st.sampled_from([0, 2, 6]),
    M=st.sampled_from([1, 2, 3, 5, 8, 9, 17]),
    isa=st.sampled_from(["portable", "avx2", "avx512"]),
    seed=st.integers(0, 1000),
)
def test_gemv_within_the_float32_bound(fmt, N, blocks, tail, M, isa, seed):
    """Any shape (partial last tile, partial last block, chunks of several blocks), 1-17 rows of x, each
    ISA this CPU has: within γ_{K+2} Σ|W||x| of the exact product, and within twice that of the
    reference dequantize-then-matmul."""
    if isa not in available_isas(extension()):
        isa = "portable"
    K = blocks * (32 if fmt == "mxfp4" else 16) + tail
    t, x = _case(fmt, N, K, M, seed)
    w = FP4LutWeight.from_tensor(t)
    y = w.matmul(x, isa=isa)
    assert y.shape == (M, N) and y.dtype == torch.float32
    W64 = exact_parts(t)
    check_bound(y, W64, x)
    check_bound(F.linear(x, mx_dequantize(t)), W64, x)  # the reference obeys the same bound
    ref = F.linear(x, mx_dequantize(t)).double()
    mag = x.double().abs() @ W64.abs().T
    assert bool(((y.double() - ref).abs() <= 2 * gamma(K + 2) * mag + 1e-37).all())


@compiled
def test_isas_agree_and_large_shapes():
    """A SmolLM2-sized shape on every ISA (chunked tables, thread split) and batches across the pass size."""
    t, x = _case("mxfp4", 1536, 576, 10, 3, spread=False)
    w, W64 = FP4LutWeight.from_tensor(t), exact_parts(t)
    for isa in available_isas(extension()):
        for M in (1, 2, 8, 10):
            check_bound(w.matmul(x[:M], isa=isa), W64, x[:M])
    y3 = w.matmul(x[:3].reshape(3, 1, 576).to(torch.bfloat16))
    assert y3.shape == (3, 1, 1536) and y3.dtype == torch.bfloat16


def test_prefill_and_no_extension_run_the_reference_tiles(monkeypatch):
    """Above 32 rows of x, and without the extension, the tiles: F.linear of the exact rows."""
    t, x = _case("nvfp4", 40, 64, 40, 1)
    w = FP4LutWeight.from_tensor(t)
    check_bound(w.matmul(x), exact_parts(t), x)
    monkeypatch.setenv(build.NO_EXT_ENV, "1")
    check_bound(w.matmul(x[:1]), exact_parts(t), x[:1])
    assert select_kernel(MXLinear.KERNELS, 4, group_size=32) is MXTiledWeight


def test_selector_picks_the_lut_for_fp4_and_the_tiles_for_fp8(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    want = FP4LutWeight if extension() is not None else MXTiledWeight
    assert select_kernel(MXLinear.KERNELS, 4, group_size=32) is want
    assert select_kernel(MXLinear.KERNELS, 4, group_size=16) is want
    assert select_kernel(MXLinear.KERNELS, 8, group_size=32) is MXTiledWeight
    monkeypatch.setenv(KERNEL_ENV, "mx_tiles")
    assert select_kernel(MXLinear.KERNELS, 4, group_size=32) is MXTiledWeight


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp8", "fp8-block"])
def test_module_forward_runs_the_selected_kernel(fmt):
    """The ``mx`` kind's forward (no grad) equals F.linear of its reference weight within the bound; the
    FP4 kernel releases ``weight_packed`` and rebuilds it bit for bit (state dict unchanged)."""
    g = torch.Generator().manual_seed(4)
    t, x = mx_quantize(torch.randn(130, 256, generator=g) * 0.05, fmt), torch.randn(3, 256, generator=g)
    m = MXLinear.from_tensor(t, bias=torch.randn(130))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        y = m(x)
    ref = F.linear(x, m.dequantize_reference(), m.bias)
    mag = x.double().abs() @ m.dequantize_reference().double().abs().T
    assert bool(((y.double() - ref.double()).abs() <= 2 * gamma(258) * mag + 1e-37).all())
    want = FP4LutWeight if fmt in ("mxfp4", "nvfp4") and extension() is not None else MXTiledWeight
    assert isinstance(m.kernel().weight, want)
    assert ("weight_packed" in m._released) == (want is FP4LutWeight)
    assert ("weight_scale" in m._released) == (want is FP4LutWeight)
    after = m.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(m.weight_packed, t.elements)


def emulate(t: MXTensor, x: torch.Tensor, simd: bool) -> torch.Tensor:
    """The kernel's float32 arithmetic in torch, in its order (csrc/fp4gemv.cpp: per block, the quads' table
    entries ``e2m1(c) x_j`` summed nibble by nibble (portable) or as ``(0+1)+(2+3)`` and ``(4+5)+(6+7)`` in
    two chains (SIMD), then ``y += d · sum``), with the divisors the float path held: the reference's
    :func:`element_divisor` of the decoded scales."""
    N, K = t.shape
    kp, block = -(-K // 8) * 8, t.fmt.block
    vals = torch.nn.functional.pad(decode_elements(unpack_fp4(t.elements), t.fmt), (0, kp - K))
    xp = torch.nn.functional.pad(x.float(), (0, kp - K))
    div = element_divisor(t.scale_values(), t.fmt, t.global_scale)
    y = torch.zeros(x.shape[0], N)
    for b, j0 in enumerate(range(0, kp, block)):
        p = xp[:, None, j0 : j0 + block] * vals[None, :, j0 : j0 + block]  # the table entries read
        a0, a1 = torch.zeros_like(y), torch.zeros_like(y)
        for q in range(0, p.shape[-1], 8):
            e = [p[..., q + n] for n in range(8)]
            if simd:
                a0 = a0 + ((e[0] + e[1]) + (e[2] + e[3]))
                a1 = a1 + ((e[4] + e[5]) + (e[6] + e[7]))
            else:
                s = torch.zeros_like(y)
                for v in e:
                    s = s + v
                a0 = a0 + s
        y = y + div[:, b] * (a0 + a1 if simd else a0)
    return y


@compiled
@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    fmt=st.sampled_from(["mxfp4", "nvfp4"]),
    N=st.integers(1, 40),
    blocks=st.integers(1, 6),
    tail=st.sampled_from([0, 2, 6]),
    M=st.sampled_from([1, 3, 8, 9]),
    seed=st.integers(0, 1000),
)
def test_scale_bytes_decode_to_the_float_divisors_bit_for_bit(fmt, N, blocks, tail, M, seed):
    """The kernel decodes the stored scale bytes itself (E8M0 bits, the E4M3 table over the tensor scale):
    on every ISA its output equals, bit for bit, the kernel's own arithmetic run in torch with the float32
    divisors of the reference (what the kernel was handed before it read the bytes)."""
    K = blocks * (32 if fmt == "mxfp4" else 16) + tail
    t, x = _case(fmt, N, K, M, seed)
    w = FP4LutWeight.from_tensor(t)
    assert torch.equal(w.divisors(), element_divisor(t.scale_values(), t.fmt, t.global_scale))
    for isa in available_isas(extension()):
        assert torch.equal(w.matmul(x, isa=isa), emulate(t, x, simd=isa != "portable")), isa


@compiled
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_every_scale_byte_decodes_as_the_reference(fmt):
    """All 256 scale bytes (E8M0: 2^-127 subnormal at 0, NaN at 255; E4M3: subnormals, ±0, NaN) in one
    weight whose row ``n`` is ``1.0`` at column 0 under byte ``n``: ``y = W e_0`` is the divisor itself."""
    f = get_mx_format(fmt)
    codes = torch.zeros(256, f.block, dtype=torch.uint8)
    codes[:, 0] = 2  # E2M1 1.0
    scales = torch.arange(256, dtype=torch.uint8).reshape(256, 1)
    scales = scales if f.scale == "e8m0" else scales.view(torch.float8_e4m3fn)
    gs = torch.tensor([2688.0 / 3.7], dtype=torch.float32) if f.global_scale else None
    t = MXTensor(f, (256, f.block), codes[:, 0::2] | (codes[:, 1::2] << 4), scales, gs)
    x = torch.zeros(1, f.block)
    x[0, 0] = 1.0
    ref = element_divisor(t.scale_values(), f, gs)[:, 0]
    w = FP4LutWeight.from_tensor(t)
    for isa in available_isas(extension()):
        y = w.matmul(x, isa=isa)[0]
        assert torch.equal(y.isnan(), ref.isnan()), isa
        assert torch.equal(y[~ref.isnan()], ref[~ref.isnan()]), isa


@pytest.mark.parametrize("fmt, bits", [("mxfp4", 4.25), ("nvfp4", 4.5)])
def test_resident_bytes_are_the_files(fmt, bits):
    """The kernel holds the codes and the scale bytes, no float copy of the scales: 4.25 (MXFP4) / 4.5
    (NVFP4) bits per weight, plus NVFP4's 4-byte tensor scale; the module releases both stored buffers."""
    N, K = 64, 512
    t = mx_quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(2)), fmt)
    w = FP4LutWeight.from_tensor(t)
    assert w.nbytes() * 8 == bits * N * K + (32 if fmt == "nvfp4" else 0)
    assert w.nbytes() == sum(v.numel() * v.element_size() for v in t.tensors())  # the file's bytes
    assert torch.equal(w.scale_rows(0, N), t.scales) and w.scale_rows(0, N).dtype == t.scales.dtype
    if extension() is None:
        return
    m = MXLinear.from_tensor(t)
    m.kernel()
    assert m._released == {"weight_packed", "weight_scale"}
    assert resident_bytes(m) == w.nbytes() + (4 if fmt == "nvfp4" else 0)  # + the module's tensor scale
    assert torch.equal(m.weight_scale, t.scales)
