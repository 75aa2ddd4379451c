"""Shared by the tests of the benchmarks' findings judges."""

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="session")
def bench_module():
    """``bench_module(name)`` imports ``benchmarks/<name>.py`` (the benchmarks are scripts, not a package)."""

    def load(name: str):
        sys.path.insert(0, str(BENCH))
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(str(BENCH))

    return load
