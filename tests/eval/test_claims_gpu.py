"""The papers' GPU-kernel claims in the findings report (benchmarks/findings/claims_gpu.py, issue 76): judged
only from ``benchmarks/gpu_kernels.py``'s run on a GPU (``gpu_kernels.json`` with its device name), else
"cannot be tested here (not measured: no GPU lent since the kernels were written)" -- never a CPU figure."""

from __future__ import annotations

import pytest

from benchmarks.findings import claims, claims_gpu
from benchmarks.findings import findings as findings_module

GPU_CLAIMS = {f.claim for f in claims_gpu.GPU_FINDINGS}
SQ = "static split GEMM beats W8A8, near W4A4 (GPU)"
DPQ = "W4A8: INT4→FP8 dequant fused into an FP8 GEMM beats W4A16 (GPU)"


def _row(kernel, k_in, n_out, rows, **ms):
    return {"model": "llama-8b", "in": k_in, "out": n_out, "kernel": kernel, "rows": rows, **ms}


SHAPES = [(4096, 4096), (14336, 4096)]


def _run(ssqr_speedup=2.5, dpq_ms=0.5, device="NVIDIA H100 80GB HBM3") -> dict:
    rows, dpq, sfmp = [], [], []
    for k, n in SHAPES:
        for r in (1, 512):
            rows.append(_row("int4 g128", k, n, r, triton_ms=1.0, bf16_ms=2.0))
            rows.append(_row("ssqr int3 + 0.5% csr", k, n, r, triton_ms=1.0, bf16_ms=ssqr_speedup))
            rows.append(_row("mosaic w4 + 10% residual", k, n, r, triton_ms=1.05, bf16_ms=2.0))
            ms = {"fp8_ms": dpq_ms, "w4a16_ms": 1.0, "bf16_ms": 0.8, "layer_ms": 0.6, "float_ms": 1.1}
            dpq.append(_row("dpq w4a8 fp8 dot", k, n, r, fp8_dot=True, err_over_bound=0.1, **ms))
        sfmp.append(_row("bitplane widths", k, n, 1, widths_ms={"1": 0.1, "2": 0.2, "4": 0.41, "8": 0.8}))
    out = {"rows": rows, "dpq_fp8": dpq, "sfmp": sfmp}
    return out if device is None else {**out, "device": device}


def _judged(monkeypatch, store: dict) -> dict[str, tuple[str, str, str]]:
    monkeypatch.setattr(findings_module, "load", store.get)
    return {f.claim: findings_module.judge(f) for f in claims.FINDINGS if f.claim in GPU_CLAIMS}


def test_every_paper_has_its_gpu_claim_in_the_report_on_the_gpu_run():
    """One GPU claim per paper, each judged from gpu_kernels.json; no other claim says "(GPU" (a GPU
    claim judged from a CPU benchmark would put a CPU figure in its place)."""
    assert {f.paper for f in claims_gpu.GPU_FINDINGS} == {"MosaicQuant", "SQ-format", "DPQ", "SFMP", claims.B}
    in_report = [f for f in claims.FINDINGS if f.claim in GPU_CLAIMS]
    assert len(in_report) == len(GPU_CLAIMS) and all(f.source == "gpu_kernels" for f in in_report)
    assert [f.claim for f in claims.FINDINGS if "(GPU" in f.claim and f.claim not in GPU_CLAIMS] == []
    assert findings_module.module_of("gpu_kernels") == "benchmarks.gpu_kernels"


NO = "not measured: no GPU lent since the kernels were written"


def test_without_a_gpu_run_they_say_no_gpu_was_lent(monkeypatch):
    for claim, (nums, v, used) in _judged(monkeypatch, {}).items():
        assert nums.startswith(f"{NO} (the one H200 loan, gpu_h200.md, came before them)"), claim
        assert "benchmarks/gpu_kernels.py measures it" in nums, claim
        assert v == f"cannot be tested here ({NO})", claim
        assert used == "gpu_kernels"
    other = findings_module.judge(next(f for f in claims.FINDINGS if f.source == "dpq"))
    assert "no GPU lent" not in other[1]  # the rule is the GPU claims', not every missing run's


def test_a_gpu_run_is_judged_and_names_its_device(monkeypatch):
    got = _judged(monkeypatch, {"gpu_kernels": _run()})
    assert set(got) == GPU_CLAIMS
    for claim, (nums, _, used) in got.items():
        if claim != SQ:
            assert nums.startswith("measured on NVIDIA H100 80GB HBM3 by benchmarks/gpu_kernels.py: "), claim
        assert used == "gpu_kernels"
    assert got["SSQR dense + sparse-outlier kernel ~2x decode (GPU)"][1] == "holds"
    assert "geometric mean 2.50x" in got["SSQR dense + sparse-outlier kernel ~2x decode (GPU)"][0]
    assert got[DPQ][1] == "holds"
    assert got["bit-plane GEMV latency falls ~linearly with bits (GPU, Fig. 8)"][1] == "holds"
    assert got["fused sparse branch costs ~5-6% latency (GPU)"][1] == "holds"
    assert "+5.0% over the W4 base" in got["fused sparse branch costs ~5-6% latency (GPU)"][0]
    sq = got[SQ]  # no SQ-format rows in this run: it says which it lacks
    assert sq[0] == "" and "gpu_kernels.json has no" in sq[1] and "python -m benchmarks.gpu_kernels" in sq[1]
    slow = _judged(monkeypatch, {"gpu_kernels": _run(ssqr_speedup=1.2, dpq_ms=2.0)})
    assert slow["SSQR dense + sparse-outlier kernel ~2x decode (GPU)"][1].startswith("does not hold here")
    assert slow[DPQ][1].startswith("does not hold")


@pytest.mark.parametrize("device", [None, ""])
def test_a_run_without_a_device_name_is_not_taken(monkeypatch, device):
    for claim, (nums, v, _) in _judged(monkeypatch, {"gpu_kernels": _run(device=device)}).items():
        assert nums == "" and "gpu_kernels.json has no 'device'" in v, claim


def test_a_gpu_without_fp8_tensor_cores_cannot_test_dpq(monkeypatch):
    run = _run(device="NVIDIA A100-SXM4-80GB")
    for r in run["dpq_fp8"]:
        r["fp8_dot"] = False
    nums, v, _ = _judged(monkeypatch, {"gpu_kernels": run})[DPQ]
    assert nums.startswith("measured on NVIDIA A100-SXM4-80GB") and v.startswith("cannot be tested here")


@pytest.mark.parametrize(("sq_ms", "word"), [(1.1, "holds"), (2.5, "does not hold")])
def test_the_sq_split_is_judged_against_our_int8_and_int4_kernels(monkeypatch, sq_ms, word):
    """SQ-format's split GEMM at 512 rows against the Triton INT8 dequant GEMM (``int8 g128``) and the fused
    row's own dense INT4 kernel (``int4_ms``): no integer-activation GEMM runs on the GPU here."""
    run = _run()
    for k, n in SHAPES:
        run["rows"].append(_row("int8 g128", k, n, 512, triton_ms=2.0, bf16_ms=2.0))
        run["rows"].append(_row("sq static 16-(8/4)-0.75 w4 g128", k, n, 512, triton_ms=sq_ms, int4_ms=1.0))
    nums, v, _ = _judged(monkeypatch, {"gpu_kernels": run})[SQ]
    assert v.startswith(word) and "our INT8 kernel 2.0000" in nums and "our INT4 kernel 1.0000" in nums
