"""``python -m benchmarks.findings``: the findings report (:mod:`benchmarks.findings.findings`)."""

from benchmarks.findings.findings import main

main()
