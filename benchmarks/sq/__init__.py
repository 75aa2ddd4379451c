"""SQ-format: the perplexity grids, the Fig. 6-like figure and the integer GEMM."""
