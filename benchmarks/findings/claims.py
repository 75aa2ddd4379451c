"""The claims of the five papers, each judged from the JSON its method's benchmark wrote
(``benchmarks/results/<source>.json``).  A judge returns (numbers, verdict); adding a claim is one
``Finding`` line in ``FINDINGS``."""

from __future__ import annotations

from functools import partial

from benchmarks.findings.claims_babai import (
    babai_bound_table,
    babai_min_pivot,
    hptq_vs_rtn_gptq,
    ssqr_vs_gptq,
)
from benchmarks.findings.claims_defaults import GPTQ_VS_AWQ, gptq_beats_awq_at_w4, static_groups_at_4_bits
from benchmarks.findings.claims_dpq import DPQ_VS_NAIVE, dpq_gar_vs_act, dpq_vs_baselines
from benchmarks.findings.claims_gpu import GPU_FINDINGS
from benchmarks.findings.claims_mosaic import (
    mosaic_a4_no_collapse,
    mosaic_atom_model,
    mosaic_block_beats_channel,
    mosaic_blocks_not_stripes,
    mosaic_diminishing,
    mosaic_int_prefill,
    mosaic_selection_ablation,
    mosaic_ten_percent_half,
    mosaic_thin_blocks,
    mosaic_vs_table1_w4a4,
    mosaic_w4a8,
    mosaic_w4a8_near_w4a16,
    mosaic_w4a8_vs_gptq,
)
from benchmarks.findings.claims_rotation import (
    rotation_beats_alone,
    rotation_w4a4_goal,
    spinquant_beats_hadamard,
)
from benchmarks.findings.claims_sfmp import (
    PAPER_UNIFORM,
    sfmp_beats_uniform,
    sfmp_fisher_samples,
    sfmp_gptq_beats_awq,
    sfmp_latency_linear,
    sfmp_reorder_decode_cost,
    sfmp_reorder_helps,
    sfmp_small_blocks,
)
from benchmarks.findings.claims_sq import (
    sq_importance_ablation,
    sq_int_throughput,
    sq_static_falls_at_int2,
    sq_static_small_banks,
    sq_w_sq_a4_beats_w4a4,
    sq_weights_improve_as_s_falls,
)
from benchmarks.findings.claims_sq_bits import sq_between_a4_a8, sq_static_close_at_84
from benchmarks.findings.findings_lib import Finding
from benchmarks.findings.why import Q4_1_FILE, WHY_FILE, q4_1_texts, why_texts

B = "Babai (GPTQ geometry)"


Q = "QuaRot rotations (ours)"
D = "bitmosaic defaults (ours)"  # the comparisons behind a default (issue 73: checked on both models)
STATIC_CLAIM = "ours: static groups at 4 bits (the default) no worse than dynamic groups"
GPTQ_AWQ_CLAIM = "ours: GPTQ (the default method) beats AWQ at W4 g128"
GPU = {f.paper: f for f in GPU_FINDINGS}  # one GPU-kernel claim per paper (claims_gpu.py, issue 76)

