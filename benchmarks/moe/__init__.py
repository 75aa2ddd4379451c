"""Mixture-of-experts benchmarks (issue 71): which experts get enough calibration tokens, what the
expert statistics cost, and where an expert's own Hessian beats the pooled one."""
