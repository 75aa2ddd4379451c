"""The compiled kernels as ``torch.library`` custom operators, so that ``torch.compile`` can trace a
quantized model's forward end to end.

A pybind11 call is opaque to dynamo: every one of them was a graph break, so a compiled decode step fell
back to Python between the linears.  Each inference entry point of the C++ extensions is registered here
as ``bitmosaic::NAME`` (``torch.library``, no mutated arguments; :func:`operator`) with a
*fake* implementation that gives the output's shape and dtype from the inputs' alone; dynamo then
records one node per call and inductor calls the operator from its generated code.

The kernel classes (:mod:`.qmatmul`, :mod:`.lut`, :mod:`.intmm`, :mod:`.mosaic`) call the functions
below; under ``torch.compile`` each is the operator, in eager mode its body directly (no dispatcher
hop: :func:`operator`), so eager and compiled run the same code.  The body calls the extension, or --
when it is absent (no compiler, ``$BITMOSAIC_NO_EXT=1``) -- the kernel's pure-torch path
(:mod:`.torch_paths`), so a model compiles and gives the same numbers either way (the fallback runs
inside the opaque operator: its data-dependent loops never reach dynamo).
The instruction set is resolved inside the body on every call (:func:`~bitmosaic.kernels.isa.isa_number`,
``$BITMOSAIC_KERNEL_ISA`` read per call, as before); ``isa`` arguments take an ISA name or ``"auto"``.

Operators (names and arguments follow the extension entry points):

* ``qmatmul`` -- :meth:`LowBitWeight.matmul <bitmosaic.kernels.qmatmul.LowBitWeight.matmul>`;
* ``lut_matmul`` -- :meth:`BitPlaneWeight.matmul <bitmosaic.kernels.lut.BitPlaneWeight.matmul>`
  (SFMP §4.5, App. B Eq. 17);
* ``int_matmul_parts`` -- a dense integer product plus row-block parts over gathered activations in one
  call (MosaicQuant's base and residual, :class:`~bitmosaic.kernels.mosaic.MosaicIntActWeight`);
* ``int8_quantize`` and ``int_matmul`` (``int_matmul_runs``: activation scales that change inside a
  weight group; ``quantize_gathered``: the SQ-format's static parts, gathered and quantized in one
  call) -- :class:`~bitmosaic.kernels.intmm.IntActWeight`'s two steps
  (the activation scales are returned as a new tensor, never the input's storage: an operator's outputs
  may not alias its inputs); ``int_linear`` -- both in one call (what a linear layer with run-time or
  static INT activations runs: one operator per linear instead of two, about 10 us saved per call from a
  compiled graph, where a SmolLM2 decode step makes about 210 of them);
* ``bitmosaic::mosaic_residual`` is registered beside its kernel, in :mod:`.mosaic` (MosaicQuant's
  residual pass; the same conventions), and ``bitmosaic::fp4_gemv`` in :mod:`.fp4lut` (the MXFP4/NVFP4 LUT
  GEMV of the ``mx`` kind, issue 75; the prefill tiles inside the same operator).
"""

from __future__ import annotations

import functools

import torch

from ..formats.act import INT16_SPLIT_QMAX
from ..formats.bitplane import BitPlanes
from . import build
from .isa import isa_number
from .torch_paths import bitplane_dequantize, lowbit_dequantize, tiled_matmul_torch

__all__ = [
    "operator", "qmatmul", "lut_matmul", "int8_quantize", "int_matmul", "int_matmul_runs", "int_linear",
    "int_matmul_parts", "quantize_gathered", "ext_operator", "ext_isa",
    "OPS",
]  # fmt: skip


_LIB = torch.library.Library("bitmosaic", "DEF")  # the operators' namespace (kept alive here)


# operators the C++ extensions define themselves (TORCH_LIBRARY_FRAGMENT, their C++ function as the CPU
# kernel): name -> (extension, fake implementation); the fakes are registered once the extension loads
_EXT_OPS: dict[str, tuple[str, object]] = {}
_ext_fakes_done: set[str] = set()


def ext_operator(name: str, ext: str, fake) -> None:
    """Declare ``bitmosaic::<name>``, an operator the extension ``ext`` defines itself (its C++ function as
    the CPU kernel) with ``fake`` as its fake implementation, registered when :func:`ext_isa` first loads
    the extension."""
    _EXT_OPS[name] = (ext, fake)


