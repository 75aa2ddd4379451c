"""The claims of the five papers, each judged from the JSON its method's benchmark wrote
(``benchmarks/results/<source>.json``).  A judge returns (numbers, verdict); adding a claim is one
``Finding`` line in ``FINDINGS``."""

from __future__ import annotations

from functools import partial

from claims_babai import babai_bound_table, babai_min_pivot, hptq_vs_rtn_gptq, ssqr_vs_gptq
from claims_dpq import dpq_gar_vs_act, dpq_vs_baselines
from claims_mosaic import (
    mosaic_a4_no_collapse,
    mosaic_atom_model,
    mosaic_block_beats_channel,
    mosaic_blocks_not_stripes,
    mosaic_diminishing,
    mosaic_fused_overhead,
    mosaic_int_prefill,
    mosaic_selection_ablation,
    mosaic_ten_percent_half,
    mosaic_thin_blocks,
    mosaic_w4a8,
    mosaic_w4a8_vs_gptq,
)
from claims_rotation import rotation_beats_alone, rotation_w4a4_goal, spinquant_beats_hadamard
from claims_sfmp import (
    PAPER_UNIFORM,
    sfmp_beats_uniform,
    sfmp_fisher_samples,
    sfmp_gptq_beats_awq,
    sfmp_latency_linear,
    sfmp_reorder_decode_cost,
    sfmp_reorder_helps,
    sfmp_small_blocks,
)
from claims_sq import (
    sq_between_a4_a8,
    sq_importance_ablation,
    sq_int_throughput,
    sq_static_close_at_84,
    sq_static_falls_at_int2,
    sq_static_small_banks,
    sq_w_sq_a4_beats_w4a4,
    sq_weights_improve_as_s_falls,
)
from findings_lib import Finding

B = "Babai (GPTQ geometry)"


Q = "QuaRot rotations (ours)"

FINDINGS: list[Finding] = [
    Finding(B, "GPTQ back-to-front = Babai's nearest plane (Thm. 4)", "fresh", None),
    Finding(B, "no-clip GPTQ error ≤ ¼ Σ D_jj s_j² (Thm. 5)", "lattice", babai_bound_table),
    Finding(B, "min-pivot order gives the smallest bound", "lattice", babai_min_pivot),
    Finding(B, "HPTQ beats RTN/HRTN and GPTQ at ~3.1 bits", "lattice", hptq_vs_rtn_gptq),
    Finding(B, "SSQR (1-3% outliers) beats GPTQ at equal bits", "ssqr_groups", ssqr_vs_gptq),
    Finding("DPQ", "DPQ W4A8 beats naive GPTQ and RTN W4A8", "dpq", dpq_vs_baselines),
    Finding("DPQ", "GAR ≈ act-order accuracy without g_idx", "dpq", dpq_gar_vs_act),
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
    Finding(
        "MosaicQuant", "fused sparse branch costs ~5-6% latency (GPU)", "mosaic_kernel", mosaic_fused_overhead
    ),
    Finding(
        "MosaicQuant",
        "ours: W4A4 prefill beats W4A16 on the CPU integer path",
        "mosaic_kernel",
        mosaic_int_prefill,
    ),
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
    Finding("SFMP", "bit-plane LUT GEMV latency falls ~linearly with bits", "lut_gemv", sfmp_latency_linear),
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
]


