"""The checks and verdict rows a lent GPU runs (``gpu_check.sh``, ``gpu_verdict.sh``), FP8 GEMM, GPTQ
at scale."""