@torch._dynamo.assume_constant_result
def ext_isa(name: str, isa: str = "auto") -> int:
    """The ISA number for the extension-defined operator ``bitmosaic::<name>`` (``-1``: the extension is
    absent), after loading the extension (which defines the operator) and registering its fake.  Under
    ``torch.compile`` it runs once, at trace time: a compiled graph keeps the ISA it was compiled with
    (eager calls resolve it per call)."""
    ext_name, fake = _EXT_OPS[name]
    ext = build.load(ext_name)
    if ext is None:
        return -1
    if name not in _ext_fakes_done:
        torch.library.register_fake(f"bitmosaic::{name}", fake, lib=_LIB)
        _ext_fakes_done.add(name)
    return isa_number(isa, ext)


def operator(name: str, ext: str | None = None, isa_arg: int | None = None):
    """Decorator: define the operator ``bitmosaic::<name>`` (schema from ``fn``'s annotations, no mutated
    arguments) with ``fn`` as its CPU kernel, and return a function that calls the operator while dynamo
    traces (``torch.compiler.is_compiling()``) and ``fn`` itself in eager mode -- the same code, without
    the dispatcher hop.  The returned function has ``.op`` (the ``OpOverload``, for ``opcheck``) and
    ``.register_fake``.

    ``ext``: the extension also defines ``bitmosaic::<name>_ext`` -- the same arguments with the ISA name
    at position ``isa_arg`` as its number, the extension's C++ function as its CPU kernel -- and a
    compiled graph calls that one where the extension is built: through the dispatcher straight into C++.
    Measured per call from Python (a 192x576 integer GEMV, 1 thread): 12.8 us through an operator with a
    Python kernel, 7.3 us through the C++-defined one, 4.1 us through pybind; a compiled SmolLM2 decode
    step makes about 210 such calls.

    ``Library.define`` + ``impl`` rather than ``torch.library.custom_op``: the latter wraps each call in
    alias checks and a dynamo-disable frame.  Measured (a 576x576 W4 GEMV, 1 thread, median of 20 x 500
    calls): 25.1 us through pybind, 29.1 us through a ``Library.impl`` operator, 37.7 us through a
    ``custom_op`` one."""

    def wrap(fn):
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=()))
        _LIB.impl(name, fn, "CPU")
        op = getattr(torch.ops.bitmosaic, name).default

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                if ext is not None and not kwargs:
                    n = ext_isa(name + "_ext", args[isa_arg])
                    if n >= 0:
                        return getattr(torch.ops.bitmosaic, name + "_ext").default(
                            *args[:isa_arg], n, *args[isa_arg + 1 :]
                        )
                return op(*args, **kwargs)
            return fn(*args, **kwargs)

        def register_fake(fake):
            if ext is not None:
                _EXT_OPS[name + "_ext"] = (ext, fake)
            return torch.library.register_fake(f"bitmosaic::{name}", lib=_LIB)(fake)

        call.op = op
        call.register_fake = register_fake
        return call

    return wrap


@operator("qmatmul", ext="qmatmul", isa_arg=12)
def qmatmul(
    x: torch.Tensor,
    data: torch.Tensor,
    base: torch.Tensor,
    rowlen: torch.Tensor,
    goff: torch.Tensor,
    bits: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    K: int,
    group_size: int,
    row_block: int,
    tile: int,
    isa: str,
) -> torch.Tensor:
    """``x [M, K]`` float32 times the low-bit weight (layout 2, :mod:`.qmatmul`) -> ``[M, N]`` float32;
    ``tile``: prefill tile rows (negative: one shared tile)."""
    args = (data, base, rowlen, goff, bits, scales, zeros, K, group_size, row_block)
    ext = build.load("qmatmul")
    if ext is not None:
        return ext.qmatmul(x, *args, tile, isa_number(isa, ext))
    return tiled_matmul_torch(x, scales.shape[0], abs(tile), lambda r0, r1: lowbit_dequantize(*args, r0, r1))


@qmatmul.register_fake
def _(x, data, base, rowlen, goff, bits, scales, zeros, K, group_size, row_block, tile, isa):
    return x.new_empty(x.shape[0], scales.shape[0])


