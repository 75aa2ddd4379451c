"""bitmosaic's benchmarks, a package run from the repository root: ``python -m benchmarks.<topic>.<script>``
(``python -m benchmarks.findings`` writes the findings report).

- :mod:`benchmarks.harness`: what every benchmark shares (timer, machine facts and bounds, result
  writers, the *fast*/*verdict* protocols and :class:`~benchmarks.harness.Bench`);
- :mod:`benchmarks.findings`: the claims engine, each paper's claims judged from the result files;
- one folder per topic: ``gptq``, ``lattice``, ``sfmp``, ``mosaic``, ``sq``, ``waq``, ``rotation``,
  ``kernels``, ``decode``, ``moe``, ``peers``, ``export``, ``pipeline``, ``scale``, ``gpu``, ``fuzz``;
- ``results/``: what the benchmarks wrote (:data:`RESULTS`), the data the findings and the docs cite.

The scripts import each other as modules of this package (``from benchmarks.harness import Bench``),
so they run with ``-m`` from the repository root (a script's own path, ``python benchmarks/x/y.py``,
does not put the package on the path).  This module imports nothing, so a benchmark's child process
(which may run in another interpreter) can import its own script alone.
"""

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
