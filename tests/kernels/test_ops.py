"""The kernels as ``torch.library`` operators (kernels/ops.py): ``opcheck`` (schema, fake tensors, autograd
registration, AOT dispatch with static and dynamic shapes) on each operator with small inputs, the
operator equal to the extension's own call, and the kernel classes going through the operators."""

from __future__ import annotations

import pytest
import torch

from bitmosaic.formats.mx import mx_quantize
from bitmosaic.kernels import build, fp4lut, intmm, isa, mosaic, ops
from bitmosaic.kernels.intmm import IntActWeight
from bitmosaic.kernels.lut import BitPlaneWeight
from bitmosaic.kernels.qmatmul import LowBitWeight
from tests.kernels.test_mosaic_decode import _weight as mosaic_weight

G = torch.Generator().manual_seed(0)


def _codes(N, K, bits):
    return torch.randint(0, 1 << bits, (N, K), generator=G)


def _affine(N, groups):
    scales = torch.rand(N, groups, generator=G) * 0.1 + 0.01
    return scales, torch.randint(0, 4, (N, groups), generator=G).float()


def _lowbit(N=24, K=96, bits=4, gs=32):
    s, z = _affine(N, -(-K // gs))
    return LowBitWeight.from_codes(_codes(N, K, bits), bits, s, z, gs)


def _lut(N=24, K=96, bits=2, gs=32):
    s, z = _affine(N, -(-K // gs))
    return BitPlaneWeight.from_codes(_codes(N, K, bits), bits, s, z, gs)


def _int(N=24, K=96, bits=4, gs=32):
    s, z = _affine(N, -(-K // gs))
    return IntActWeight.from_codes(_codes(N, K, bits), bits, s, z, gs)


@pytest.mark.parametrize("rows", [1, 3, 20])  # decode GEMV and the prefill tiles
def test_qmatmul_op(rows):
    w = _lowbit()
    x = torch.randn(rows, w.K, generator=G)
    torch.library.opcheck(ops.qmatmul.op, (x, *w._args(), 8, "auto"))
    ref = x @ w.dequantize().T
    torch.testing.assert_close(ops.qmatmul(x, *w._args(), 8, "auto"), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 80])
@pytest.mark.parametrize("index", [False, True])
def test_lut_matmul_op(rows, index):
    w = _lut()
    x = torch.randn(rows, w.K, generator=G)
    i_in = torch.randperm(w.K, generator=G).to(torch.int32) if index else None
    i_out = torch.randperm(w.N, generator=G)[:10] if index else None
    args = (x, *w._args(), 8, "auto", i_in, i_out)
    torch.library.opcheck(ops.lut_matmul.op, args)
    xs = x if i_in is None else x[:, i_in.long()]
    ref = xs @ w.dequantize().T
    ref = ref if i_out is None else ref[:, i_out]
    torch.testing.assert_close(ops.lut_matmul(*args), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("static", [False, True])
def test_int8_ops(static):
    w = _int()
    x = torch.randn(3, w.K, generator=G)
    sa = torch.full((1, 1), 0.03) if static else None
    qargs = (x, sa, w.K, 127.0, w.KP, w.group_size, w.G)
    torch.library.opcheck(ops.int8_quantize.op, qargs)
    q, qsum, s = ops.int8_quantize(*qargs)
    assert q.dtype == torch.int8 and qsum.dtype == torch.int32 and tuple(q.shape) == (3, w.KP)
    if sa is not None:
        assert s.data_ptr() != sa.data_ptr() and torch.equal(s, sa)  # a copy, never the input's storage
    torch.testing.assert_close(qsum, q.int().reshape(3, w.G, -1).sum(-1, dtype=torch.int32))
    if intmm.extension() is None:
        pytest.skip("no C++ compiler for the intmm extension (int_matmul needs it)")
    margs = (q, qsum, s, w.G, w.data, w.sc, w.zc, w.N, w.G, w.group_size, w.bits > 4, w.bits == 8)
    torch.library.opcheck(ops.int_matmul.op, margs)
    y = ops.int_matmul(*margs)
    ref = (q[:, : w.K].float() * s) @ ((w.codes().float() - w.zeros().repeat_interleave(32, 1)) *
                                       w.scales().repeat_interleave(32, 1)).T  # fmt: skip
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    # both steps in one operator: the same numbers, bit for bit
    layout = (w.data, w.sc, w.zc, w.N, w.G, w.group_size, w.bits > 4, w.bits == 8)
    largs = (x, sa, w.K, 127.0, w.KP, w.G, *layout)
    assert torch.equal(ops.int_linear(*largs), y)  # (loads the operator the extension defines)
    op = torch.ops.bitmosaic.int_linear.default
    torch.library.opcheck(op, (*largs, isa.isa_number(ext=intmm.extension())))
    assert torch.equal(w.matmul(x, sa, w.K, 127.0), y)  # IntActWeight.matmul takes the one-operator route


@pytest.mark.parametrize("calibrated", [False, True])
def test_runs_ops(calibrated):
    """``quantize_gathered`` then ``int_matmul_runs`` (the SQ-format's static parts): operators that pass
    ``opcheck``, and the product equals the float product of the levels and their run scales."""
    if intmm.extension() is None:
        pytest.skip("no C++ compiler for the intmm extension (the runs operators need it)")
    w = _int()
    run, sub = 8, w.runs_per_group(8)
    R = w.G * sub
    x = torch.randn(5, w.K, generator=G)
    chan = torch.randperm(w.K, generator=G)
    act = torch.arange(R) // 2  # two runs per scale column
    scales = torch.rand(1, R // 2, generator=G) * 0.05 + 0.01 if calibrated else None
    gargs = (x, chan, act, run, R // 2, 127.0, 127.0, w.K, scales, w.KP, sub, 2.0**-24, True)
    torch.library.opcheck(ops.quantize_gathered.op, gargs)
    q, sums, sa, qz = ops.quantize_gathered(*gargs)
    assert q.dtype == torch.int8 and sums.shape == (5, R) and qz.shape == (5, w.G)
    s_col = sa.expand(5, -1).repeat_interleave(run, 1)[:, : w.K]
    want = torch.round(x[:, chan] / s_col).clamp(-127, 127)
    assert torch.equal(q[:, : w.K].float(), want)
    margs = (q, qz, sa, run, w.data, w.sc, w.zc, w.N, w.G, w.group_size, w.bits > 4, w.bits == 8)
    torch.library.opcheck(ops.int_matmul_runs.op, margs)
    wd = (w.codes().float() - w.zeros().repeat_interleave(32, 1)) * w.scales().repeat_interleave(32, 1)
    torch.testing.assert_close(ops.int_matmul_runs(*margs), (want * s_col) @ wd.T, rtol=1e-4, atol=1e-4)


def test_mosaic_residual_op():
    if build.load("mosaic") is None:
        pytest.skip("no C++ compiler for the mosaic extension")
    k = mosaic_weight(40, 96, (16, 32), 0.3, seed=1)
    x = torch.randn(2, 96, generator=G)
    y0 = torch.randn(2, 40, generator=G)
    args = (x, k.codes_t, k.scales, k.cb, k.starts_t, y0, k.bm)
    torch.library.opcheck(mosaic.mosaic_residual.op, args)
    y = mosaic.mosaic_residual(*args)
    torch.testing.assert_close(y, y0 + k.sparse_only(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 40])  # the FP4 LUT GEMV and the prefill tiles
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_gemv_op(fmt, rows):
    """``bitmosaic::fp4_gemv`` (registered beside its kernel, kernels/fp4lut.py): opcheck, and the reference
    product (with or without the extension)."""
    w = fp4lut.FP4LutWeight.from_tensor(mx_quantize(torch.randn(24, 96, generator=G), fmt))
    x = torch.randn(rows, w.K, generator=G)
    args = (x, *w._args(), "auto")
    torch.library.opcheck(fp4lut.fp4_gemv.op, args)
    torch.testing.assert_close(fp4lut.fp4_gemv(*args), x @ w.dequantize().T, rtol=1e-5, atol=1e-5)
    assert torch.equal(w.matmul(x), fp4lut.fp4_gemv(*args))
    if rows <= fp4lut.GEMV_ROWS and fp4lut.extension() is not None:  # what a compiled graph calls
        ext_args = (x, *w._args(), ops.ext_isa("fp4_gemv_ext"))  # loads it, registers its fake
        torch.library.opcheck(torch.ops.bitmosaic.fp4_gemv_ext.default, ext_args)
        assert torch.equal(torch.ops.bitmosaic.fp4_gemv_ext.default(*ext_args), w.matmul(x))


@pytest.mark.parametrize("per_group", [False, True])
def test_int_matmul_parts_op(per_group):
    """MosaicQuant's dense base + residual row blocks in one operator (opcheck: schema, fake, autograd
    registration), equal to the dense product plus each part's own product on its gathered integers."""
    from bitmosaic.formats.act import ActQuantSpec
    from tests.kernels.test_mosaic_int import _mosaic

    if intmm.extension() is None:
        pytest.skip("no C++ compiler for the intmm extension")
    spec = ActQuantSpec("int", 8, granularity="group", group_size=16) if per_group else ActQuantSpec("int", 8)
    m, g = _mosaic(40, 96, (16, 32), 0.3, spec, 1)
    w = m._build_int_act().weight
    calls = []
    real = ops.int_matmul_parts
    try:
        ops.int_matmul_parts = lambda *a: calls.append(a) or real(*a)
        y = w.matmul(torch.randn(3, 96, generator=g), None, 96, 127.0)
    finally:
        ops.int_matmul_parts = real
    assert len(calls) == 1 and len(w.parts) > 1
    torch.library.opcheck(ops.int_matmul_parts.op, calls[0])
    q, qsum, sa, ratio, *_, rq, rqs, rsa, _, _, _, _, pair_cols, _ = calls[0]
    d = w.dense
    ref = d.product(q, qsum, sa, ratio, route="int_mm")
    per = w.bk // w.gs
    for r0, r1, pw, s0, s1 in w.parts:  # each part on its blocks' own columns of q
        sg, rg = (rsa, pw.G) if rsa.shape[1] == 1 else (rsa[:, s0 * per : s1 * per], 1)
        cols = (pair_cols[s0 * w.bk // 8 : s1 * w.bk // 8, None].long() + torch.arange(8)).reshape(-1)
        qs = rqs[:, s0 * per : s1 * per].contiguous()
        ref[:, r0:r1] += pw.product(rq.index_select(1, cols), qs, sg, rg, route="int_mm")
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_kernel_classes_call_the_operators(monkeypatch):
    """Each kernel class's matmul goes through its operator (the graph dynamo records), not the pybind
    call, and gives the operator's result."""
    seen = []
    for name in ("qmatmul", "lut_matmul", "int8_quantize", "int_linear"):
        op = getattr(ops, name)

        def spy(*a, _op=op, _name=name, **kw):
            seen.append(_name)
            return _op(*a, **kw)

        monkeypatch.setattr(ops, name, spy)
    x = torch.randn(2, 96, generator=G)
    _lowbit().matmul(x)
    _lut().matmul(x)
    _int().matmul(x, None, 96, 127.0)
    # the integer path: quantize and multiply in one operator where the extension defines it
    assert seen == ["qmatmul", "lut_matmul", "int_linear" if intmm.extension() else "int8_quantize"]


def test_isa_is_resolved_per_call(monkeypatch):
    """The ISA override is still read at every call, inside the operator."""
    if not isa.available_isas():
        pytest.skip("no compiled extension")
    w = _lowbit()
    x = torch.randn(1, w.K, generator=G)
    monkeypatch.setenv(isa.ISA_ENV, "not-an-isa")
    with pytest.raises(ValueError, match="not one of"):
        w.matmul(x)


@pytest.mark.parametrize("kind", ["qmatmul", "lut_matmul", "int_linear"])
def test_compiled_graphs_call_the_extension_defined_operators(kind):
    """Under torch.compile the kernel classes call the operators the extensions define themselves (C++
    kernels, no Python in between: ``*_ext`` and ``int_linear``), with eager's numbers bit for bit and a
    fake implementation that opcheck accepts."""
    if build.load({"qmatmul": "qmatmul", "lut_matmul": "lutgemv", "int_linear": "intmm"}[kind]) is None:
        pytest.skip("no C++ compiler for the extension")
    w = {"qmatmul": _lowbit, "lut_matmul": _lut, "int_linear": _int}[kind]()
    x = torch.randn(3, w.K, generator=G)
    f = (lambda x: w.matmul(x, None, w.K, 127.0)) if kind == "int_linear" else w.matmul
    targets: list[str] = []

    def backend(gm, example_inputs):  # records the graph's calls, runs it as traced
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    y = torch.compile(f, backend=backend, fullgraph=True)(x)
    name = kind if kind == "int_linear" else kind + "_ext"
    assert f"bitmosaic.{name}.default" in targets, targets
    assert torch.equal(y, f(x))
    n = isa.isa_number(ext=build.load({"qmatmul": "qmatmul", "lut_matmul": "lutgemv"}.get(kind, "intmm")))
    if kind == "qmatmul":
        torch.library.opcheck(torch.ops.bitmosaic.qmatmul_ext.default, (x, *w._args(), 8, n))
    elif kind == "lut_matmul":
        torch.library.opcheck(torch.ops.bitmosaic.lut_matmul_ext.default, (x, *w._args(), 8, n, None, None))