@operator("lut_matmul", ext="lutgemv", isa_arg=11)
def lut_matmul(
    x: torch.Tensor,
    data: torch.Tensor,
    offsets: torch.Tensor,
    bits: torch.Tensor,
    scales_t: torch.Tensor,
    zeros_t: torch.Tensor,
    N: int,
    K: int,
    group_size: int,
    row_block: int,
    tile: int,
    isa: str,
    in_index: torch.Tensor | None,
    out_index: torch.Tensor | None,
) -> torch.Tensor:
    """``x[:, in_index] [M, K]`` float32 times the bit-plane weight (:mod:`.lut`), columns ``out_index``
    of the result -> ``[M, n_out]`` float32."""
    ext = build.load("lutgemv")
    geometry = (N, K, group_size, row_block)
    if ext is not None:
        return ext.lut_matmul(
            x,
            data,
            offsets,
            bits,
            scales_t,
            zeros_t,
            *geometry,
            tile,
            isa_number(isa, ext),
            in_index,
            out_index,
        )
    planes = BitPlanes(data, offsets, bits, *geometry)
    if in_index is not None:
        x = x.index_select(1, in_index)
    y = tiled_matmul_torch(x, N, tile, lambda r0, r1: bitplane_dequantize(planes, scales_t, zeros_t, r0, r1))
    return y if out_index is None else y.index_select(1, out_index)


@lut_matmul.register_fake
def _(x, data, offsets, bits, scales_t, zeros_t, N, K, group_size, row_block, tile, isa, in_index, out_index):
    return x.new_empty(x.shape[0], N if out_index is None else out_index.shape[0])


def _intmm(op: str):
    """The compiled ``intmm`` extension, which operator ``op`` needs (RuntimeError without it)."""
    ext = build.load("intmm")
    if ext is None:
        raise RuntimeError(f"bitmosaic::{op} needs the compiled intmm extension")
    return ext


