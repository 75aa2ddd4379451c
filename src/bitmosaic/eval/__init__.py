"""Evaluation: perplexity over non-overlapping windows (the standard GPTQ protocol)."""

from .perplexity import perplexity

__all__ = ["perplexity"]
