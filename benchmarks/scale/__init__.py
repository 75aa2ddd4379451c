"""Quantization at real model shapes (Llama-3-8B, a Llama-3-70B layer) and the shape table."""