@operator("int8_quantize")
def int8_quantize(
    x: torch.Tensor,
    act_scale: torch.Tensor | None,
    act_group: int,
    qmax: float,
    KP: int,
    group_size: int,
    G: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [M, KP] int8, qsum [M, G] int32, scales)`` of ``x [M, K]`` float32 (:meth:`IntActWeight.quantize
    <bitmosaic.kernels.intmm.IntActWeight.quantize>`); ``act_scale=None``: dynamic, per token ``[M, 1]``
    (``act_group >= K``) or per group of ``act_group`` columns ``[M, ceil(K / act_group)]``."""
    K = x.shape[1]
    ext = build.load("intmm")
    if act_scale is None and ext is None:  # dynamic per token, or per group of act_group columns
        a = x.abs()
        if act_group < K:
            a = torch.nn.functional.pad(a, (0, -K % act_group)).reshape(x.shape[0], -1, act_group)
        act_scale = (a.amax(-1).reshape(x.shape[0], -1) / qmax).clamp(min=1e-12)
    if ext is not None:
        sa = torch.empty(0) if act_scale is None else act_scale.float().contiguous()
        isa_n = isa_number(ext=ext)
        q, qsum, sa_out = ext.quantize(x.contiguous(), sa, act_group, float(qmax), KP, group_size, G, isa_n)
        return q, qsum, sa_out.clone() if act_scale is not None else sa_out
    sa = act_scale.float().clone().contiguous()
    s = sa.repeat_interleave(act_group, dim=1)[:, :K]
    q = torch.round(x / s).clamp_(-qmax - 1, qmax).to(torch.int32)
    if qmax == INT16_SPLIT_QMAX:  # 16-bit: the high halves' rows, then the low halves' (csrc/intmm_common.h)
        h = (q + 128) >> 8
        q = torch.cat([h, q - 256 * h])
        sa = sa.expand(x.shape[0], -1)
        sa = torch.cat([sa * 256, sa]).contiguous()
    q = torch.nn.functional.pad(q.to(torch.int8), (0, KP - K))
    pad = G * group_size - KP
    qs = torch.nn.functional.pad(q.to(torch.int32), (0, max(pad, 0)))[:, : G * group_size]
    return q, qs.reshape(q.shape[0], G, -1).sum(-1, dtype=torch.int32), sa


@int8_quantize.register_fake
def _(x, act_scale, act_group, qmax, KP, group_size, G):
    split = qmax == INT16_SPLIT_QMAX  # 16-bit activations: twice the rows (the two int8 halves)
    M = x.shape[0]
    R = 2 * M if split else M
    q = x.new_empty(R, KP, dtype=torch.int8)
    qsum = x.new_empty(R, G, dtype=torch.int32)
    Gd = -(-x.shape[1] // act_group) if act_group < x.shape[1] else 1
    if split:
        sa = x.new_empty(R, Gd if act_scale is None else act_scale.shape[1])
    else:
        sa = x.new_empty(M, Gd) if act_scale is None else torch.empty_like(act_scale, dtype=torch.float32)
    return q, qsum, sa


@operator("int_matmul")
def int_matmul(
    q: torch.Tensor,
    qsum: torch.Tensor,
    sa: torch.Tensor,
    ratio: int,
    data: torch.Tensor,
    sc: torch.Tensor,
    zc: torch.Tensor,
    N: int,
    G: int,
    group_size: int,
    bytes_layout: bool,
    b8: bool,
) -> torch.Tensor:
    """``y [M, N]`` float32 from int8 activations and the integer weight layout (:mod:`.intmm`); needs the
    ``intmm`` extension (:class:`~bitmosaic.kernels.intmm.IntActWeight` runs ``torch._int_mm`` without it)."""
    ext = _intmm("int_matmul")
    layout = (data, sc, zc, N, G, group_size, bytes_layout, b8)
    return ext.int_matmul(q, qsum, sa, ratio, *layout, isa_number(ext=ext))


@int_matmul.register_fake
def _(q, qsum, sa, ratio, data, sc, zc, N, G, group_size, bytes_layout, b8):
    return q.new_empty(q.shape[0], N, dtype=torch.float32)


@operator("int_matmul_runs")
def int_matmul_runs(
    q: torch.Tensor,
    qz: torch.Tensor,
    sa: torch.Tensor,
    run: int,
    data: torch.Tensor,
    sc: torch.Tensor,
    zc: torch.Tensor,
    N: int,
    G: int,
    group_size: int,
    bytes_layout: bool,
    b8: bool,
) -> torch.Tensor:
    """:func:`int_matmul` where the activation scale changes every ``run`` columns inside a weight group
    (:meth:`IntActWeight.product_runs <bitmosaic.kernels.intmm.IntActWeight.product_runs>`: ``sa [1 or M,
    G * runs per group]``, ``qz [M, G]``); needs the ``intmm`` extension."""
    ext = _intmm("int_matmul_runs")
    layout = (data, sc, zc, N, G, group_size, bytes_layout, b8)
    return ext.int_matmul_runs(q, qz, sa, run, *layout, isa_number(ext=ext))


@int_matmul_runs.register_fake
def _(q, qz, sa, run, data, sc, zc, N, G, group_size, bytes_layout, b8):
    return q.new_empty(q.shape[0], N, dtype=torch.float32)


@operator("quantize_gathered")
def quantize_gathered(
    x: torch.Tensor,
    chan: torch.Tensor,
    act: torch.Tensor,
    run: int,
    n_scales: int,
    qmax: float,
    qmax2: float,
    n1: int,
    scales: torch.Tensor | None,
    KP: int,
    sub: int,
    min_scale: float,
    fp16: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [M, KP] int8, run sums [M, R] int32, run scales [1 or M, R], qz [M, R / sub])``: the columns
    ``x[:, chan]`` quantized symmetrically in runs of ``run`` columns, run ``r`` under scale column
    ``act[r]`` of ``n_scales``, the first ``n1`` columns on the grid ``±qmax`` and the rest on ``±qmax2`` (a
    multiple of ``run``: both SQ parts in one call) -- ``scales [1 or M, n_scales]`` given (calibrated) or,
    when None, per token
    from the absmax over the gathered columns of each scale column (``min(max(amax / qmax, min_scale),
    65504)``, fp16-rounded where ``fp16``: :func:`bitmosaic.formats.sq.fp16_scale`); ``qz``: per group
    of ``sub`` runs ``Σ scale · run sum`` (:meth:`IntActWeight.product_runs
    <bitmosaic.kernels.intmm.IntActWeight.product_runs>`).  The SQ-format's static parts
    (:class:`~bitmosaic.modules.sq.SQActLinear`); needs the ``intmm`` extension."""
    ext = _intmm("quantize_gathered")
    sa = torch.empty(0) if scales is None else scales.float().contiguous()
    return tuple(ext.quantize_gathered(
        x.contiguous(), chan, act, run, n_scales, float(qmax), float(qmax2), n1, sa, KP, sub,
        float(min_scale), fp16, isa_number(ext=ext),
    ))  # fmt: skip


