"""Shared checks of the Triton kernel tests (issue 76).

CI installs Triton (pyproject's ``dev`` extra), so a missing Triton fails these tests; they skip only when
``BITMOSAIC_NO_TRITON=1`` says so explicitly.  Without a GPU they run in Triton's interpreter
(``TRITON_INTERPRET=1``, set by tests/conftest.py), on CPU tensors.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from bitmosaic.algorithms.types import QuantResult
from bitmosaic.kernels import triton as tk
from bitmosaic.modules.qlinear import QuantLinear

U32 = 2.0**-24  # float32 unit roundoff


def need_triton() -> None:
    if os.environ.get(tk.NO_TRITON_ENV) == "1":
        pytest.skip("BITMOSAIC_NO_TRITON=1: the Triton kernels are switched off")
    assert tk.available(), "Triton is not importable: pip install -e .[dev] (it pins triton>=3.2,<4)"
    assert tk.interpreting() or torch.cuda.is_available(), "no GPU and TRITON_INTERPRET is not 1"


def device() -> str:
    return "cuda" if torch.cuda.is_available() and not tk.interpreting() else "cpu"


def accumulation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Twice the float32 bound on a K-term dot product in any order (``gamma_K |x| |w|``, Higham 3.1): how
    far two float32 sums of the same exact products can differ."""
    K = x.shape[-1]
    g = K * U32 / (1 - K * U32)
    return 2 * g * (x.abs().double() @ w.abs().double().T).float() + 1e-30


def assert_close_sum(y: torch.Tensor, ref32: torch.Tensor, bound: torch.Tensor, out_dtype) -> None:
    """``y`` (in ``out_dtype``) against the float32 reference ``ref32`` before rounding: the accumulation
    bound plus one rounding to ``out_dtype``."""
    eps = {torch.float32: 0.0, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[out_dtype]
    tol = bound + eps * (ref32.abs() + bound) + (2.0**-24 if out_dtype == torch.float16 else 0.0)
    err = (y.float() - ref32).abs()
    worst = (err - tol).max().item() if err.numel() else 0.0
    assert worst <= 0, f"error exceeds the float32 accumulation bound by {worst}"


def pow2_scales(g: torch.Generator, shape, lo: int = 0, hi: int = 4) -> torch.Tensor:
    """Scales ``2**-e`` (exact in fp16): with integer inputs every partial sum is exact in float32."""
    return torch.pow(2.0, -torch.randint(lo, hi + 1, shape, generator=g).float()).half()


@contextlib.contextmanager
def stand_in():
    """The device stand-in: the selector offers the Triton kernels for CPU modules (interpreter only)."""
    need_triton()
    old = os.environ.get(tk.ON_CPU_ENV)
    os.environ[tk.ON_CPU_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(tk.ON_CPU_ENV, None)
        else:
            os.environ[tk.ON_CPU_ENV] = old


def packed_layer(g, bits, N, K, gs, symmetric, act_order, exact, offset=0):
    """A packed module with random codes; ``exact``: power-of-two scales and integer zero-points."""
    G = -(-K // gs)
    codes = torch.randint(0, 1 << bits, (N, K), generator=g, dtype=torch.int32)
    codes[0, 0] = min(offset, 0)  # below the grid (a no-clip quantizer's integer): stored with an offset
    if exact:
        scales = pow2_scales(g, (N, G)).float()
        zeros = torch.randint(0, 1 << bits, (N, G), generator=g).float()
    else:
        scales = (torch.rand(N, G, generator=g) * 0.1 + 1e-3).half().float()
        zeros = (torch.rand(N, G, generator=g) * (1 << bits)).half().float()  # fractional (AWQ-style)
    g_idx = torch.arange(K, dtype=torch.int32) // gs
    if act_order:
        g_idx = g_idx[torch.randperm(K, generator=g)]
    res = QuantResult(codes, scales, zeros, g_idx)
    m = QuantLinear.from_result(res, bits=bits, group_size=gs, symmetric=symmetric)
    return m.to(device())


def make_inputs(g, M, K, exact, dtype=torch.float32):
    x = torch.randint(-4, 5, (M, K), generator=g).float() if exact else torch.randn(M, K, generator=g)
    return x.to(dtype).to(device())
