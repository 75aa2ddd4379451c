"""The papers' GPU-kernel claims (issue 76), judged only from ``benchmarks/gpu_kernels.py``'s run on a GPU:
``results/gpu_kernels.json``, which names its device.  A claim row says "measured on <GPU> by
benchmarks/gpu_kernels.py: ..." or, with no such run, "cannot be tested here (not measured: no GPU lent
since the kernels were written)" -- never a CPU figure in its place (the CPU kernels' own claims are the
"ours: ... on the CPU" rows).

Rows each judge reads (``gpu_kernels.json``): ``rows`` (kernel ``triton_ms`` against ``bf16_ms`` per
``model``/``in``/``out``/``rows``: the packed kinds, ``ssqr ...``, and the MosaicQuant / SQ-format rows,
named ``mosaic ...`` and ``sq ...``, each with its dense INT4 kernel's ``int4_ms``), ``dpq_fp8`` (DPQ's FP8
tensor-core path) and ``sfmp`` (``widths_ms``: the bit-plane GEMV's 1-row latency per code width).  A run
that lacks a claim's rows makes it "not measured: gpu_kernels.json has no ..." with the command to rerun.
"""

from __future__ import annotations

from functools import partial
from statistics import geometric_mean

from benchmarks.findings.findings_lib import UNTESTABLE, Finding, verdict

SOURCE = "gpu_kernels"
SCRIPT = "benchmarks/gpu_kernels.py"
# issue 73 item 2: the one GPU lent so far (an H200, 2026-11-26: results/gpu_h200.md) came before the Triton
# kernels (2026-12-06); none has been lent since
NO_GPU = "not measured: no GPU lent since the kernels were written"
UNMEASURED = (
    f"{NO_GPU} (the one H200 loan, gpu_h200.md, came before them); {SCRIPT} measures it "
    "(python -m benchmarks.gpu_kernels on a GPU)",
    f"{UNTESTABLE} ({NO_GPU})",
)
BIG = "llama-8b"  # the papers' claims are for 7B-70B models: judged on the Llama-3-8B shapes


def gpu_finding(paper: str, claim: str, judge) -> Finding:
    """A claim judged by ``judge(gpu_kernels.json)`` -> (numbers, verdict), prefixed with the device."""
    return Finding(paper, claim, SOURCE, partial(_on_gpu, judge), unmeasured=UNMEASURED)


def _on_gpu(judge, res: dict) -> tuple[str, str]:
    if not res.get("device"):
        raise KeyError("device")
    nums, v = judge(res)
    return f"measured on {res['device']} by {SCRIPT}: {nums}", v


def _kernel_rows(res: dict, prefix: str, key: str = "rows") -> list[dict]:
    """The rows of ``res[key]`` whose kernel starts with ``prefix``, on the 8B shapes (KeyError: none)."""
    rows = [r for r in res.get(key) or [] if str(r.get("kernel", "")).startswith(prefix)]
    rows = [r for r in rows if r.get("model") == BIG]
    if not rows:
        raise KeyError(f"8B-shape '{prefix}' rows")
    return rows


def _same(res: dict, row: dict, prefix: str) -> dict:
    """The row of kernel ``prefix...`` measured on ``row``'s shape and row count."""
    for r in _kernel_rows(res, prefix):
        if (r["in"], r["out"], r["rows"]) == (row["in"], row["out"], row["rows"]):
            return r
    raise KeyError(f"'{prefix}' row for {row['in']}x{row['out']} at {row['rows']} rows")


def _shape(r: dict) -> str:
    return f"{r['in']}x{r['out']} m{r['rows']}"


def mosaic_fused(res: dict) -> tuple[str, str]:
    """MosaicQuant (ZipperEngine): the fused base + residual kernel against the dense W4 base (the packed
    ``int4 g128`` Triton kernel) at decode; the paper: ~5-6% overhead."""
    rows = [r for r in _kernel_rows(res, "mosaic") if r["rows"] == 1]
    over = [(r, r["triton_ms"] / _same(res, r, "int4 g128")["triton_ms"] - 1) for r in rows]
    if not over:
        raise KeyError("MosaicQuant rows at 1 row")
    nums = ", ".join(f"{_shape(r)} {o:+.1%} over the W4 base" for r, o in over)
    return nums, verdict(max(o for _, o in over) <= 0.10, "over 10% on some 8B shape")


