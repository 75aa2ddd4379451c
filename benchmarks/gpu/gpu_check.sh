#!/usr/bin/env bash
# The checks one lent GPU session runs, in one call (a few minutes on an H100/H200):
#   1. the CUDA-only tests (every quantized kind on the GPU, the pipeline on cuda, the FP8
#      tensor-core GEMM against the simulated DPQ forward) plus the device-resolution tests;
#   2. benchmarks/gpu/fp8_gemm.py (FP8 vs bf16 GEMM, error against the float32 reference);
#   3. benchmarks/gpu/gpu_scale.py: GPTQ w4 g128 act-order at 128 x 2048 tokens on one
#      Llama-3-70B-shaped decoder layer, then on a whole Llama-3-8B-shaped model (random weights).
# Results land in $OUT (or /tmp/gpu_check): logs and JSON; the C++ CPU kernels are not built
# (BITMOSAIC_NO_EXT=1: they are CPU-only and the image's torch differs from the one they'd need).
#     OUT=/tmp/gpu_check bash benchmarks/gpu/gpu_check.sh
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}" BITMOSAIC_NO_EXT=1 PYTHONUNBUFFERED=1
log() { echo "[$(date +%T)] $*"; }
{
  nvidia-smi -L
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  log "fp8_gemm"
  (timeout 60 python3 -m benchmarks.gpu.fp8_gemm --reps 20 --json "$OUT/fp8_gemm.json") 2>&1
  log "CUDA tests"
  timeout 150 python3 -m pytest -q -p no:cacheprovider \
    tests/methods/test_dpq.py::test_dpq_weights_through_the_fp8_tensor_core_gemm_equal_the_simulated_forward \
    tests/kernels/test_modules.py tests/pipeline/test_device.py 2>&1
  log "gpu_scale llama3-70b-layer"
  (timeout 150 python3 -m benchmarks.gpu.gpu_scale --shape llama3-70b-layer --json "$OUT/gpu_scale_70b_layer.json") 2>&1
  log "gpu_scale llama3-8b"
  (timeout 200 python3 -m benchmarks.gpu.gpu_scale --shape llama3-8b --json "$OUT/gpu_scale_8b.json") 2>&1
  log "done"
} | tee "$OUT/gpu_check.log"