@quantize_gathered.register_fake
def _(x, chan, act, run, n_scales, qmax, qmax2, n1, scales, KP, sub, min_scale, fp16):
    M, R = x.shape[0], act.shape[0]
    Ms = M if scales is None else scales.shape[0]
    return (x.new_empty(M, KP, dtype=torch.int8), x.new_empty(M, R, dtype=torch.int32), x.new_empty(Ms, R),
            x.new_empty(M, R // sub))  # fmt: skip


def _int_linear_fake(x, act_scale, act_group, qmax, KP, ratio, data, sc, zc, N, *rest):
    return x.new_empty(x.shape[0], N, dtype=torch.float32)


_EXT_OPS["int_linear"] = ("intmm", _int_linear_fake)


def int_linear(
    x: torch.Tensor, act_scale: torch.Tensor | None, act_group: int, qmax: float, KP: int, ratio: int, *layout
) -> torch.Tensor:
    """:func:`int8_quantize` of ``x [M, K]`` float32 then :func:`int_matmul` on ``layout`` (its ``data, sc,
    zc, N, G, group_size, bytes_layout, b8``), in one call: ``y [M, N]`` float32, the same numbers as the
    two calls; needs the extension.  The operator ``bitmosaic::int_linear`` (with the ISA number as a last
    argument) is defined by the extension itself (``csrc/intmm.cpp``) with its C++ function as the CPU
    kernel, so a compiled graph calls C++ through the dispatcher without a Python kernel in between (about
    5 us a call saved, ~210 calls a SmolLM2 token); in eager mode the same function runs through pybind."""
    isa = ext_isa("int_linear")
    if isa < 0:
        raise RuntimeError("bitmosaic::int_linear needs the compiled intmm extension")
    args = (x, act_scale, act_group, float(qmax), KP, ratio, *layout, isa)
    if torch.compiler.is_compiling():
        return torch.ops.bitmosaic.int_linear.default(*args)
    return build.load("intmm").int_linear(*args)


@operator("int_matmul_parts")
def int_matmul_parts(
    q: torch.Tensor,
    qsum: torch.Tensor,
    sa: torch.Tensor,
    ratio: int,
    data: torch.Tensor,
    sc: torch.Tensor,
    zc: torch.Tensor,
    N: int,
    G: int,
    group_size: int,
    rq: torch.Tensor,
    rqs: torch.Tensor,
    rsa: torch.Tensor,
    rdata: torch.Tensor,
    rsc: torch.Tensor,
    rzc: torch.Tensor,
    parts: torch.Tensor,
    pair_cols: torch.Tensor,
    rgs: int,
) -> torch.Tensor:
    """A dense integer weight plus row-block parts over gathered activations, in one call (MosaicQuant's
    base and residual: :class:`~bitmosaic.kernels.mosaic.MosaicIntActWeight`): :func:`int_matmul` of the
    dense weight, then the parts (``parts`` rows ``(r0, rows, pc0, ncols, g0, G)``, 4-bit layouts one
    after another in ``rdata``/``rsc``/``rzc``, pair ``i`` of a part reading ``rq`` at column
    ``pair_cols[pc0 + i]``) added into the same fresh
    output by the extension's ``int_parts``; needs the extension."""
    ext = _intmm("int_matmul_parts")
    isa = isa_number(ext=ext)
    y = ext.int_matmul(q, qsum, sa, ratio, data, sc, zc, N, G, group_size, False, False, isa)
    ext.int_parts(y, rq, rqs, rsa, rdata, rsc, rzc, parts, pair_cols, rgs, isa)
    return y


@int_matmul_parts.register_fake
def _(
    q, qsum, sa, ratio, data, sc, zc, N, G, group_size, rq, rqs, rsa, rdata, rsc, rzc, parts, pair_cols, rgs
):
    return q.new_empty(q.shape[0], N, dtype=torch.float32)


# name -> OpOverload (mosaic_residual is registered in mosaic.py; int_linear: the extension's)
_FNS = (
    qmatmul, lut_matmul, int8_quantize, int_matmul, int_matmul_runs, quantize_gathered, int_matmul_parts,
)  # fmt: skip
OPS = {f.op.name(): f.op for f in _FNS}
