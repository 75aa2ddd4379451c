"""bitmosaic: post-training quantization of LLMs (GPTQ/Babai, RTN, packed formats, one pipeline)."""

__version__ = "0.1.0"

from .api import quantize_  # noqa: E402
from .methods import get_method, list_methods  # noqa: E402

__all__ = ["__version__", "get_method", "list_methods", "quantize_"]
