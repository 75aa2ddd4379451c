"""The k-quant layouts now live in :mod:`bitmosaic.algorithms.gguf_kquants` (GPTQ solves on their grid,
issue 72); this name is that very module (one object: attributes set here are set there)."""

import sys

from ...algorithms import gguf_kquants as _kquants

sys.modules[__name__] = _kquants
