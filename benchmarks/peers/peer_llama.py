"""llama.cpp's Python binding for ``benchmarks/decode/decode.py``: the installed one, or one built once.

``decode.py`` times llama.cpp on the very GGUF our SmolLM2 comes from, in the same run.  Where the
``llama_cpp`` package is not importable, :func:`find_or_build` builds ``llama-cpp-python`` (llama.cpp
from source: CMake and a C++ compiler; about 7 minutes on 2 cores) into a cache folder of its own,
``~/.cache/bitmosaic/peers/llama-cpp-python-<version>-<python>-<options hash>`` (or under
``$BITMOSAIC_PEER_CACHE``), and hands back that folder for the llama.cpp child's ``PYTHONPATH``: the
user's environment is never changed.  The build goes to a temporary folder renamed into place only
when it succeeded, so an interrupted or failed build leaves nothing half-made behind; its log stays
beside the cache for a failed one.  A progress line with the elapsed time shows every 30 s.

Build options (:func:`cmake_args`): a native build, except on a CPU with AMX, where llama.cpp's AMX
matmul crashed (llama-cpp-python 0.3.36 on an Intel Xeon VM: SIGSEGV in ``ggml_backend_amx_mul_mat``);
there the build is portable with the AVX-512 / VNNI / AVX2 paths the CPU has and AMX off.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

PACKAGE = "llama-cpp-python"
# the version behind benchmarks/results/decode*.md (pyproject's `peers` extra: >=0.3.16,<0.4)
VERSION = "0.3.36"
# llama-cpp-python's own requirements: installed beside it only where this environment lacks them
RUNTIME_DEPS = {"numpy": "numpy", "typing_extensions": "typing-extensions", "diskcache": "diskcache",
                "jinja2": "jinja2"}  # fmt: skip
CACHE_ENV = "BITMOSAIC_PEER_CACHE"


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cmake_args(flags: set[str]) -> str:
    """llama.cpp's CMake options for a CPU with ``flags``: native, or portable without AMX where the CPU
    has it (see the module doc)."""
    if not any(f.startswith("amx") for f in flags):
        return "-DGGML_NATIVE=ON"
    opts = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    paths = {"avx512f": "AVX512", "avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16",
             "avx_vnni": "AVX_VNNI", "avx2": "AVX2", "avx": "AVX", "fma": "FMA", "f16c": "F16C"}  # fmt: skip
    opts += [f"-DGGML_{name}=ON" for flag, name in paths.items() if flag in flags]
    return " ".join(opts)


def cache_dir(version: str, args: str) -> Path:
    """Where a build of ``version`` with CMake options ``args`` lives (one per Python minor version)."""
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = os.environ.get(CACHE_ENV) or xdg / "bitmosaic" / "peers"
    key = hashlib.sha256(args.encode()).hexdigest()[:10]
    return Path(root) / f"{PACKAGE}-{version}-py{sys.version_info[0]}{sys.version_info[1]}-{key}"


def pip_command(version: str, target: Path, deps: list[str]) -> list[str]:
    """The build: ``pip install --target`` of the binding (and ``deps``), no dependency resolution, so
    nothing else in this environment is shadowed; no pip wheel cache, whose key leaves out ``CMAKE_ARGS``
    (a wheel built natively elsewhere, AMX included, would come back)."""
    return [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input", "--no-cache-dir",
            "--target", str(target), f"{PACKAGE}=={version}", *deps]  # fmt: skip


def _missing_deps() -> list[str]:
    return [pkg for mod, pkg in RUNTIME_DEPS.items() if importlib.util.find_spec(mod) is None]


def _say(message: str) -> None:
    print(message, flush=True)  # progress lines show as they come, also into a file


def find_or_build(build: bool = True, version: str = VERSION, log=_say) -> str | None:
    """``""`` when ``llama_cpp`` imports here; the cache folder to put first on the llama.cpp child's
    ``PYTHONPATH`` when a build is cached or was just made; ``None`` (the reason logged in one line) when
    there is neither and ``build`` is off or the build failed."""
    if importlib.util.find_spec("llama_cpp") is not None:
        return ""
    args = cmake_args(cpu_flags())
    final = cache_dir(version, args)
    if (final / "llama_cpp" / "__init__.py").is_file():
        return str(final)
    if not build:
        log(
            f"llama.cpp rows skipped: llama_cpp is not installed and no build is cached in {final.parent} "
            "(drop --no-build-peer to build it there, about 7 minutes, or pip install llama-cpp-python)"
        )
        return None
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        log("llama.cpp rows skipped: building llama.cpp needs a C++ compiler (install g++ or clang++, or "
            "pip install llama-cpp-python from a prebuilt wheel)")  # fmt: skip
        return None
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
    log_path = final.with_name(f"{final.name}.log")
    shutil.rmtree(tmp, ignore_errors=True)
    env = {**os.environ, "CMAKE_ARGS": args, "FORCE_CMAKE": "1"}
    log(f"building llama.cpp's Python binding {PACKAGE}=={version} once into {final} ({args}); "
        "about 7 minutes on 2 cores")  # fmt: skip
    t0 = time.monotonic()
    done = threading.Event()

    def progress() -> None:
        while not done.wait(30):
            s = int(time.monotonic() - t0)
            log(f"  building llama.cpp ... {s // 60}:{s % 60:02d} elapsed (usually 5-10 minutes)")

    ticker = threading.Thread(target=progress, daemon=True)
    ticker.start()
    try:
        with open(log_path, "w") as out:
            rc = subprocess.run(pip_command(version, tmp, _missing_deps()), env=env, stdout=out,
                                stderr=subprocess.STDOUT).returncode  # fmt: skip
    except KeyboardInterrupt:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        done.set()
        ticker.join()
    if rc != 0 or not (tmp / "llama_cpp" / "__init__.py").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"llama.cpp rows skipped: building {PACKAGE}=={version} failed (pip exit {rc}); log: {log_path}")
        return None
    shutil.rmtree(final, ignore_errors=True)  # a broken one (no package inside)
    try:
        os.replace(tmp, final)
    except OSError:  # another process finished the same build first: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / "llama_cpp" / "__init__.py").is_file():
            raise
    log_path.unlink(missing_ok=True)
    log(f"built llama.cpp's binding in {time.monotonic() - t0:.0f} s: {final}")
    return str(final)


def child_env(folder: str) -> dict[str, str] | None:
    """The environment of a child that imports ``llama_cpp`` from ``folder`` (``None``: this one's)."""
    if not folder:
        return None
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": folder + (os.pathsep + path if path else "")}
