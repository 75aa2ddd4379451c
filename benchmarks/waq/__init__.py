"""Weight-activation quantization: the W4A8/W8A8/W4A4 baselines, DPQ, integer vs simulated activations."""
