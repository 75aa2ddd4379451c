"""What the numbers were measured on: the machine's facts (:func:`machine_info`) and its physical
bounds, measured now: read bandwidth (:func:`read_bandwidth_gbs`) and, with the int8 GEMM rate, the
bounds every integer-path table reports beside its times (:func:`machine_bounds`)."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import torch

from benchmarks.harness.timer import median_ms


def read_bandwidth_gbs() -> float:
    """The machine's measured memory read bandwidth (GB/s): the best of 5 sums over 512 MiB (the
    physical bound a memory-bound kernel is compared with)."""
    big = torch.ones(128 * 2**20)
    best = min(median_ms(big.sum, 0.0, 1, warmup=0) for _ in range(5))
    return big.numel() * 4 / (best / 1e3) / 1e9


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(**extra) -> dict:
    """What the numbers were measured on: platform, CPU, cores, threads, versions, load average (and
    the GPU when one is there)."""
    info = {
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "loadavg_1_5_15": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return {**info, **extra}


def int8_rate_gops() -> float:
    """int8 multiply-adds x 2 per second of ``torch._int_mm`` on 2048^3 (GOPS)."""
    n = 2048
    a = torch.randint(-128, 128, (n, n), dtype=torch.int8)
    b = torch.randint(-128, 128, (n, n), dtype=torch.int8)
    ms = median_ms(lambda: torch._int_mm(a, b), 1.0, 10)
    return 2 * n**3 / (ms / 1e3) / 1e9


def gemm_gflops(n: int = 4096, k: int = 4096, m: int = 8192, budget_s: float = 3.0) -> float:
    """This machine's float32 GEMM rate (GFLOP/s): ``[m, k] @ [k, n]`` (default: the shape of a
    layer's projections), the bound of a float or dequantize-then-GEMM path."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    ms = median_ms(lambda: a @ b, budget_s=budget_s, max_reps=10)
    return 2 * m * n * k / (ms / 1e3) / 1e9


def machine_bounds(threads: int) -> tuple[float, float]:
    """This machine's int8 GEMM rate (GOPS) and read bandwidth (GB/s) at ``threads`` threads (set here),
    measured now and printed: the bounds every integer-path table reports beside its times."""
    torch.set_num_threads(threads)
    rate, bw = int8_rate_gops(), read_bandwidth_gbs()
    print(
        f"{threads} thread(s): torch._int_mm int8 {rate:.0f} GOPS, read bandwidth {bw:.1f} GB/s", flush=True
    )
    return rate, bw
