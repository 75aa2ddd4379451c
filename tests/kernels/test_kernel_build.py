"""The kernels' one ISA numbering and override, the kernel selector, and the build's fallback path
(``kernels/isa.py``, ``kernels/select.py``, ``kernels/build.py``)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import torch

from bitmosaic.kernels import build, isa, lut, mosaic, qmatmul
from bitmosaic.kernels.lut import BitPlaneWeight
from bitmosaic.kernels.qmatmul import LowBitWeight
from bitmosaic.kernels.select import KERNEL_ENV, select_kernel
from tests.kernels.test_lut import _close as _lut_close
from tests.kernels.test_lut import _weight as _lut_weight
from tests.kernels.test_mosaic_decode import _close as _mosaic_close
from tests.kernels.test_mosaic_decode import _weight as _mosaic_weight
from tests.kernels.test_qmatmul import _case, _check_matmul

compiled = pytest.mark.skipif(qmatmul.extension() is None, reason="no C++ compiler: pure-torch path only")


def test_one_numbering_in_python_and_cpp():
    header = (Path(build.CSRC) / "isa.h").read_text()
    assert isa.ISAS == ("portable", "avx2", "avx512")
    assert "kPortable = 0, kAvx2 = 1, kAvx512 = 2" in header
    exts = [build.load(n) for n in build.EXTENSIONS]
    if all(e is None for e in exts):
        pytest.skip("no compiled extension here")
    assert len({tuple(isa.available_isas(e)) for e in exts}) == 1  # one detection for all seven
    assert isa.available_isas()[0] == "portable"


@compiled
@pytest.mark.parametrize("name", isa.ISAS)
def test_each_forced_isa_matches_the_reference(monkeypatch, name):
    """$BITMOSAIC_KERNEL_ISA forces every kernel (LowBitWeight, the bit-plane LUT, the mosaic
    residual pass) onto one ISA; each then matches the pure-torch reference; an ISA this CPU lacks
    is a one-line error from every kernel."""
    monkeypatch.setenv(isa.ISA_ENV, name)
    bmap = torch.tensor([2, 3, 4, 8])[torch.randint(0, 4, (4, 5), generator=torch.Generator().manual_seed(5))]
    w, ref, g = _case(37, 64 * 9 + 17, 128, bmap, 10, 3)
    p, pref, pg = _lut_weight(45, 100, 32, 20, "mix", 29)
    k = _mosaic_weight(100, 70, (24, 40), 0.4, 5)
    x, xp = torch.randn(3, 70), torch.randn(2, 100)
    if name not in isa.available_isas():
        for call in (w.dequantize, lambda: w.matmul(torch.randn(1, w.K)), lambda: p.matmul(xp), lambda: k(x)):
            with pytest.raises(ValueError, match="this CPU runs only"):
                call()
        return
    assert isa.kernel_isa() == name
    assert torch.equal(w.dequantize(), ref)
    _check_matmul(w, ref, g, batches=(1, 3, 8, 9))
    _lut_close(p.matmul(xp), xp, pref, p.err_scale)
    _lut_close(p.matmul(xp[:1]), xp[:1], pref, p.err_scale)
    _mosaic_close(k.decode(x), k.dense.matmul(x) + k.sparse_only(x))


@compiled
def test_isa_argument_of_the_lut_overrides_the_environment(monkeypatch):
    p, pref, _ = _lut_weight(45, 100, 32, 20, "mix", 29)
    x = torch.randn(1, 100)
    monkeypatch.setenv(isa.ISA_ENV, "portable")
    assert torch.equal(p.matmul(x), p.matmul(x, isa="portable"))
    best = isa.available_isas()[-1]
    _lut_close(p.matmul(x, isa=best), x, pref, p.err_scale)
    with pytest.raises(ValueError, match="isa must be one of auto, portable, avx2, avx512"):
        p.matmul(x, isa="neon")


def test_selector_defaults(monkeypatch):
    """Today's choices, from the declared capabilities: packed kinds (lut, lowbit) on the LUT at 1-3
    bits and 1-64 rows when it is compiled, LowBitWeight otherwise; mosaic (lowbit) and SFMP (lut)
    always on theirs."""
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    packed, mosaic_kind, sfmp = ("lut", "lowbit"), ("lowbit",), ("lut",)
    lut_here = lut.extension() is not None
    for b in range(1, 9):
        want = BitPlaneWeight if lut_here and b <= 3 else LowBitWeight
        assert select_kernel(packed, b) is want, b
        assert select_kernel(packed, b, rows=65) is LowBitWeight
        assert select_kernel(mosaic_kind, b) is LowBitWeight
        assert select_kernel(sfmp, b) is BitPlaneWeight
    mix = torch.tensor([[2, 3], [3, 2]], dtype=torch.uint8)
    assert select_kernel(packed, mix) is (BitPlaneWeight if lut_here else LowBitWeight)
    assert select_kernel(packed, mix.clone().fill_(4)) is LowBitWeight
    assert select_kernel(packed, torch.tensor([[2, 5]])) is LowBitWeight  # not fast at every width
    # groups shorter than LowBitWeight's 64-code spans (it would pad each): the LUT, at any width
    for b in (2, 4, 8):
        for gs in (16, 32, 96):
            assert select_kernel(packed, b, group_size=gs) is (BitPlaneWeight if lut_here else LowBitWeight)
        for gs in (64, 128, -1, None):
            assert select_kernel(packed, b, group_size=gs) is (
                BitPlaneWeight if lut_here and b <= 3 else LowBitWeight
            )
    monkeypatch.setattr(lut, "extension", lambda: None)  # no compiled LUT: its fallback is not faster
    assert select_kernel(packed, 2) is LowBitWeight
    assert select_kernel(packed, 4, group_size=32) is LowBitWeight
    assert select_kernel(sfmp, 2) is BitPlaneWeight  # the only kernel SFMP lists
    with pytest.raises(ValueError, match="none of the kernels"):
        select_kernel(packed, 9)
    with pytest.raises(ValueError, match="none of the kernels"):
        select_kernel(packed, 4, device="cuda")
    with pytest.raises(ValueError, match="unknown kernel"):
        select_kernel(("marlin",), 4)


def test_selector_override(monkeypatch):
    monkeypatch.setenv(KERNEL_ENV, "lowbit")
    assert select_kernel(("lut", "lowbit"), 2) is LowBitWeight
    assert select_kernel(("lut",), 2) is BitPlaneWeight  # a kind that cannot run it keeps its own
    monkeypatch.setenv(KERNEL_ENV, "LUT")
    assert select_kernel(("lut", "lowbit"), 8) is BitPlaneWeight
    assert select_kernel(("lowbit",), 2) is LowBitWeight
    monkeypatch.setenv(KERNEL_ENV, "auto")
    assert select_kernel(("lut", "lowbit"), 8) is LowBitWeight
    monkeypatch.setenv(KERNEL_ENV, "gemm")
    with pytest.raises(ValueError, match=r"\$BITMOSAIC_KERNEL='gemm' is not one of auto, lowbit, lut"):
        select_kernel(("lut", "lowbit"), 2)


_WARNING = re.compile(
    r"^bitmosaic: C\+\+ kernels unavailable \((?P<reason>[^\n]+)\); using the pure-torch path, [^\n]+ slower$"
)


def _fallback_runs():
    w, ref, g = _case(30, 200, 64, torch.tensor([[4, 2, 3, 8]]), None, 2)
    assert torch.equal(w.dequantize(), ref)
    _check_matmul(w, ref, g, batches=(1, 9))
    p, pref, _ = _lut_weight(37, 150, 64, 16, "mix", 19)
    x = torch.randn(2, 150)
    _lut_close(p.matmul(x), x, pref, p.err_scale)
    k = _mosaic_weight(100, 70, (24, 40), 0.4, 5)
    xm = torch.randn(2, 70)
    _mosaic_close(k(xm), k.dense.matmul(xm) + k.sparse_only(xm))


def test_missing_compiler_is_one_warning_and_the_torch_path(monkeypatch):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise FileNotFoundError("[Errno 2] No such file or directory: 'c++'")

    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_warned", False)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.delenv(build.NO_EXT_ENV, raising=False)
    with pytest.warns(RuntimeWarning) as rec:
        assert qmatmul.extension() is None and lut.extension() is None and mosaic.extension() is None
        assert isa.available_isas() == [] and isa.kernel_isa() is None
        _fallback_runs()
    msgs = [str(r.message) for r in rec if "bitmosaic: C++" in str(r.message)]
    assert len(msgs) == 1, msgs  # one warning per process, not per extension or call
    m = _WARNING.match(msgs[0])
    assert m and "FileNotFoundError" in m["reason"] and "c++" in m["reason"], msgs[0]


def test_no_ext_environment_is_one_warning_and_the_torch_path(monkeypatch):
    monkeypatch.setattr(build, "_warned", False)
    monkeypatch.setenv(build.NO_EXT_ENV, "1")
    with pytest.warns(RuntimeWarning) as rec:
        assert all(build.load(n) is None for n in build.EXTENSIONS)
        _fallback_runs()
    msgs = [str(r.message) for r in rec if "bitmosaic: C++" in str(r.message)]
    assert len(msgs) == 1 and _WARNING.match(msgs[0]) and "$BITMOSAIC_NO_EXT=1" in msgs[0]


def test_module_names_follow_the_sources():
    names = {n: build.module_name(n) for n in build.EXTENSIONS}
    assert len(set(names.values())) == len(build.EXTENSIONS) == 7
    assert all(re.fullmatch(rf"bitmosaic_{n}_[0-9a-f]{{10}}", v) for n, v in names.items())


def test_module_names_follow_the_torch_version(monkeypatch):
    """Two environments with different torch versions sharing one cache keep separate builds."""
    import torch

    before = {n: build.module_name(n) for n in build.EXTENSIONS}
    monkeypatch.setattr(torch, "__version__", "0.0.1+other")
    after = {n: build.module_name(n) for n in build.EXTENSIONS}
    assert all(before[n] != after[n] for n in build.EXTENSIONS)


def test_module_names_follow_the_checkout(monkeypatch, tmp_path):
    """Two checkouts of the same sources sharing one cache keep separate builds (torch's build files
    name the sources by path: under one name each checkout rebuilt the other's kernel)."""
    import shutil

    before = {n: build.module_name(n) for n in build.EXTENSIONS}
    copy = tmp_path / "csrc"
    shutil.copytree(build.CSRC, copy)
    monkeypatch.setattr(build, "CSRC", copy)
    after = {n: build.module_name(n) for n in build.EXTENSIONS}
    assert all(before[n] != after[n] for n in build.EXTENSIONS)


def test_module_names_follow_the_torch_installation(monkeypatch, tmp_path):
    """The same torch version in two virtual environments keeps separate builds (its include folders
    are part of the build command: under one name each environment rebuilt the other's kernel)."""
    import torch

    before = {n: build.module_name(n) for n in build.EXTENSIONS}
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "torch" / "__init__.py"))
    after = {n: build.module_name(n) for n in build.EXTENSIONS}
    assert all(before[n] != after[n] for n in build.EXTENSIONS)


