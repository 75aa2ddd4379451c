"""The Triton GPU kernels (issue 76) against bf16 ``F.linear`` (and vLLM's Marlin when importable), timed.

One prepared script for a lent GPU, within one 10-minute call: for each kernel -- the packed INT kinds
(W2/W3/W4/W8, g128, W4 act-order), SSQR's dense + CSR outliers (W3 + 0.5 % outliers), DPQ's INT4 -> E4M3
weight, MosaicQuant's fused W4 base + 5 % of 64x64 residual blocks and SQ-format's static split (W4 g128,
16-(8/4)-0.75 bank-scaled activations; both also against their dense INT4 kernel alone) -- at 1, 16 and
512 rows of bf16 ``x`` on the SmolLM2-135M and Llama-3-8B linear shapes, it checks
the kernel against ``F.linear(x, W.to(bf16))`` on the same device (max relative error) and times both (CUDA
events, median); then an end-to-end greedy decode of a SmolLM2-135M-shaped Llama (random weights, RTN W4
g128) with the Triton kernels against the same model in bf16.  A time budget (``--budget``, seconds) stops
it early with what was measured so far.  Writes ``benchmarks/results/gpu_kernels.{json,md}``.

Also DPQ's FP8 tensor-core path (``_dpq_fp8_rows``: a DPQ layer with its static E4M3 input quantizer, the
fp8 ``tl.dot`` against the float path, W4A16 and bf16, and its error in units of the float32 accumulation
bound) and SFMP's module path (``_sfmp_rows``: an ``SFMPLinear`` with permutations and mixed 2-4-bit
blocks on the Triton bit-plane kernel, after that kernel's 1-row latency at W1/2/3/4/6/8 on the 8B shapes).

Fits one 10-minute call on an H100 by construction: 168 kernel rows (8 shapes x 7 kernels x 3 row counts;
3 timed functions at most), 24 DPQ FP8 rows (5 timed functions), 24 SFMP module rows (2) and 4 width rows
(6 widths), every timed function 3 warm-up + 20 timed calls (``_timed``), then 2 decodes of 64 tokens.  Each
section checks its share of ``--budget`` (default 480 s: kernels until 40 %, DPQ until 55 %, SFMP until
75 %, decode in the rest, skipped under 60 s) before each shape or row, so a run ends within the budget
plus one row's setup (its module built and its kernels compiled) and writes what it measured.

Without a GPU it prints one line and writes nothing; ``--interpret`` then runs a tiny exactness check of
every kernel in Triton's interpreter instead (no timings).

Run: python -m benchmarks.gpu_kernels [--budget 480] [--interpret]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

SHAPES = {  # (in, out) of each distinct linear
    "smollm2-135m": [(576, 576), (576, 192), (576, 1536), (1536, 576)],
    "llama-8b": [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)],
}
ROWS = (1, 16, 512)
KERNELS = {  # name -> (bits, group, act_order, outlier fraction, fp8)
    "int2 g128": (2, 128, False, 0.0, False),
    "int3 g128": (3, 128, False, 0.0, False),
    "int4 g128": (4, 128, False, 0.0, False),
    "int4 g128 act-order": (4, 128, True, 0.0, False),
    "int8 g128": (8, 128, False, 0.0, False),
    "ssqr int3 + 0.5% csr": (3, 128, False, 0.005, False),
    "dpq int4 -> e4m3": (4, 128, False, 0.0, True),
}
FUSED = {  # name -> (kind, setting): MosaicQuant's base + residual kernel, SQ-format's static split GEMM
    "mosaic w4 + 5% 64x64 blocks": ("mosaic", 0.05),
    "sq static 16-(8/4)-0.75 w4 g128": ("sq", "16-(8/4)-0.75"),
}


def _module(k_in: int, n_out: int, spec, device, seed: int = 0):
    """A quantized module of ``spec`` with random codes (the kernels' speed does not depend on them)."""
    from bitmosaic.algorithms.types import QuantResult
    from bitmosaic.modules.qlinear import QuantLinear
    from bitmosaic.modules.qmodules import FP8ComputeQuantLinear, SparseOutlierQuantLinear

    if isinstance(spec[0], str):
        return _fused_module(k_in, n_out, spec, device, seed)
    bits, gs, act, frac, fp8 = spec
    g = torch.Generator().manual_seed(seed)
    G = -(-k_in // gs)
    codes = torch.randint(0, 1 << bits, (n_out, k_in), generator=g, dtype=torch.int32)
    scales = (torch.rand(n_out, G, generator=g) * 0.01 + 1e-3).half().float()
    zeros = torch.full((n_out, G), float(1 << (bits - 1)))
    g_idx = torch.arange(k_in, dtype=torch.int32) // gs
    if act:
        g_idx = g_idx[torch.randperm(k_in, generator=g)]
    m = QuantLinear.from_result(
        QuantResult(codes, scales, zeros, g_idx), bits=bits, group_size=gs, symmetric=False
    )
    if frac:
        nnz_mask = torch.rand(n_out, k_in, generator=g) < frac
        sparse = torch.where(nnz_mask, torch.randn(n_out, k_in, generator=g) * 0.05, torch.zeros(())).half()
        csr = sparse.float().to_sparse_csr()
        s = SparseOutlierQuantLinear._from_packed(m, nnz=csr.values().numel())
        s.outlier_row_ptr.copy_(csr.crow_indices())
        s.outlier_cols.copy_(csr.col_indices())
        s.outlier_vals.copy_(csr.values())
        m = s
    if fp8:
        d = FP8ComputeQuantLinear._from_packed(m, fmt="e4m3", fp8_rows=1)
        d.fp8_scale.fill_(0.5)
        m = d
    return m.to(device)


def _fused_module(k_in: int, n_out: int, spec, device, seed: int = 0):
    """MosaicQuant (random per-channel W4 base, ``density`` of random 64x64 residual blocks) or SQ-format
    static activations (random W4 g128, a random static mask of ``sq``, per-bank activation scales)."""
    from bitmosaic.algorithms.sq import static_channel_mask
    from bitmosaic.formats.packing import pack_codes
    from bitmosaic.formats.sq import parse_sq
    from bitmosaic.modules.mosaic import MosaicQuantLinear
    from bitmosaic.modules.sq import SQActLinear

    kind, setting = spec
    g = torch.Generator().manual_seed(seed)
    if kind == "sq":
        dense = _module(k_in, n_out, (4, 128, False, 0.0, False), "cpu", seed)
        mask = static_channel_mask(torch.rand(k_in, generator=g), parse_sq(setting))
        return SQActLinear.from_packed(dense, setting, "static", "bank", mask).to(device)
    bm = bk = 64
    m = MosaicQuantLinear(k_in, n_out, bits=4, group_size=None, symmetric=True, block_rows=bm, block_cols=bk,
                          n_blocks=0)  # fmt: skip
    nb = -(-n_out // bm) * -(-k_in // bk)
    idx = torch.nonzero(torch.rand(nb, generator=g) < setting).reshape(-1).to(torch.int32)
    m.qweight.copy_(pack_codes(torch.randint(0, 16, (n_out, k_in), generator=g, dtype=torch.int32), 4))
    m.scales.copy_((torch.rand(n_out, 1, generator=g) * 0.01 + 1e-3).half())
    m.res_index = idx
    m.res_qweight = pack_codes(
        torch.randint(0, 16, (idx.numel() * bm, bk), generator=g, dtype=torch.int32), 4
    )
    m.res_scales = (torch.rand(idx.numel(), bm, generator=g) * 1e-3).half()
    return m.to(device)


def _dense_int(k_in: int, n_out: int, spec, device):
    """The dense INT kernel a fused kind is compared with: its W4 base alone (per channel for mosaic)."""
    if not isinstance(spec[0], str):
        return None
    return _module(k_in, n_out, (4, k_in if spec[0] == "mosaic" else 128, False, 0.0, False), device)


def _reference(m, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What ``m(x)`` should be: ``F.linear`` on the bf16 weight, or the SQ split's own float forward."""
    import torch.nn.functional as F

    from bitmosaic.modules.sq import SQActLinear

    return m._linear(x, w, None) if isinstance(m, SQActLinear) else F.linear(x, w.to(x.dtype))


def _ran(m) -> str:
    """The kernel class ``m`` runs (its dense part's weight for SSQR)."""
    k = m.kernel()
    if k is None:
        return "F.linear"
    w = getattr(k, "weight", None) or getattr(getattr(k, "dense", None), "weight", None)
    return f"{type(k).__name__}({type(w).__name__})" if w is not None else type(k).__name__


def _timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _marlin():
    """vLLM's Marlin W4 GEMM as ``(setup(w_bf16, group) -> fn(x))``, or ``(None, why)``."""
    try:
        from vllm.model_executor.layers.quantization.utils.marlin_utils_test import marlin_quantize
        from vllm.scalar_type import scalar_types
    except Exception as e:  # not installed, or an API this script does not know
        return None, f"vLLM Marlin not importable ({type(e).__name__}: {e})"[:160]

    def setup(w: torch.Tensor, group: int):
        from vllm.model_executor.layers.quantization.utils.marlin_utils import (
            apply_gptq_marlin_linear,
            marlin_make_workspace_new,
        )

        n, k = w.shape
        _, q, s, g_idx, sort, _ = marlin_quantize(w.T.contiguous(), scalar_types.uint4b8, group, False)
        ws = marlin_make_workspace_new(w.device)
        zp = torch.empty(0, dtype=torch.int, device=w.device)

        def fn(x):
            return apply_gptq_marlin_linear(x, q, s, zp, g_idx, sort, ws, scalar_types.uint4b8, n, k, True)

        return fn

    return setup, ""


def _linear_rows(deadline: float) -> list[dict]:
    import torch.nn.functional as F

    dev = torch.device("cuda")
    marlin_setup, marlin_why = _marlin()
    rows = []
    for model, shapes in SHAPES.items():
        for k_in, n_out in shapes:
            for name, spec in {**KERNELS, **FUSED}.items():
                if time.time() > deadline:
                    return rows
                m = _module(k_in, n_out, spec, dev)
                base = _dense_int(k_in, n_out, spec, dev)
                w = m.dequantize_reference().to(dev)
                wb = w.bfloat16()
                marlin = None
                if marlin_setup is not None and name == "int4 g128":
                    try:
                        marlin = marlin_setup(wb, 128)
                    except Exception as e:
                        marlin_why = f"Marlin setup failed ({type(e).__name__}: {e})"[:160]
                for r in ROWS:
                    x = torch.randn(r, k_in, device=dev, dtype=torch.bfloat16)
                    with torch.no_grad():
                        y = m(x).float()
                        ref = _reference(m, x, w).float()
                        err = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                        t_k = _timed(lambda: m(x))
                        t_b = _timed(lambda: F.linear(x, wb))
                        t_m = _timed(lambda: marlin(x)) if marlin is not None else None
                        t_i = _timed(lambda: base(x)) if base is not None else None
                    kname = _ran(m)
                    rows.append({"model": model, "in": k_in, "out": n_out, "kernel": name, "rows": r,
                                 "ran": kname, "bf16_ms": t_b, "triton_ms": t_k, "marlin_ms": t_m,
                                 "int4_ms": t_i, "max_rel_err": err})  # fmt: skip
                    print(f"{model:>12} {k_in:>6}x{n_out:<6} {name:>22} m={r:<4} bf16 {t_b:8.4f} ms  "
                          f"triton {t_k:8.4f} ms  x{t_b / t_k:5.2f}  err {err:.1e}", flush=True)  # fmt: skip
    rows.append({"marlin": marlin_why or "measured"})
    return rows


def _decode(deadline: float, tokens: int = 64) -> dict:
    """Greedy decode of a SmolLM2-135M-shaped Llama (random weights): bf16 vs RTN W4 g128 on Triton."""
    if time.time() > deadline - 60:
        return {"skipped": "time budget"}
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    import bitmosaic
    from bitmosaic.modules.base import prepare_kernels

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    dense = LlamaForCausalLM(cfg).eval()
    q = copy.deepcopy(dense)
    calib = torch.randint(0, cfg.vocab_size, (2, 32))
    bitmosaic.quantize_(q, "rtn", calib, progress=False, bits=4, group_size=128)
    dense = dense.to("cuda", torch.bfloat16)
    q = q.to("cuda", torch.bfloat16)
    prepare_kernels(q)
    ids = torch.randint(0, cfg.vocab_size, (1, 16), device="cuda")
    out = {}
    for name, model in (("bf16", dense), ("triton w4", q)):
        kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, do_sample=False)
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, **kw)
            torch.cuda.synchronize()
        out[name] = tokens / (time.perf_counter() - t)
        print(f"decode {name}: {out[name]:.1f} tokens/s", flush=True)
    return {"tokens": tokens, "tokens_per_s": out}


DPQ_FP8 = "dpq w4a8 fp8 dot"  # DPQ with its static per-tensor E4M3 input quantizer: FP8 operands on tl.dot


def _dpq_fp8_rows(deadline: float) -> list[dict]:
    """DPQ's FP8 tensor-core path (issue 76; DPQ §3 Fig. 3, §4.3): a DPQ layer with a static per-tensor E4M3
    input quantizer runs the INT4 -> E4M3 weights and E4M3 activations on an fp8 ``tl.dot`` (capability >=
    8.9).  Per shape and row count it times the layer (``layer_ms``: the input quantizer included), its
    kernel alone on the quantized input (``fp8_ms``), the same kernel on the float path
    (``$BITMOSAIC_TRITON_FP8_DOT=0``: ``float_ms``), the W4A16 Triton kernel (``w4a16_ms``) and bf16
    ``F.linear`` (``bf16_ms``); ``err_over_bound``: the float32-input product's largest error against
    :func:`bitmosaic.kernels.fp8.fp8_gemm_reference` in units of the float32 accumulation bound (<= 1:
    the tensor cores' accumulation is as good as float32's)."""
    import torch.nn.functional as F

    from bitmosaic.formats.act import ActQuantSpec
    from bitmosaic.formats.fp import fp_round
    from bitmosaic.kernels import triton as tk
    from bitmosaic.kernels.fp8 import fp8_gemm_reference
    from bitmosaic.modules.actquant import attach_input_quant

    dev, rows, u = torch.device("cuda"), [], 2.0**-24
    spec = ActQuantSpec("e4m3", 8, granularity="tensor", static=True)
    for model, shapes in SHAPES.items():
        for k_in, n_out in shapes:
            if time.time() > deadline:
                return rows
            m = _module(k_in, n_out, KERNELS["dpq int4 -> e4m3"], "cpu")
            attach_input_quant(m, spec, k_in, scale=torch.tensor([0.02]))
            m, w4 = m.to(dev), _module(k_in, n_out, KERNELS["int4 g128"], dev)
            w8, sw, sx = m.fp8_weight().to(dev), m.fp8_scale, m.input_quant.scale
            wb = m.dequantize_reference().to(dev).bfloat16()
            k = m.kernel()
            for r in ROWS:
                x = torch.randn(r, k_in, device=dev)
                with torch.no_grad():
                    x8 = fp_round(x / sx, "e4m3")
                    ref = fp8_gemm_reference(x8, w8, sx, sw)
                    bound = _gamma2(k_in, u) * (x8.abs() @ w8.abs().T) * sx * sw.reshape(1, -1)
                    bound = bound + 4 * u * ref.abs() + 1e-30
                    err = float(((m(x) - ref).abs() / bound).max())
                    xb = x.bfloat16()
                    xq = m.input_quant(xb)
                    t_l, t_k = _timed(lambda: m(xb)), _timed(lambda: k(xq))
                    os.environ[tk.FP8_DOT_ENV] = "0"
                    try:
                        t_f = _timed(lambda: k(xq))
                    finally:
                        del os.environ[tk.FP8_DOT_ENV]
                    t_4, t_b = _timed(lambda: w4(xb)), _timed(lambda: F.linear(xb, wb))
                fp8 = k.weight.fp8_operands(xq, sx)
                rows.append({"model": model, "in": k_in, "out": n_out, "kernel": DPQ_FP8, "rows": r,
                             "fp8_dot": fp8, "layer_ms": t_l, "fp8_ms": t_k, "float_ms": t_f, "w4a16_ms": t_4,
                             "bf16_ms": t_b, "err_over_bound": err})  # fmt: skip
                print(f"{model:>12} {k_in:>6}x{n_out:<6} {DPQ_FP8} m={r:<4} fp8_dot={fp8} kernel {t_k:8.4f} "
                      f"ms float {t_f:8.4f} ms W4A16 {t_4:8.4f} ms bf16 {t_b:8.4f} ms err/bound {err:.2f}",
                      flush=True)  # fmt: skip
    return rows


def _gamma2(k: int, u: float) -> float:
    """Twice Higham's ``gamma_K`` (two float32 sums of the same products in any orders differ by at most
    this times ``sum |x| |w|``)."""
    return 2 * k * u / (1 - k * u)


SFMP_WIDTHS = (1, 2, 3, 4, 6, 8)  # the latency-vs-bits line (SFMP Fig. 8), at 1 row on the 8B shapes


def _sfmp_module(k_in: int, n_out: int, device, seed: int = 0):
    """An SFMP linear with row and column permutations and random 2-4-bit blocks of 128 x 128 (g128)."""
    from bitmosaic.algorithms.sfmp import BlockPlan
    from bitmosaic.modules.sfmp import SFMPLinear, SFMPResult

    g = torch.Generator().manual_seed(seed)
    b = 128
    bits = torch.randint(2, 5, (-(-n_out // b), -(-k_in // b)), generator=g).to(torch.uint8)
    rp, cp = torch.randperm(n_out, generator=g), torch.randperm(k_in, generator=g)
    per = bits.long().repeat_interleave(b, 0)[:n_out].repeat_interleave(b, 1)[:, :k_in]
    codes_t = (torch.rand(n_out, k_in, generator=g) * 2.0**per).floor().to(torch.int32)
    codes = torch.empty_like(codes_t)
    codes[rp[:, None], cp[None, :]] = codes_t
    G = -(-k_in // b)
    scales = (torch.rand(n_out, G, generator=g) * 0.01 + 1e-3).half().float()
    zeros = torch.full((n_out, G), 2.0)
    plan = BlockPlan(n_out, k_in, b, b, b, rp.to(torch.int32), cp.to(torch.int32), bits)
    res = SFMPResult(codes, scales, zeros, torch.zeros(k_in, dtype=torch.int32), plan=plan)
    return SFMPLinear.from_result(res).to(device)


def _uniform_planes(k_in: int, n_out: int, bits: int, device):
    """A W``bits`` g128 bit-plane weight (row blocks of 128) of random plane words, made on the device
    (the GEMV's time does not depend on the codes; packing 8B-shaped codes on the CPU would cost seconds)."""
    from bitmosaic.formats.bitplane import BitPlanes
    from bitmosaic.kernels.triton.bitplane import TritonBitPlaneWeight

    b, n_rb, G = 128, -(-n_out // 128), k_in // 128
    rows = torch.full((n_rb, 1), b, dtype=torch.int64)
    rows[-1] = n_out - (n_rb - 1) * b
    sizes = (rows * (b // 32) * bits * 4).expand(n_rb, G).reshape(-1)  # bytes of each block, rb-major
    offsets = (torch.cumsum(sizes, 0) - sizes).reshape(n_rb, G)
    data = torch.randint(0, 256, (int(sizes.sum()),), dtype=torch.uint8, device=device)
    bmap = torch.full((n_rb, G), bits, dtype=torch.uint8, device=device)
    planes = BitPlanes(data, offsets.to(device), bmap, n_out, k_in, b, b)
    s = torch.full((G, n_out), 1e-3, device=device)
    return TritonBitPlaneWeight(planes, s, torch.zeros_like(s))


def _sfmp_rows(deadline: float) -> list[dict]:
    """SFMP on the GPU (issue 76): the Triton bit-plane GEMV's 1-row latency against the code width first
    (uniform W1-W8 weights on each 8B shape: ``widths_ms``, SFMP Fig. 8), then the module path -- an
    :class:`SFMPLinear` (permutations, mixed 2/3/4-bit blocks) whose forward runs the GEMV (up to 16 rows)
    or its dequantize + ``torch.mm`` (above), ``sfmp_ms``, against bf16 ``F.linear`` at 1/16/512 rows."""
    import torch.nn.functional as F

    dev, rows = torch.device("cuda"), []
    for k_in, n_out in SHAPES["llama-8b"]:
        widths = {}
        x = torch.randn(1, k_in, device=dev, dtype=torch.bfloat16)
        for b in SFMP_WIDTHS:
            if time.time() > deadline:
                return rows
            w = _uniform_planes(k_in, n_out, b, dev)
            widths[b] = _timed(lambda: w.matmul(x))
        rows.append({"model": "llama-8b", "in": k_in, "out": n_out, "kernel": "bitplane widths", "rows": 1,
                     "widths_ms": widths})  # fmt: skip
        print(f"llama-8b {k_in}x{n_out} bit-plane GEMV ms by width: {widths}", flush=True)
    for model, shapes in SHAPES.items():
        for k_in, n_out in shapes:
            if time.time() > deadline:
                return rows
            m = _sfmp_module(k_in, n_out, dev)
            wb = m.dequantize_reference().to(dev).bfloat16()
            for r in ROWS:
                x = torch.randn(r, k_in, device=dev, dtype=torch.bfloat16)
                with torch.no_grad():
                    ref = F.linear(x, wb).float()
                    err = float((m(x).float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                    t_s, t_b = _timed(lambda: m(x)), _timed(lambda: F.linear(x, wb))
                rows.append({"model": model, "in": k_in, "out": n_out, "kernel": "sfmp module", "rows": r,
                             "ran": _ran(m), "sfmp_ms": t_s, "bf16_ms": t_b, "max_rel_err": err})  # fmt: skip
                print(f"{model:>12} {k_in:>6}x{n_out:<6} sfmp module m={r:<4} {t_s:8.4f} ms bf16 {t_b:8.4f} "
                      f"ms err {err:.1e}", flush=True)  # fmt: skip
    return rows


def _interpret_check() -> int:
    """A tiny exactness check of every kernel in Triton's interpreter (no timings)."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["BITMOSAIC_TRITON_ON_CPU"] = "1"
    os.environ["BITMOSAIC_ACT_COMPUTE"] = "sim"  # SQ: the float split (the CPU's integer path otherwise)

    for name, spec in {**KERNELS, **FUSED}.items():
        m = _module(64, 24, spec if isinstance(spec[0], str) else (spec[0], 32, *spec[2:]), "cpu")
        x = torch.randint(-4, 5, (3, 64)).float()
        with torch.no_grad():
            diff = float((m(x) - _reference(m, x, m.dequantize_reference())).abs().max())
        print(f"{name:>22}: {_ran(m)}, max |y - F.linear(x, W)| = {diff:.1e} (interpreter)")
    return _interpret_check_dpq_sfmp()


def _interpret_check_dpq_sfmp() -> int:
    """The DPQ FP8-operand path and the SFMP module path, tiny, in the interpreter."""
    import torch.nn.functional as F

    from bitmosaic.formats.act import ActQuantSpec
    from bitmosaic.formats.fp import fp_round
    from bitmosaic.kernels.fp8 import fp8_gemm_reference
    from bitmosaic.modules.actquant import attach_input_quant

    m = _module(64, 24, (4, 32, False, 0.0, True), "cpu")
    attach_input_quant(m, ActQuantSpec("e4m3", 8, granularity="tensor", static=True), 64, torch.tensor([0.5]))
    x = torch.randint(-8, 9, (20, 64)).float()
    ref = fp8_gemm_reference(fp_round(x / 0.5, "e4m3"), m.fp8_weight(), torch.tensor(0.5), m.fp8_scale)
    print(f"{DPQ_FP8:>22}: fp8 operands {m.kernel().weight.fp8_operands(x, m.input_quant.scale)}, "
          f"max |y - fp8 GEMM reference| = {float((m(x) - ref).abs().max()):.1e} (interpreter)")  # fmt: skip
    s = _sfmp_module(256, 256, "cpu")
    x = torch.randint(-4, 5, (3, 256)).float()
    diff = float((s(x) - F.linear(x, s.dequantize_reference())).abs().max())
    print(f"{'sfmp module':>22}: {_ran(s)}, max |y - F.linear(x, W)| = {diff:.1e} (interpreter)")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--budget", type=float, default=480.0, help="seconds before it stops and writes (default 480)"
    )
    p.add_argument(
        "--interpret", action="store_true", help="no GPU: a tiny exactness check in the interpreter"
    )
    a = p.parse_args()
    if a.interpret:
        return _interpret_check()
    if not torch.cuda.is_available():
        print(
            "gpu_kernels: no CUDA GPU here: nothing measured (run on a GPU, or --interpret for a CPU check)"
        )
        return 0
    from benchmarks.harness import machine_info, write_results
    from bitmosaic.kernels import triton as tk

    if not tk.available():
        print("gpu_kernels: Triton is not importable (pip install 'triton>=3.2,<4'): nothing measured")
        return 1
    start = time.time()
    deadline = start + a.budget
    rows = _linear_rows(start + 0.4 * a.budget)
    dpq = _dpq_fp8_rows(start + 0.55 * a.budget)
    sfmp = _sfmp_rows(start + 0.75 * a.budget)
    decode = _decode(deadline)
    gpu = torch.cuda.get_device_name()
    out = {"device": gpu, "machine": machine_info(), "rows": rows, "dpq_fp8": dpq, "sfmp": sfmp}
    out["decode"] = decode
    write_results(None, "gpu_kernels", out, _markdown(gpu, rows, decode) + _markdown_dpq_sfmp(dpq, sfmp))
    return 0


def _markdown(gpu: str, rows: list[dict], decode: dict) -> str:
    head = (
        "| model | in x out | kernel | rows | bf16 ms | triton ms | speed-up | Marlin ms | dense INT4 ms "
        "| max rel err |"
    )
    lines = [
        f"# Triton kernels vs bf16 F.linear on {gpu}",
        "",
        head,
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "kernel" not in r:
            lines.append(f"\nMarlin: {r['marlin']}")
            continue
        mm = "-" if r["marlin_ms"] is None else f"{r['marlin_ms']:.4f}"
        im = "-" if r.get("int4_ms") is None else f"{r['int4_ms']:.4f}"
        lines.append(
            f"| {r['model']} | {r['in']}x{r['out']} | {r['kernel']} | {r['rows']} | {r['bf16_ms']:.4f} | "
            f"{r['triton_ms']:.4f} | {r['bf16_ms'] / r['triton_ms']:.2f} | {mm} | {im} | "
            f"{r['max_rel_err']:.1e} |"
        )
    lines += ["", f"End-to-end decode (SmolLM2-135M shape, random weights): {decode}"]
    return "\n".join(lines)


def _markdown_dpq_sfmp(dpq: list[dict], sfmp: list[dict]) -> str:
    head = ("| model | in x out | rows | fp8 dot | layer ms | fp8 kernel ms | float path ms | W4A16 ms "
            "| bf16 ms | err / fp32 bound |")  # fmt: skip
    lines = ["", "## DPQ W4A8: FP8 operands on tl.dot", "", head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in dpq:
        lines.append(
            f"| {r['model']} | {r['in']}x{r['out']} | {r['rows']} | {r['fp8_dot']} | {r['layer_ms']:.4f} | "
            f"{r['fp8_ms']:.4f} | {r['float_ms']:.4f} | {r['w4a16_ms']:.4f} | {r['bf16_ms']:.4f} | "
            f"{r['err_over_bound']:.2f} |"
        )
    head = "| model | in x out | rows | ran | SFMP ms | bf16 ms | max rel err |"
    lines += ["", "## SFMP: the module path and the bit-plane GEMV by width", "", head, "|---" * 7 + "|"]
    for r in sfmp:
        if "widths_ms" in r:
            ms = ", ".join(f"W{b} {t:.4f}" for b, t in r["widths_ms"].items())
            lines.append(f"\n{r['in']}x{r['out']}, 1 row, ms by width: {ms}")
            continue
        lines.append(
            f"| {r['model']} | {r['in']}x{r['out']} | {r['rows']} | {r['ran']} | {r['sfmp_ms']:.4f} | "
            f"{r['bf16_ms']:.4f} | {r['max_rel_err']:.1e} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
