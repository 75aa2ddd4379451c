"""``benchmarks/peers/peer_llama.py``: llama.cpp's binding for ``decode.py``, found or built once into a cache
folder.  The build itself (pip compiling llama.cpp, minutes) is replaced here by a stand-in command that
writes the package or fails, so the tests check what the module decides and leaves behind: the build
options per CPU, the cache key, the skip line without a build, a failed build leaving nothing, and a
finished one renamed into place and used from then on."""

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

import benchmarks.peers.peer_llama


@pytest.fixture()
def peer(monkeypatch, tmp_path):
    mod = importlib.reload(benchmarks.peers.peer_llama)  # afresh for each test
    monkeypatch.setenv(mod.CACHE_ENV, str(tmp_path / "cache"))
    real = importlib.util.find_spec
    monkeypatch.setattr(  # as if llama_cpp were not installed here
        mod.importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a)
    )
    monkeypatch.setattr(mod.shutil, "which", lambda name: f"/usr/bin/{name}")  # a compiler, wherever run
    return mod


def test_cpu_flags_parse_proc_cpuinfo(peer):
    text = "processor : 0\nflags\t\t: fpu avx2 fma amx_int8 avx512_vnni\nbugs : x\n"
    assert peer.cpu_flags(text) == {"fpu", "avx2", "fma", "amx_int8", "avx512_vnni"}
    assert peer.cpu_flags("processor : 0\n") == set()


def test_cmake_args_native_without_amx_and_portable_with_it(peer):
    assert peer.cmake_args({"avx2", "fma", "avx512f"}) == "-DGGML_NATIVE=ON"
    args = peer.cmake_args({"avx2", "fma", "f16c", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"}).split()
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AMX_INT8=OFF" in args and "-DGGML_AMX_TILE=OFF" in args
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON"} <= set(args)
    assert "-DGGML_AVX_VNNI=ON" not in args  # only the paths this CPU has


def test_cache_dir_keyed_by_version_and_options(peer, tmp_path):
    a = peer.cache_dir("0.3.36", "-DGGML_NATIVE=ON")
    assert a.parent == tmp_path / "cache"
    assert a != peer.cache_dir("0.3.37", "-DGGML_NATIVE=ON")
    assert a != peer.cache_dir("0.3.36", "-DGGML_NATIVE=OFF")
    assert f"py{sys.version_info[0]}{sys.version_info[1]}" in a.name


def test_installed_binding_is_used_as_is(peer, monkeypatch):
    monkeypatch.setattr(peer.importlib.util, "find_spec", lambda name, *a: object())
    assert peer.find_or_build(build=True, log=pytest.fail) == ""
    assert peer.child_env("") is None


def test_no_build_skips_with_one_line(peer, tmp_path):
    said = []
    assert peer.find_or_build(build=False, log=said.append) is None
    assert len(said) == 1 and "--no-build-peer" in said[0] and "\n" not in said[0]
    assert not (tmp_path / "cache").exists()  # nothing made


def test_no_compiler_skips_with_one_line(peer, monkeypatch, tmp_path):
    monkeypatch.setattr(peer.shutil, "which", lambda name: None)
    said = []
    assert peer.find_or_build(build=True, log=said.append) is None
    assert len(said) == 1 and "C++ compiler" in said[0]
    assert not (tmp_path / "cache").exists()


def _fake_pip(peer, monkeypatch, script: str):
    monkeypatch.setattr(
        peer, "pip_command", lambda version, target, deps: [sys.executable, "-c", script, str(target)]
    )


# a stand-in for pip's build: writes llama_cpp/<file> with <text> into the target folder, then runs <then>
WRITES = (
    "import sys, pathlib; t = pathlib.Path(sys.argv[1]) / 'llama_cpp'; t.mkdir(parents=True); "
    "(t / {file!r}).write_text({text!r}); "
)


def test_failed_build_leaves_nothing_but_its_log(peer, monkeypatch, tmp_path):
    # the stand-in writes half a package, then fails
    _fake_pip(peer, monkeypatch, WRITES.format(file="half.py", text="") + "print('cmake error'); sys.exit(3)")
    said = []
    assert peer.find_or_build(build=True, log=said.append) is None
    assert "failed (pip exit 3)" in said[-1]
    left = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(left) == 1 and left[0].endswith(".log")  # no partial folder, no tmp folder
    assert "cmake error" in (tmp_path / "cache" / left[0]).read_text()


def test_finished_build_is_renamed_into_place_and_reused(peer, monkeypatch, tmp_path):
    _fake_pip(peer, monkeypatch, WRITES.format(file="__init__.py", text="VERSION = 1"))
    said = []
    folder = peer.find_or_build(build=True, log=said.append)
    assert folder and (Path(folder) / "llama_cpp" / "__init__.py").is_file()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [Path(folder).name]  # no tmp, no log
    assert said[0].startswith("building llama.cpp") and said[-1].startswith("built")
    _fake_pip(peer, monkeypatch, "import sys; sys.exit(9)")  # a second call does not build again
    assert peer.find_or_build(build=True, log=pytest.fail) == folder
    env = peer.child_env(folder)
    assert env["PYTHONPATH"].split(":")[0] == folder


def test_a_build_finished_meanwhile_elsewhere_is_used(peer, monkeypatch, tmp_path):
    """Two runs building at once: the second to finish keeps the first one's folder."""
    folder = peer.cache_dir(peer.VERSION, peer.cmake_args(peer.cpu_flags()))
    first = f"f = pathlib.Path({str(folder)!r}) / 'llama_cpp'; f.mkdir(parents=True); "
    _fake_pip(
        peer,
        monkeypatch,
        WRITES.format(file="__init__.py", text="") + first + "(f / '__init__.py').write_text('FIRST = 1')",
    )
    real_rmtree = peer.shutil.rmtree
    monkeypatch.setattr(  # the other run's folder appears after this one checked (no removal race here)
        peer.shutil, "rmtree", lambda p, **kw: None if Path(p) == folder else real_rmtree(p, **kw)
    )
    assert peer.find_or_build(build=True, log=lambda m: None) == str(folder)
    assert (folder / "llama_cpp" / "__init__.py").read_text() == "FIRST = 1"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [folder.name]