def test_a_build_inside_the_process_is_recorded(monkeypatch, tmp_path):
    """``build.COMPILED`` names each extension this process built (a first build, or one torch found
    stale and rebuilt), and not one it only loaded: a timing reads it to say a compile was inside."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "COMPILED", [])
    monkeypatch.delenv(build.NO_EXT_ENV, raising=False)
    stale = {"mosaic"}  # what the stand-in for torch's build rebuilds

    def fake_load(name, **kwargs):
        so = Path(cpp_extension._get_build_directory(name, False)) / f"{name}.so"
        if not so.exists() or any(name.startswith(f"bitmosaic_{n}_") for n in stale):
            so.write_bytes(so.read_bytes() + b"x" if so.exists() else b"x")
        return object()

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    build.load("qmatmul")
    build.load("mosaic")
    assert build.COMPILED == ["qmatmul", "mosaic"]  # first builds
    monkeypatch.setattr(build, "_loaded", {})  # a new process, the same cache
    monkeypatch.setattr(build, "COMPILED", [])
    so = next(tmp_path.rglob(f"{build.module_name('mosaic')}.so"))
    os.utime(so, ns=(time.time_ns() - 10**9,) * 2)  # an older build: a rewrite changes the time
    build.load("qmatmul")
    build.load("mosaic")
    assert build.COMPILED == ["mosaic"]  # qmatmul loaded as built; mosaic was stale