# why a row may differ from its paper, beyond what every row shares (findings_lib.DIFFERS); issue 25
WHY = {
    "HPTQ beats RTN/HRTN and GPTQ at ~3.1 bits": "verdict protocol (CPU, one seed): HPTQ 45.46 (KL "
    "0.407, top-1 0.673) against GPTQ w3 g128 51.02 (KL 0.550, top-1 0.631; -10.9% with 0.2 fewer bits "
    "per weight) and HRTN 63.98 (KL 0.836, top-1 0.520; -29%), both margins over the 10% line (fast: 55.91 "
    "/ 66.06 / 71.10); the paper's Table 3 (Qwen3-8B) at 3.125 bits has HPTQ 10.34, HRTN 10.75 (4% apart), "
    "GPTQ 12.77, RTN 16.30; it calibrates on 256x2048 FineWeb-Edu tokens (here 128x512 WikiText-2) and "
    "counts GPTQ g128 as 3.125 bits where ours counts every stored byte (asymmetric zero points and "
    "act-order group indices included: 3.316); RTN w3 g128 (MSE scales) 169.68 on the verdict protocol (KL "
    "1.784, top-1 0.335; fast 196.33) at 3.271 bits: HPTQ first and RTN last as in the "
    "paper, but HRTN and GPTQ swap places (here GPTQ 51.02 before HRTN 63.98)",
    "no-clip GPTQ error ≤ ¼ Σ D_jj s_j² (Thm. 5)": "verdict protocol (CPU, one seed): Hessians from "
    "128x512 WikiText-2 tokens (the paper: 256x2048 FineWeb-Edu on Qwen3-8B), w3 g128 with static MSE "
    "scales, the no-clip error summed per projection kind (Q·K·V, O, Gate·Up, Down) and order (natural, "
    "act, min-pivot): at most 0.172 of the bound (fast, 16x512: 0.330); uniform rounding errors would give "
    "1/3 of it in expectation (s²/12 against the bound's worst case s²/4); the measured sums sit below "
    "that in every kind and order",
    "min-pivot order gives the smallest bound": "verdict protocol (CPU, one seed; a deterministic sum of "
    "the 128x512 Hessians' LDL pivots times the static scales, no perplexity): summed over the model "
    "natural 87655, act-order 50314, min-pivot 50079 (0.5% below act-order; fast: 51699 vs 51420), "
    "smallest in each of the four projection kinds; the paper's Table 2 (Qwen3-8B block 18, trace(D)) "
    "has min-pivot 0.1-1% below act-order and act-order 35-50% below the natural orders at Q·K·V and "
    "Gate·Up, the same shape as here (natural to act-order: -43%)",
    "SSQR (1-3% outliers) beats GPTQ at equal bits": "no heavy outliers here: no-clip GPTQ on the MSE "
    "scales (α = 1) puts 1.9% of weights off the grid (2.1-2.2% at most per layer), so at 3% SSQR narrows "
    "its grid (α ≈ 0.94) and its outliers are ordinary weights. Against GPTQ w3 (0.9 bits fewer) SSQR-3% "
    "has lower error in 210 of 210 layers, lower KL and higher top-1, yet a perplexity as high or higher "
    "-- on the whole test set too (verdict), so this is not the fast protocol's noise: KL measures the "
    "distance to the float model, perplexity to the text; at equal bits (w4) perplexity and KL agree that "
    "GPTQ wins. Judged the same way the paper's own Table 3 has SSQR-3% above its GPTQ curve (10.42 vs "
    "10.20); only 1-2% sit below it. Our grids are asymmetric: paper_bpw leaves their zeros out, as the "
    "paper does",
    "DPQ W4A8 beats naive GPTQ and RTN W4A8": (
        "the paper calibrates on an unstated subset of 2048-token sequences (here 128x512; at 16x512 DPQ "
        "removed 37% of the FP8-added error on calibration data but 13% on held-out data); our naive "
        "baseline uses GAR, which the paper does not say its naive GPTQ used (without reordering it is the "
        "row beside it); the paper's naive GPTQ loses 6.1% of Llama-2-7B's accuracy to DPQ's 0.7%, and a "
        "135M model from Q4_1 weights leaves less FP8-added error to remove; the gain over naive GPTQ is "
        "small against the seed-to-seed spread (about 1%, the judge's line), while its KL to float is lower "
        "on every seed; the RTN rows of seeds 0 and 1 ran on a "
        "lent H200, every other row on the CPU"
    ),
    "GAR ≈ act-order accuracy without g_idx": "two verdict seeds (CPU; each GAR row from an earlier run of "
    "the same settings): on seed 0 act-order keeps a 0.6% lower perplexity, on seed 1 GAR is 0.5% lower; "
    "GAR has the lower KL (0.230 vs 0.233; 0.230 vs 0.238) and higher top-1 (0.747 vs 0.741; 0.747 vs "
    "0.739) on both: by KL it loses nothing; the paper's models are 7B-70B, 135M here",
    "W4A4 MosaicQuant beats the collapsing RTN and SmoothQuant": "the main row searches α over 0.3-1.0 in "
    "steps of 0.1, the paper's grid (65 of 180 linears on the 0.3 boundary on the fast protocol); the row "
    "with SmoothQuant's grid beside it is from a fast-protocol run; A4 per token, which collapses this "
    "model for every method (MosaicQuant included: several times float); MosaicQuant stores 0.44 bits "
    "per weight more (its 10% residual); one verdict seed, its margin over SmoothQuant above the 10% line "
    "that asks for two",
    "MosaicQuant beats RTN and SmoothQuant at W4A8": "the paper's α grid (0.3-1.0 in steps of 0.1; the wide "
    "grid's row beside it is from a fast-protocol run); MosaicQuant stores 4.467 bits per weight against "
    "4.023 (its 10% residual); one verdict seed, its margin over SmoothQuant above the 10% line that asks "
    "for two (on the fast protocol it was 5.6%)",
    "ours: MosaicQuant beats GPTQ at W4A8": "not a claim of the paper (it compares with RTN and SmoothQuant)",
    "beats an Atom-like mixed-precision split (3.1% INT8 channels)": "Atom rebuilt in simplified form and "
    "simulated (no KV-cache quantization, GPTQ on the INT4 channels' Hessian block, outlier channels by "
    "max abs(X_j), fake quantization); its g128 weight scales are finer than MosaicQuant's per-channel "
    "base; SmolLM2 has few activation outliers; verdict protocol (CPU, one seed): Atom-like 48.06 against "
    "MosaicQuant 146.82 from the main table's verdict run (same calibration, windows and device); a lent "
    "H200 gave the Atom-like row 48.03 (KL 0.4984) before its run stopped; fast protocol: 56.76 vs 151.21; "
    "a 3x gap, so the one-seed rule for gaps under 10% does not apply",
    "block selection beats channel selection": "outlier channels by the float input's max abs(X_j) (the "
    "paper does not say how it picks them); fast protocol; no heavy outliers here to make channels strong",
    "Δ-Hessian selection beats magnitude/residual/random/none": "the paper compares the criteria by one "
    "layer's output distortion (Fig. 2(b)) and the sparse branch by perplexity on Qwen3-4B / LLaMA3-8B "
    "(Fig. 5: 108.6 / 143.7 without it, 11.0 / 10.8 with it, 10-13x); here A4 per token collapses this "
    "model for every method, so the branch takes 17-30% off, not 90%; verdict protocol (CPU, seed 0, "
    "128x512 calibration, every window; the Δ-Hessian row is the main table's verdict row, same "
    "calibration and windows): Δ-Hessian 146.82 (KL 1.587, top-1 0.387), magnitude 161.28 (KL 1.662, "
    "top-1 0.373), residual norm 164.60 (KL 1.698), random 169.61 (KL 1.718), no sparse branch 209.93 / "
    "199.86 (α re-searched / kept); the closest, magnitude, is 9.8% above Δ-Hessian, under the 10% line "
    "that asks for a second seed; seed 1 (its own Δ-Hessian row: KL 1.570, top-1 0.389) agrees: every other "
    "row has a higher perplexity and KL and a lower top-1 agreement, the closest (residual norm) 12% above "
    "(fast protocol: 151.21 against 177.64 / 176.85 / 216.74 / 230.35 / 226.73); "
    "SmolLM2's Q4_1-origin weights leave few outliers for any criterion to find",
    "10% of blocks recovers over half the output distortion": "the paper quotes two single layers of a "
    "7B+ model; 64x64 blocks of 576-1536-wide matrices are 1/81-1/216 of a matrix",
    "ours: thin residual blocks beat 64x64 at 10%": "not a claim of the paper (it uses square blocks); "
    "1x128 blocks store one scale per 128 weights and an index per block, so they cost more bits (4.498 "
    "against 4.467 bpw, +0.7%); verdict protocol (CPU, one seed, 128x512 calibration, every window): 1x128 "
    "102.10 (KL 1.232, top-1 0.448) against the main table's 64x64 row 146.82 (KL 1.587, top-1 0.387), 30% "
    "lower, past the 10% under which two seeds are asked (fast protocol: 112.05 against 151.21); 8x128 and "
    "16x64 (within 1.4% of 64x64 on the fast protocol) not yet rerun on the verdict protocol",
    "SFMP (AWQ blocks) beats uniform GPTQ and AWQ at equal memory": (
        "verdict protocol at five budgets, 2.5, 3.0, 3.25, 3.5 and 4.0 (CPU, one seed; Fisher from the "
        "128 calibration samples, the paper: 1k C4 samples): at 2.5 SFMP with AWQ blocks 300.65 (KL "
        "2.277, top-1 0.291) against GPTQ as the paper ran it 8993.25 (KL 5.644, top-1 0.077), 97% "
        "lower, and uniform AWQ w2 g64 2893.24 (KL 4.524, top-1 0.123), 90% lower; at 3.0 SFMP with AWQ "
        "blocks 96.23 (KL 1.176, top-1 0.466) against uniform AWQ w3 per channel 129.84 (KL 1.468, top-1"
        " 0.415), 26% lower, and GPTQ as the paper ran it (natural order, min-max) 180.97 (KL 1.777, "
        "top-1 0.375), 47% lower; at 3.25 63.07 (KL 0.742, top-1 0.563) against AWQ w3 g128 77.20 (KL "
        "0.928, top-1 0.514), 18% lower, and the paper's GPTQ 97.92 (KL 1.134, top-1 0.486), 36% lower; "
        "at 3.5 47.12 (KL 0.467, top-1 0.646) against AWQ w3 g64 61.34 (KL 0.701, top-1 0.578), 23% "
        "lower, and the paper's GPTQ 88.41 (KL 1.008, top-1 0.508), 47% lower; at 4.0 38.81 (KL 0.277, "
        "top-1 0.717) against AWQ w4 per channel 43.97 (KL 0.383, top-1 0.668), 12% lower, and the "
        "paper's GPTQ 50.27 (KL 0.489, top-1 0.639), 23% lower: all ten pairs past the 10% line (fast "
        "protocol: 434.27 against 20554.49 and 1429.05; 119.34 against 150.20 and 270.70; 79.80 against "
        "87.23 and 136.38; 57.44 against 69.68 and 110.33; 46.19 against 51.77 and 63.53); 4.25 has "
        "fast-protocol rows only, where SFMP won both pairs, 1 under 10% (sfmp-awq 43.36 against AWQ "
        "43.41; sfmp.json); m_b = 512 leaves 1-3 row blocks per matrix (the paper's 8B matrices have "
        "many)"
    ),
    "ours: SFMP with GPTQ blocks beats uniform at equal memory": (
        "not the paper's blocks (AWQ); verdict protocol at five budgets (CPU, one seed; two for the 4.0 "
        "pair with our GPTQ): at 2.5 SFMP with GPTQ blocks 96.03 (KL 1.178, top-1 0.480) against our "
        "GPTQ w2 g64 (act-order, MSE scales) 187.21 (KL 1.865, top-1 0.378), 95% higher while storing "
        "0.046 bits per weight more (its g_idx), and GPTQ as the paper ran it 8993.25 (collapsed at two "
        "bits) and AWQ w2 g64 2893.24; at 3.0 SFMP with GPTQ blocks 57.46 (KL 0.680, top-1 0.591) "
        "against our GPTQ w3 per channel (act-order, MSE scales) 70.21 (KL 0.860, top-1 0.554), 22% "
        "higher at the same 3.047 bits (per-channel GPTQ stores no g_idx), AWQ 129.84 and GPTQ as the "
        "paper ran it 180.97; at 3.25 46.42 (KL 0.476, top-1 0.655) against our GPTQ w3 g128 51.27 (KL "
        "0.556, top-1 0.628), 10.4% higher while storing 0.045 bits per weight more (its g_idx), AWQ "
        "77.20 and the paper's GPTQ 97.92; at 3.5 40.65 (KL 0.346, top-1 0.700) against our GPTQ w3 g64 "
        "49.65 (KL 0.501, top-1 0.643), 22% higher while storing 0.046 bits per weight more (its g_idx),"
        " AWQ 61.34 and the paper's GPTQ 88.41; at 4.0 35.75 (KL 0.204, top-1 0.761) against our GPTQ w4"
        " per channel 40.02 (KL 0.302, top-1 0.729), 11.9% higher at the same 4.047 bits (seed 1: 35.43,"
        " KL 0.203, top-1 0.764, against 39.85, KL 0.301, top-1 0.729, 12.5% higher), AWQ 43.97 and the "
        "paper's GPTQ 50.27: every pair past the 10% line (fast protocol: 133.12 against 361.24, "
        "20554.49 and 1429.05; 72.37 against 95.11, 150.20 and 270.70; 57.72 against 65.06, 87.23 and "
        "136.38; 49.20 against 65.51, 69.68 and 110.33; 43.27 against 49.52, 51.77 and 63.53); 4.25 has "
        "fast-protocol rows only, where it won all 3 pairs, 2 under 10% (40.98 against our GPTQ 42.37 "
        "and AWQ 43.41)"
    ),
    "ours: SFMP (AWQ blocks) beats our GPTQ (act-order, MSE) at equal memory": (
        "not the paper's comparator; act-order's g_idx makes our grouped GPTQ store more, so SFMP gets "
        "the smaller AWQ budget; verdict protocol (CPU, one seed; two at 4.0): at 2.5 300.65 (KL 2.277, "
        "top-1 0.291) against 187.21 (KL 1.865, top-1 0.378), 61% worse (fast: 434.27 against 361.24); "
        "at 3.0, where both store 3.047 bits, 96.23 (KL 1.176, top-1 0.466) against 70.21 (KL 0.860, "
        "top-1 0.554), 37% worse (fast: 119.34 against 95.11); at 3.25 63.07 (KL 0.742, top-1 0.563) "
        "against 51.27 (KL 0.556, top-1 0.628), 23% worse (fast: 79.80 against 65.06); at 3.5 47.12 (KL "
        "0.467, top-1 0.646) against 49.65 (KL 0.501, top-1 0.643), 5.1% lower, under the 10% line and "
        "on one seed (fast: 57.44 against 65.51); at 4.0, where both store 4.047 bits, 38.81 (KL 0.277, "
        "top-1 0.717) against 40.02 (KL 0.302, top-1 0.729), 3.0% lower perplexity but lower top-1, "
        "under the 10% line; seed 1 agrees: 39.01 (KL 0.265, top-1 0.722) against 39.85 (KL 0.301, top-1"
        " 0.729), 2.1% lower, top-1 again lower (fast: 46.19 against 49.52); the losses at 2.5, 3.0 and "
        "3.25 decide the claim either way, so the 3.5 pair is not asked a second seed; on the fast "
        "protocol SFMP won at 3.5 and 4.0 only, of six budgets"
    ),
    "ours: GPTQ blocks beat the paper's AWQ blocks": (
        "ours (the paper solves blocks with AWQ); the same Fisher salience and the same per-linear bit "
        "map, only the block solver differs; verdict protocol (CPU, one seed; two at 4.0): at 2.5 GPTQ "
        "blocks 96.03 (KL 1.178, top-1 0.480) against AWQ blocks 300.65 (KL 2.277, top-1 0.291), 68% "
        "lower (fast: 133.12 against 434.27); at 3.0 GPTQ blocks 57.46 (KL 0.680, top-1 0.591) against "
        "AWQ blocks 96.23 (KL 1.176, top-1 0.466), 40% lower (fast: 72.37 against 119.34); at 3.25 46.42"
        " (KL 0.476, top-1 0.655) against 63.07 (KL 0.742, top-1 0.563), 26% lower (fast: 57.72 against "
        "79.80); at 3.5 40.65 (KL 0.346, top-1 0.700) against 47.12 (KL 0.467, top-1 0.646), 14% lower "
        "(fast: 49.20 against 57.44); at 4.0 35.75 (KL 0.204, top-1 0.761) against 38.81 (KL 0.277, "
        "top-1 0.717), 7.9% lower, under the 10% line; seed 1 agrees: 35.43 (KL 0.203, top-1 0.764) "
        "against 39.01 (KL 0.265, top-1 0.722), 9.2% lower (fast: 43.27 against 46.19); the fast "
        "protocol has GPTQ ahead at all six budgets"
    ),
    "row+column reordering lowers perplexity": "judged at equal code bits (indices and bit map reported "
    "beside: the indices cost 0.046 bpw here, ~0.006 on an 8B model) with m_b = 64 (3-24 row blocks per "
    "matrix; at m_b = 512 only 1-3); GPTQ blocks, our default (the paper's Fig. 7: AWQ), where the column "
    "order is also GPTQ's solve order (Fisher-sorted, akin to act-order), so part of the gain is GPTQ's "
    "order, not the allocation; verdict protocol (CPU, one seed, Fisher from the 128 calibration samples): "
    "no reordering 60.73 (KL 0.707, top-1 0.585) against rows and columns 45.14 (KL 0.449, top-1 0.660), "
    "26% lower, well past the 10% under which two seeds are asked (the fast protocol had 81.75 against "
    "56.91)",
    "smaller blocks (m_b) allocate better": "verdict protocol (CPU, two seeds; GPTQ blocks, g256, equal "
    "code bits b = 3.068, Fisher from the 128 calibration samples): seed 0 m_b 64 45.14 (KL 0.449, top-1 "
    "0.660) against m_b 512 46.72 (KL 0.483, top-1 0.651), 3.4% apart; seed 1 45.63 (KL 0.456, top-1 "
    "0.659) against 47.18 (KL 0.487, top-1 0.653), 3.3% apart; the fast protocol had 1.4%; matrices of "
    "192-1536 rows: even m_b = 64 gives only 3-24 row blocks (the paper's 8B matrices have many more); at "
    "equal code bits (the paper: equal memory; the bit map costs 0.0006 bpw at m_b 64, 0.0001 at 512)",
    "Fisher from 128 samples is no worse than from 32": "verdict protocol (CPU, two seeds; GPTQ blocks, "
    "g256, m_b 64, equal code bits b = 3.068, Fisher samples drawn apart from the calibration): seed 0 "
    "Fisher from 32 samples 45.35 (KL 0.449, top-1 0.663) against 128 samples 45.38 (KL 0.453, top-1 "
    "0.661), 0.06% apart; seed 1 44.63 (KL 0.443, top-1 0.665) against 44.92 (KL 0.448, top-1 0.662), 0.6% "
    "apart: both inside the 1% the claim allows, so 128 samples are no worse, but neither seed shows them "
    "better (the rows whose Fisher reuses the 128 calibration samples: 45.14 and 45.63); under the 10% "
    "line, hence the two seeds; the Fisher seconds (32 samples 112 s / 109 s, 128 samples 591 s / 561 s) "
    "are from a CPU whose speed varies (393 s at an earlier stop); the fast protocol had 73.88 against "
    "74.21 with AWQ blocks at equal total bits; the paper: 128-2k C4 samples on 8B models, 1k by default",
    "static masks ≈ dynamic at (8/4)": "the paper does not print its activation scale granularity; judged "
    "with per-bank scales (what its Table 2 fits); the gap is +3.7% on both verdict seeds against the "
    "paper's +1.2%; on the fast protocol per-token scales give +42%, per-128-channel +13%, per-bank "
    "+3.9%, and static scales calibrated once per bank lose badly (109.8; per 128 channels 194.9): fixed "
    "scales cannot follow each token",
    "W4A(SQ) lands between W4A4 and W4A8": "the A4 bound is W4A4 with A4 per group of 128 (per-token INT4 "
    "collapses this model: 1766.60 on the verdict protocol); SQ rows with per-bank activation scales, "
    "whose scales cost 2 bits per value at b = 16 (act_bits), which the paper's y leaves out; verdict "
    "protocol (CPU, one seed, one set of smoothed GPTQ W4 g128 weights for every row): dynamic 36.31 (KL "
    "0.211) and static 37.65 (KL 0.247) both far inside the A4 bound 98.01, which is what decides the "
    "claim (one seed suffices); the paper has W4A(SQ6) on par with W4A8, and here dynamic sits 1.1% below "
    "W4A8 (36.72) and static 2.5% above it",
    "W(SQ)A4 improves as the sparsity s falls": "judged with A4 per group of 128 channels (per-token INT4 "
    "collapses this model; the paper's A4 granularity is not printed); verdict protocol (CPU, 128x512 "
    "calibration, every window, two seeds): seed 0 W(SQ4.5) 81.53 (KL 1.020, top-1 0.484), W(SQ5) 77.83 "
    "(KL 0.963, top-1 0.499), W(SQ6) 74.05 (KL 0.914, top-1 0.506), steps of 4.8% and 5.1%; seed 1 82.41 "
    "(KL 1.015, top-1 0.484), 77.52 (KL 0.959, top-1 0.495), 73.48 (KL 0.909, top-1 0.508), steps of 6.3% "
    "and 5.5%: each step is under the 10% line, and both seeds agree, as the rule asks (the fast protocol "
    "had 5.0-7.3% at g128 and 3.7-5.2% at g64); the A4-per-64 rows, the W(SQ5) bank sweep and the "
    "per-token A4 / A8 / A16 rows (fast protocol) are not rerun; a lower s also stores more bits (5.04 / "
    "5.50 / 7.00 bpw)",
    "W(SQ)A4 beats W4A4 (group-wise A4)": "our W4A4 uses the smoothed GPTQ W4 g128 weights of every "
    "activation row (the paper's: GPTQ W4A4); W(SQ) stores more bits per weight (measured_bits); verdict "
    "protocol (CPU, one seed, A4 per group of 128 channels): W4A4 98.01 (KL 1.199, top-1 0.449) against "
    "W(SQ4.5)A4 81.53 (KL 1.020, top-1 0.484), W(SQ5)A4 77.83 and W(SQ6)A4 74.05: the closest is 17% "
    "lower, past the 10% under which two seeds are asked (fast protocol, A4 g128: 109.33 against 89.63 / "
    "85.18 / 79.38); the A4-per-64 rows are fast-protocol only",
    "static falls away from dynamic towards INT2": "the paper's Table 3 (Llama-2-7B, s = 0.5, WikiText-2): "
    "static +0.6% / +3.1% / +35.5% over dynamic at (8/4) / (8/3) / (8/2); here the same trend, steeper on "
    "a 135M model: +3.7% / +21% / +569%, KL dynamic / static 0.211 / 0.247, 0.230 / 0.422, 0.400 / 2.242, "
    "top-1 0.760 / 0.741, 0.753 / 0.669, 0.676 / 0.302; verdict protocol (CPU, one seed, per-bank "
    "activation scales, the smoothed GPTQ W4 g128 weights of every activation row; the (8/4) rows are part "
    "scales' rows, the same model); each step is far past the 10% under which two seeds are asked (fast "
    "protocol: +4% / +21% / +514%; per-token scales, fast, fall away sooner: +42% already at (8/4))",
    "static SQ prefers small banks": (
        "verdict protocol (CPU, two seeds, per-bank activation scales, the smoothed GPTQ W4 g128 weights"
        " of every activation row): on both seeds calibration loss, test perplexity, KL and top-1 all "
        "worsen with every doubling of the bank at both sparsities (KL 0.219 -> 0.303 at s = 0.5 and "
        "0.236 -> 0.397 at 0.75 on seed 0, 0.213 -> 0.295 and 0.231 -> 0.388 on seed 1), as the paper's "
        "Fig. 8 says ('static strategy tends to prefer a smaller bank_size'). Neighbouring cells are "
        "1.2-6.4% apart in perplexity, under the 10% line, hence the second seed; seed 1's cells sit "
        "0.2-1.1% under seed 0's (each seed's calibration loss is on its own calibration sequences: only"
        " the order within a seed counts). A smaller bank also carries more scales (one fp16 scale per "
        "bank and token: 14 activation bits per element at bank 4, 6.5 at 64), so part of its gain is "
        "bits the paper's accounting may not count. Banks 4 and 8 (and 16 at s = 0.75) run simulated "
        "(their runs of 1-4 columns are too short for the integer kernel), the rest on the integer "
        "kernel: the same integers, outputs equal up to float32 rounding, which a quantized model "
        "amplifies to about 0.5% of perplexity (bank 16 at s = 0.5: 37.65 on an earlier build, 37.86 "
        "here)"
    ),
    "|Ā_j| alone as static importance degrades": "verdict protocol (CPU, two seeds): seed 0 |A| alone "
    "37.53 (KL 0.245, top-1 0.743), mean|A|·Σ|W| 37.30 (KL 0.239), the paper's I = |A·ΣW| 37.65 (KL 0.247); "
    "seed 1 38.59 (KL 0.257, top-1 0.735), 38.37 (KL 0.251), 38.69 (KL 0.259): |A| alone is 0.3% better, "
    "not worse, on both seeds, far inside the 10% line (the I = |A·ΣW| rows are each seed's static "
    "per-bank row of part scales, the same model; seed 0's was measured on another Xeon, whose W4 base may "
    "differ in its last digits); fast protocol: 1% apart; SmolLM2's Q4_1-origin weights leave no heavy "
    "outlier channels for |A| to miss",
    "fused sparse branch costs ~5-6% latency (GPU)": "CPU kernels; the paper's figure is a GPU's",
    "ours: W4A4 prefill beats W4A16 on the CPU integer path": "not a claim of the paper (its kernel is a "
    "GPU's); the issue's target for the CPU",
    "ours: W4A(SQ6) near W4A4's speed on the CPU integer path": "the paper's throughput claim is for its "
    "split-datapath hardware (simulated there); a CPU has none: per-bank scales give every 8-column run "
    "its own activation scale (one float FMA per run and 16 outputs, where W4A4 has one per 128 columns: "
    "about twice the vector work per column on a port-0-bound AVX-512 core), static adds a gather; the "
    "dynamic split runs as float32 torch operations",
    "MosaicQuant + rotation beats rotation alone (W4A4)": "MosaicQuant's RTN dense base loses with a "
    "rotation here (RTN W4A16 79 -> 182 on the fast protocol, see rotation.md); both rows A4 per group "
    "of 128; verdict protocol, one seed (CPU): 286.41 vs 55.11 (fast: 408.59 vs 65.87), the margin far "
    "over the 10% line",
    "MosaicQuant (GPTQ base) + rotation beats rotation alone (W4A4)": "both rows A4 per group of 128; on "
    "the verdict protocol (CPU, one seed) 76.58 vs 55.11, KL 0.939 vs 0.619, top-1 0.512 vs 0.596 (fast: "
    "95.41 vs 65.87), far over the 10% line; MosaicQuant's α grid (0.3-1.0) smooths activations a rotation "
    "has already spread -- but the wide grid with no smoothing (next row) gives 75.15 against 76.58 on "
    "the verdict protocol (fast: 93.13 vs 95.41), so that is not the cause; its dense base is: the "
    "paper's absmax per-channel grid (no weight clipped) spends a rotated, near-Gaussian row's 4 bits on "
    "its extremes, and with its per-row clip searched the row falls to 61.38 on the verdict protocol (the "
    "row after next; rotation alone's GPTQ has MSE scales)",
    "MosaicQuant (GPTQ base, α 0-1 or none) + rotation beats rotation alone (W4A4)": "the α search of "
    "issue 25 (0-1 in steps of 0.05, and no smoothing where its loss is lowest), so a rotated layer need "
    "not be smoothed again; on the verdict protocol (CPU, one seed) it moves the row only from 76.58 to "
    "75.15 (KL 0.939 -> 0.906, top-1 0.512 -> 0.524; fast: 95.41 -> 93.13), so the α grid is not what "
    "loses against rotation alone (its absmax dense base is: next row); both rows A4 per group of 128; "
    "the margin is far over the 10% line, and the search costs 1588 s of quantization against 719 s",
    "MosaicQuant (GPTQ base, clip searched) + rotation beats rotation alone (W4A4)": "ours, a diagnosis: "
    "the dense base's per-row clip searched (Σ h_j (w_j - q_j)² over shrinks of the absmax; the paper's "
    "base clips nothing) takes the rotated row from 95.41 to 72.00 on the fast protocol (verdict: 76.58 -> "
    "61.38; without rotation, fast: 155.52 -> 108.39), so the absmax base was most of the loss; the rest "
    "of the gap to rotation alone (act-order GPTQ with MSE scales, no smoothing) is MosaicQuant's own "
    "smoothing and natural-order GPTQ base, not separated further; on the verdict protocol (CPU, one seed) "
    "the gap is 11.4%, KL 0.719 vs 0.619, top-1 0.568 vs 0.596 (fast: 9.3%), and MosaicQuant stores 0.44 "
    "bits per weight more; both rows A4 per group of 128",
    "SmoothQuant + rotation beats rotation alone (W4A4)": "0.4% apart on the fast protocol (too close to "
    "decide there); on the verdict protocol (CPU) +3.9% on seed 0, +0.3% on seed 1 and +4.3% on seed 2 "
    "(KL 0.808 vs 0.845): two of three seeds clear the 1% line, so it holds by count, but thinly -- the "
    "rotation alone itself moves 2.8% across the seeds (68.33 / 70.02 / 70.27); a Hadamard rotation "
    "already spreads the outlier channels that smoothing migrates (QuaRot itself applies no smoothing)",
    "distortion concentrates in blocks, not channel stripes": "the paper's heatmaps are two layers (24, 34) "
    "of a 7B+ model with heavy activation outliers; here the stripes are the columns holding the most "
    "distortion (the best stripes possible, not outlier channels fixed in advance), on 14 linears of a "
    "135M model from Q4_1 weights, which has no heavy outliers",
    "SQ-format W(SQ5)A4 + rotation beats rotation alone": "W(SQ5) stores 5.5 bits per weight against "
    "4.0; on the verdict protocol (CPU) the gain is 5.7% on seed 0 (KL 0.767 vs 0.832, top-1 0.551 vs "
    "0.539) and 6.1% on seed 1 (KL 0.774 vs 0.846, top-1 0.549 vs 0.534), about half the fast protocol's "
    "12.7% (rows from the H200); the two seeds agree, as the rule for gains under 10% asks",
    "SQ-format W4A(SQ) + rotation beats rotation alone": "A(SQ) 16-(8/4)-0.5 keeps half the activations "
    "at 8 bits (and one scale per bank), so it spends more activation bits than the W4A4 it is judged "
    "against: on the fast protocol rotation alone at W4A8 (41.20) beat it (41.72, both on the H200); no "
    "W4A8 row ran on the verdict protocol; one verdict seed (CPU)",
    "learned (SpinQuant) beats Hadamard rotation, GPTQ W4A4": "the paper's 100 Cayley SGD steps of 8 "
    "samples at lr 1.5, but of 512 tokens cycling over the run's 128 calibration samples (the paper: 2048 "
    "tokens from 800 samples), learned on a lent H200; the training loss barely moves (lr 0.1, A4g64: "
    "3.504 -> 3.498 and 3.672 -> 3.656 on the same batches 80 steps apart), a 576-wide model leaves a "
    "Hadamard rotation little to gain; a smaller rate (0.1) with A4g64 gains 2.6% perplexity at equal KL; "
    "one seed",
    "GPTQ W4A4 with a rotation (Hadamard or learned) within 1.5x of float": "QuaRot's figures are from "
    "7B-70B models, 4096-8192 wide; a rotation spreads each token over 576 channels here; most of the gap "
    "is the A4 activations themselves, chiefly at the MLP's gate/up inputs, even with exact weights "
    "(w4a4_budget.md); a learned rotation (SpinQuant, lr 0.1) closes 0.05x of it; rows from the CPU and "
    "a lent H200; seeds 1 and 2 (CPU) have only the per-token Hadamard row (70.02, 2.33x; 70.27, 2.34x)",
}
for _f in FINDINGS:
    _f.differ = WHY.get(_f.claim, "")
