"""Files and folders written through a temporary get the modes a plain write would give them, not
``mkstemp``/``mkdtemp``'s owner-only ones (a saved model another user's server must read)."""

from __future__ import annotations

import os
import stat

import pytest

from bitmosaic.io.saved.outdir import atomic_write_text, make_temporary


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_file_gets_0666_less_the_umask(tmp_path, umask_022):
    atomic_write_text(tmp_path / "results.json", "{}")
    assert _mode(tmp_path / "results.json") == 0o644


def test_a_replaced_file_keeps_its_mode(tmp_path, umask_022):
    path = tmp_path / "results.json"
    path.write_text("old")
    os.chmod(path, 0o640)
    atomic_write_text(path, "new")
    assert path.read_text() == "new" and _mode(path) == 0o640


def test_an_output_folder_built_in_a_temporary_gets_0777_less_the_umask(tmp_path, umask_022):
    tmp = make_temporary(tmp_path / "model")
    assert _mode(tmp) == 0o755