def sq_split_gemm(res: dict) -> tuple[str, str]:
    """SQ-format's static split GEMM (paper: faster than W8A8, close to W4A4) at prefill (512 rows).  No
    integer-activation GEMM runs on the GPU here, so the comparators are ours: the same Triton dequant GEMM
    at 8 bits (``int8 g128``, the W8 side) and the fused row's own dense W4 kernel alone (``int4_ms``)."""
    rows = [r for r in _kernel_rows(res, "sq") if r["rows"] == 512]
    if not rows:
        raise KeyError("SQ-format rows at 512 rows")
    cmp = [(r, _same(res, r, "int8 g128")["triton_ms"], r["int4_ms"]) for r in rows]
    nums = ", ".join(
        f"{_shape(r)} SQ {r['triton_ms']:.4f} ms, our INT8 kernel {a8:.4f}, our INT4 kernel {a4:.4f}"
        for r, a8, a4 in cmp
    )
    ok = all(r["triton_ms"] < a8 and r["triton_ms"] <= 1.25 * a4 for r, a8, a4 in cmp)
    return nums, verdict(ok, "not faster than our INT8 kernel or over 1.25x our INT4 kernel on some 8B shape")


def dpq_fp8_gemm(res: dict) -> tuple[str, str]:
    """DPQ W4A8 (§3 Fig. 3, §4.3): INT4 -> E4M3 dequantization fused into an FP8 tensor-core GEMM, against
    the W4A16 kernel at 512 rows; the error of its float32 accumulation in units of the bound."""
    rows = [r for r in _kernel_rows(res, "dpq w4a8 fp8", "dpq_fp8") if r["rows"] == 512]
    if not rows:
        raise KeyError("DPQ FP8 rows at 512 rows")
    nums = ", ".join(
        f"{_shape(r)} FP8 {r['fp8_ms']:.4f} ms vs W4A16 {r['w4a16_ms']:.4f} ms "
        f"({r['w4a16_ms'] / r['fp8_ms']:.2f}x), bf16 {r['bf16_ms']:.4f} ms, "
        f"error {r['err_over_bound']:.2f} of the fp32 bound"
        for r in rows
    )
    if not all(r["fp8_dot"] for r in rows):
        return nums, f"{UNTESTABLE} (this GPU has no FP8 tensor cores: capability below 8.9)"
    ok = all(r["fp8_ms"] < r["w4a16_ms"] for r in rows)
    return nums, verdict(ok, "not faster than W4A16 on some 8B shape at 512 rows")


def ssqr_decode(res: dict) -> tuple[str, str]:
    """SSQR's dense + CSR-outlier kernel (W3, 0.5% outliers) against bf16 ``F.linear`` at 1 row: ~2x
    (the paper's Fig. 5, Ampere), judged as a geometric mean of at least 1.8x over the 8B shapes."""
    rows = [r for r in _kernel_rows(res, "ssqr") if r["rows"] == 1]
    if not rows:
        raise KeyError("SSQR rows at 1 row")
    up = [r["bf16_ms"] / r["triton_ms"] for r in rows]
    nums = ", ".join(f"{_shape(r)} {u:.2f}x bf16" for r, u in zip(rows, up, strict=True))
    nums += f"; geometric mean {geometric_mean(up):.2f}x"
    return nums, verdict(geometric_mean(up) >= 1.8, "under 1.8x bf16")


def _r2(xs: list[float], ys: list[float]) -> float:
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return 1.0 if n < 3 or syy == 0 else sxy * sxy / (sxx * syy)


def sfmp_gpu_linear(res: dict) -> tuple[str, str]:
    """SFMP Fig. 8: the bit-plane GEMV's 1-row latency against the code width, R² of a line per 8B shape."""
    rows = [r for r in res.get("sfmp") or [] if "widths_ms" in r]
    if not rows:
        raise KeyError("SFMP widths rows")
    fits = []
    for r in rows:
        w = {int(b): t for b, t in r["widths_ms"].items()}
        fits.append((r, _r2(sorted(w), [w[b] for b in sorted(w)]), w))
    nums = ", ".join(
        f"{r['in']}x{r['out']} R² {q:.3f} (W{min(w)} {w[min(w)]:.4f} .. W{max(w)} {w[max(w)]:.4f} ms)"
        for r, q, w in fits
    )
    return nums, verdict(min(q for _, q, _ in fits) >= 0.95, "R² < 0.95 on an 8B shape")


GPU_FINDINGS = [
    gpu_finding("MosaicQuant", "fused sparse branch costs ~5-6% latency (GPU)", mosaic_fused),
    gpu_finding("SQ-format", "static split GEMM beats W8A8, near W4A4 (GPU)", sq_split_gemm),
    gpu_finding("DPQ", "W4A8: INT4→FP8 dequant fused into an FP8 GEMM beats W4A16 (GPU)", dpq_fp8_gemm),
    gpu_finding("Babai (GPTQ geometry)", "SSQR dense + sparse-outlier kernel ~2x decode (GPU)", ssqr_decode),
    gpu_finding("SFMP", "bit-plane GEMV latency falls ~linearly with bits (GPU, Fig. 8)", sfmp_gpu_linear),
]
