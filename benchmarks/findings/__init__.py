"""The findings report: each paper's claims judged from the benchmarks' result files
(``python -m benchmarks.findings``)."""