FINDINGS: list[Finding] = [
    Finding(B, "GPTQ back-to-front = Babai's nearest plane (Thm. 4)", "fresh", None),
    Finding(B, "no-clip GPTQ error ≤ ¼ Σ D_jj s_j² (Thm. 5)", "lattice", babai_bound_table),
    Finding(B, "min-pivot order gives the smallest bound", "lattice", babai_min_pivot),
    Finding(B, "HPTQ beats RTN/HRTN and GPTQ at ~3.1 bits", "lattice", hptq_vs_rtn_gptq),
    Finding(B, "SSQR (1-3% outliers) beats GPTQ at equal bits", "ssqr_groups", ssqr_vs_gptq),
    GPU[B],
    Finding(
        "DPQ", "DPQ W4A8 beats naive GPTQ and RTN W4A8", "dpq", dpq_vs_baselines, close_pairs=(DPQ_VS_NAIVE,)
    ),
    Finding("DPQ", "GAR ≈ act-order accuracy without g_idx", "dpq", dpq_gar_vs_act),
    GPU["DPQ"],
    Finding("SQ-format", "W4A(SQ) lands between W4A4 and W4A8", "sq_format", sq_between_a4_a8),
    Finding("SQ-format", "static masks ≈ dynamic at (8/4)", "sq_format", sq_static_close_at_84),
    Finding(
        "SQ-format", "W(SQ)A4 improves as the sparsity s falls", "sq_format", sq_weights_improve_as_s_falls
    ),  # fmt: skip
    Finding("SQ-format", "W(SQ)A4 beats W4A4 (group-wise A4)", "sq_format", sq_w_sq_a4_beats_w4a4),
    Finding(
        "MosaicQuant",
        "W4A4 MosaicQuant beats the collapsing RTN and SmoothQuant",
        "mosaic_main",
        mosaic_a4_no_collapse,
    ),  # fmt: skip
    Finding("MosaicQuant", "MosaicQuant beats RTN and SmoothQuant at W4A8", "mosaic_main", mosaic_w4a8),
    Finding("MosaicQuant", "ours: MosaicQuant beats GPTQ at W4A8", "mosaic_main", mosaic_w4a8_vs_gptq),
    Finding(
        "MosaicQuant",
        "MosaicQuant beats QuaRot, SpinQuant and Atom at W4A4 (Table 1)",
        "mosaic_main",
        mosaic_vs_table1_w4a4,
    ),  # fmt: skip
    Finding(
        "MosaicQuant", "W4A8 MosaicQuant close to W4A16 (Table 1)", "mosaic_main", mosaic_w4a8_near_w4a16
    ),
    Finding("SQ-format", "static falls away from dynamic towards INT2", "sq_format", sq_static_falls_at_int2),
    Finding("SQ-format", "static SQ prefers small banks", "sq_format", sq_static_small_banks),
    Finding("SQ-format", "|Ā_j| alone as static importance degrades", "sq_format", sq_importance_ablation),
    Finding(
        "MosaicQuant",
        "distortion concentrates in blocks, not channel stripes",
        "mosaic_layers",
        mosaic_blocks_not_stripes,
    ),  # fmt: skip
    Finding(
        "MosaicQuant",
        "10% of blocks recovers over half the output distortion",
        "mosaic_layers",
        mosaic_ten_percent_half,
    ),  # fmt: skip
    Finding(
        "MosaicQuant", "block selection beats channel selection", "mosaic_layers", mosaic_block_beats_channel
    ),
    Finding(
        "MosaicQuant",
        "Δ-Hessian selection beats magnitude/residual/random/none",
        "mosaic_ablation",
        mosaic_selection_ablation,
    ),  # fmt: skip
    Finding("MosaicQuant", "the budget has diminishing returns", "mosaic_layers", mosaic_diminishing),
    Finding(
        "MosaicQuant",
        "beats an Atom-like mixed-precision split (3.1% INT8 channels)",
        "atom_model",
        mosaic_atom_model,
    ),  # fmt: skip
    Finding("MosaicQuant", "ours: thin residual blocks beat 64x64 at 10%", "mosaic_thin", mosaic_thin_blocks),
    GPU["MosaicQuant"],
    Finding(
        "MosaicQuant",
        "ours: W4A4 prefill beats W4A16 on the CPU integer path",
        "mosaic_kernel",
        mosaic_int_prefill,
    ),
    GPU["SQ-format"],
    Finding(
        "SQ-format", "ours: W4A(SQ6) near W4A4's speed on the CPU integer path", "sq_gemm", sq_int_throughput
    ),
    Finding(
        "SFMP",
        "SFMP (AWQ blocks) beats uniform GPTQ and AWQ at equal memory",
        "sfmp",
        sfmp_beats_uniform,
        pooled=True,
    ),  # fmt: skip
    Finding(
        "SFMP",
        "ours: SFMP with GPTQ blocks beats uniform at equal memory",
        "sfmp",
        partial(sfmp_beats_uniform, solver="gptq", uniform=(*PAPER_UNIFORM, "gptq")),
        pooled=True,
    ),  # fmt: skip
    Finding(
        "SFMP",
        "ours: SFMP (AWQ blocks) beats our GPTQ (act-order, MSE) at equal memory",
        "sfmp",
        partial(sfmp_beats_uniform, uniform=("gptq",)),
        pooled=True,
    ),  # fmt: skip
    Finding(
        "SFMP", "ours: GPTQ blocks beat the paper's AWQ blocks", "sfmp", sfmp_gptq_beats_awq, pooled=True
    ),
    Finding("SFMP", "Fisher from 128 samples is no worse than from 32", "sfmp", sfmp_fisher_samples),
    Finding("SFMP", "smaller blocks (m_b) allocate better", "sfmp", sfmp_small_blocks),
    GPU["SFMP"],
    Finding(
        "SFMP",
        "ours: bit-plane LUT GEMV latency falls ~linearly with bits on the CPU",
        "lut_gemv",
        sfmp_latency_linear,
    ),
    Finding("SFMP", "row+column reordering lowers perplexity", "sfmp", sfmp_reorder_helps),
    Finding("SFMP", "reordering costs at most ~5% of decode speed", "sfmp_decode", sfmp_reorder_decode_cost),
    Finding(
        Q,
        "GPTQ W4A4 with a rotation (Hadamard or learned) within 1.5x of float",
        "rotation",
        rotation_w4a4_goal,
    ),
    Finding(
        Q, "learned (SpinQuant) beats Hadamard rotation, GPTQ W4A4", "rotation", spinquant_beats_hadamard
    ),
    Finding(
        Q,
        "MosaicQuant + rotation beats rotation alone (W4A4)",
        "rotation",
        partial(rotation_beats_alone, "mosaic W4A4", alone="gptq W4A4g128 +hadamard"),
    ),  # fmt: skip
    Finding(
        Q,
        "MosaicQuant (GPTQ base) + rotation beats rotation alone (W4A4)",
        "rotation",
        partial(rotation_beats_alone, "mosaic-gptq W4A4", alone="gptq W4A4g128 +hadamard"),
    ),  # fmt: skip
    Finding(
        Q,
        "MosaicQuant (GPTQ base, α 0-1 or none) + rotation beats rotation alone (W4A4)",
        "rotation",
        partial(rotation_beats_alone, "mosaic-gptq-wide W4A4", alone="gptq W4A4g128 +hadamard"),
    ),  # fmt: skip
    Finding(
        Q,
        "MosaicQuant (GPTQ base, clip searched) + rotation beats rotation alone (W4A4)",
        "rotation",
        partial(rotation_beats_alone, "mosaic-gptq-clip W4A4", alone="gptq W4A4g128 +hadamard"),
    ),  # fmt: skip
    Finding(
        Q,
        "SQ-format W(SQ5)A4 + rotation beats rotation alone",
        "rotation",
        partial(rotation_beats_alone, "sq-weights W4A4"),
    ),  # fmt: skip
    Finding(
        Q,
        "SQ-format W4A(SQ) + rotation beats rotation alone",
        "rotation",
        partial(rotation_beats_alone, "sq-acts W4A(SQ)"),
    ),  # fmt: skip
    Finding(
        Q,
        "SmoothQuant + rotation beats rotation alone (W4A4)",
        "rotation",
        partial(rotation_beats_alone, "smoothquant+gptq W4A4"),
    ),  # fmt: skip
    Finding(D, STATIC_CLAIM, "static_groups", static_groups_at_4_bits),
    Finding(D, GPTQ_AWQ_CLAIM, "static_groups", gptq_beats_awq_at_w4, close_pairs=(GPTQ_VS_AWQ,)),
]


