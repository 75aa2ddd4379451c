"""Mixture-of-experts benchmarks (issue 71): which experts get enough calibration tokens, what the
expert statistics cost, where an expert's own Hessian beats the pooled one, decode of packed experts, and
export checks recorded where CI cannot run them (llama.cpp)."""
