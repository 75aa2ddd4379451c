"""llama.cpp's own command-line tools (``llama-imatrix``, ``llama-quantize``, ``llama-perplexity``), built
once from the llama.cpp source that the ``llama-cpp-python`` source package carries (issue 72).

The peer a practitioner uses is llama.cpp's ``llama-imatrix`` + ``llama-quantize``; its perplexity is
measured with ``llama-perplexity``.  :func:`find_or_build` downloads the sdist of the same
``llama-cpp-python`` version ``peer_llama.py`` pins (``pip download --no-binary :all:``; pip's cache is
used when it holds it), extracts its ``vendor/llama.cpp`` and builds only those three targets with CMake
(Release, ``LLAMA_CURL=OFF``, the CPU options of :func:`peer_llama.cmake_args`: native, AMX off where the
CPU has it) into ``~/.cache/bitmosaic/peers/llama-tools-<version>-<options hash>/bin`` (or under
``$BITMOSAIC_PEER_CACHE``).  As in ``peer_llama.py`` the build goes to a temporary folder renamed into
place only when it succeeded; one line says it is building, and a line every 60 s shows the time.

Run ``python -m benchmarks.peers.llama_tools`` to build (or find) them and print the folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.peers.peer_llama import PACKAGE, VERSION, cmake_args, cpu_flags

TOOLS = ("llama-imatrix", "llama-quantize", "llama-perplexity")


def cache_dir(version: str, args: str) -> Path:
    """Where the tools of ``version`` built with CMake options ``args`` live."""
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = os.environ.get("BITMOSAIC_PEER_CACHE") or xdg / "bitmosaic" / "peers"
    key = hashlib.sha256(args.encode()).hexdigest()[:10]
    return Path(root) / f"llama-tools-{version}-{key}"


def tool(folder: Path, name: str) -> Path:
    """The path of tool ``name`` in a built ``folder``."""
    return Path(folder) / "bin" / name


def _built(folder: Path) -> bool:
    return all(tool(folder, t).is_file() for t in TOOLS)


def configure_command(src: Path, build: Path, args: str) -> list[str]:
    """CMake's configure step: Release, no curl, no tests/examples/server beyond the tools we build."""
    return ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
            "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
            *args.split()]  # fmt: skip


def build_command(build: Path, jobs: int = 2) -> list[str]:
    return ["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs), "--target", *TOOLS]


def _sdist(version: str, into: Path, out) -> Path:
    """The ``llama-cpp-python`` sdist (pip's cache first, as pip itself does)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "-d", str(into), f"{PACKAGE}=={version}"]  # fmt: skip
    subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=True)
    found = sorted(into.glob("llama_cpp_python-*.tar.gz")) + sorted(into.glob("llama-cpp-python-*.tar.gz"))
    if not found:
        raise FileNotFoundError(f"pip download left no sdist of {PACKAGE}=={version} in {into}")
    return found[0]


def _extract_llama(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as tar:
        tar.extractall(into, filter="data")
    roots = [p for p in into.iterdir() if p.is_dir()]
    src = roots[0] / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        raise FileNotFoundError(f"{sdist.name} carries no vendor/llama.cpp/CMakeLists.txt")
    return src


def _run_build(version: str, args: str, tmp: Path, out, jobs: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="llama-tools-src-"))
    try:
        src = _extract_llama(_sdist(version, work / "dl", out), work / "src")
        build = work / "build"
        subprocess.run(configure_command(src, build, args), stdout=out, stderr=subprocess.STDOUT, check=True)
        subprocess.run(build_command(build, jobs), stdout=out, stderr=subprocess.STDOUT, check=True)
        (tmp / "bin").mkdir(parents=True)
        for name in TOOLS:
            shutil.copy2(build / "bin" / name, tool(tmp, name))
        (tmp / "SOURCE").write_text(f"{PACKAGE}=={version} vendor/llama.cpp; cmake {args}\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _say(message: str) -> None:
    print(message, flush=True)


def find_or_build(build: bool = True, version: str = VERSION, jobs: int = 2, log=_say) -> Path | None:
    """The folder holding ``bin/llama-{imatrix,quantize,perplexity}``: cached, or built now; ``None``
    (the reason logged in one line) when there is none and ``build`` is off or the build failed."""
    args = cmake_args(cpu_flags())
    final = cache_dir(version, args)
    if _built(final):
        return final
    if not build:
        log(f"llama.cpp tools are not built in {final} (run python -m benchmarks.peers.llama_tools, ~15 min)")
        return None
    if shutil.which("cmake") is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        log("llama.cpp tools need cmake and a C++ compiler (install cmake and g++)")
        return None
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
    log_path = final.with_name(f"{final.name}.log")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"building llama.cpp's {', '.join(TOOLS)} from {PACKAGE}=={version}'s source into {final} "
        f"({args}; -j{jobs}); about 7-15 minutes on 2 cores")  # fmt: skip
    t0 = time.monotonic()
    done = threading.Event()

    def progress() -> None:
        while not done.wait(60):
            s = int(time.monotonic() - t0)
            log(f"  building llama.cpp tools ... {s // 60}:{s % 60:02d} elapsed")

    ticker = threading.Thread(target=progress, daemon=True)
    ticker.start()
    try:
        with open(log_path, "w") as out:
            _run_build(version, args, tmp, out, jobs)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"building llama.cpp tools failed ({exc}); log: {log_path}")
        return None
    finally:
        done.set()
        ticker.join()
    shutil.rmtree(final, ignore_errors=True)
    try:
        os.replace(tmp, final)
    except OSError:  # another process finished the same build first
        shutil.rmtree(tmp, ignore_errors=True)
    log_path.unlink(missing_ok=True)
    log(f"built llama.cpp tools in {time.monotonic() - t0:.0f} s: {final}")
    return final if _built(final) else None


if __name__ == "__main__":
    folder = find_or_build()
    print(folder if folder else "no llama.cpp tools")
    sys.exit(0 if folder else 1)
