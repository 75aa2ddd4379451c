"""The one harness every benchmark uses: a timer (:func:`median_ms`), the machine's facts and its
measured bounds (:func:`machine_info`, :func:`read_bandwidth_gbs`, :func:`machine_bounds`), one writer
of the results (:func:`write_results`: JSON, and a Markdown table beside it, atomically, into
``benchmarks/results/``; each measured row keeps its per-window NLLs, ``window_nll``, for a paired
bootstrap), the shared flags and the *fast*/*verdict* protocols (:func:`base_parser`,
:func:`protocol_label`), and :class:`Bench`, which loads SmolLM2-135M once, runs quantization configs
on fresh copies of the float model and measures perplexity."""

from benchmarks.harness.bench import Bench, act_paths
from benchmarks.harness.float_reference import CachedReference, default_store
from benchmarks.harness.machine import (
    cpu_name,
    gemm_gflops,
    int8_rate_gops,
    machine_bounds,
    machine_info,
    read_bandwidth_gbs,
)
from benchmarks.harness.protocols import (
    PROTOCOLS,
    SAME_RUN,
    base_parser,
    merged_rows,
    protocol_label,
    settle_protocol,
)
from benchmarks.harness.timer import median_ms
from benchmarks.harness.writers import RESULTS, dumps_results, write_results, write_text

__all__ = [
    "PROTOCOLS",
    "RESULTS",
    "SAME_RUN",
    "Bench",
    "CachedReference",
    "act_paths",
    "base_parser",
    "cpu_name",
    "default_store",
    "dumps_results",
    "gemm_gflops",
    "int8_rate_gops",
    "machine_bounds",
    "machine_info",
    "median_ms",
    "merged_rows",
    "protocol_label",
    "read_bandwidth_gbs",
    "settle_protocol",
    "write_results",
    "write_text",
]
