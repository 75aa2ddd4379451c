"""The benchmarks' timer: the median wall time of a call."""

from __future__ import annotations

import time


def median_ms(fn, budget_s: float = 0.6, max_reps: int = 50, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in ms: ``warmup`` untimed calls, then at least 3 timed calls and
    more while ``budget_s`` lasts (at most ``max_reps``)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e3
