"""A benchmark's child process: the same benchmark (or another) run as a module of the ``benchmarks``
package, ``python -m benchmarks.<topic>.<script>``, whatever folder the parent was started from."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root: the folder that holds benchmarks/


def module_command(module: str, python: str = sys.executable) -> list[str]:
    """The command line that runs ``module`` (``benchmarks.decode.decode``) in ``python``; its
    environment should come from :func:`child_env` so that ``benchmarks`` imports there."""
    return [python, "-m", module]


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with the repository root first on ``PYTHONPATH``."""
    env = dict(os.environ if env is None else env)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + path if path else "")
    return env
