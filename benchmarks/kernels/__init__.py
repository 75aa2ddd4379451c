"""The CPU kernels: low-bit matmul, the integer-activation GEMM, the bit-plane LUT GEMV, the ISA's
peak rates (``isa_peak.c``)."""