# issue 73: the claims also judged on a second model, Gemma-3-270m (findings.MODELS): at least one per
# paper, and the comparisons behind a default (GPTQ over AWQ at W4 g128: the SFMP table's uniform rows)
SECOND_MODEL = frozenset({
    "HPTQ beats RTN/HRTN and GPTQ at ~3.1 bits",
    "DPQ W4A8 beats naive GPTQ and RTN W4A8",
    "W4A(SQ) lands between W4A4 and W4A8",
    "W4A4 MosaicQuant beats the collapsing RTN and SmoothQuant",
    "MosaicQuant beats RTN and SmoothQuant at W4A8",
    "ours: MosaicQuant beats GPTQ at W4A8",
    "SFMP (AWQ blocks) beats uniform GPTQ and AWQ at equal memory",
    "ours: SFMP with GPTQ blocks beats uniform at equal memory",
    "ours: GPTQ blocks beat the paper's AWQ blocks",
    STATIC_CLAIM,
    GPTQ_AWQ_CLAIM,
})  # fmt: skip
SECOND = "Gemma-3-270m: "  # a findings_why.yaml key naming the second model's row of a claim


def attach_why(findings: list[Finding], why: dict[str, str], q4_1: dict[str, str] | None = None) -> None:
    """Give each finding its "why this may differ" text and its Q4_1-grid dependence (the second model's
    texts, keyed ``"Gemma-3-270m: <claim>"``, go to :data:`SECOND_WHY`); a text that names no claim (a
    claim reworded, its text left behind) stops the report instead of leaving a blank."""
    claims = {f.claim for f in findings}
    second = {k[len(SECOND):]: v for k, v in why.items() if k.startswith(SECOND)}
    why = {k: v for k, v in why.items() if not k.startswith(SECOND)}
    for name, texts in ((WHY_FILE.name, why), (WHY_FILE.name, second), (Q4_1_FILE.name, q4_1 or {})):
        if stray := sorted(set(texts) - claims):
            raise KeyError(f"{name} names no claim of FINDINGS: {stray}")
    for f in findings:
        f.differ = why.get(f.claim, "")
        f.q4_1 = (q4_1 or {}).get(f.claim, "not yet assessed")
    SECOND_WHY.update(second)


SECOND_WHY: dict[str, str] = {}  # claim -> the why text of its Gemma-3-270m row
WHY = why_texts()  # claim -> text, its numbers read from the result files (results/findings_why.yaml)
attach_why(FINDINGS, WHY, q4_1_texts())  # results/findings_q4_1.yaml
