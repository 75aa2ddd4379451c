"""The Babai / GPTQ-geometry paper: lattice quantizers (HRTN, HPTQ, SSQR), bounds and orders."""
