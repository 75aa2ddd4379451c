"""Output folders: may bitmosaic write there, one writer at a time, atomic replacement, and
bitmosaic's own temporary folders.

**May it write.**  :func:`check_output_dir`: a path that does not exist, an empty folder, and -- only
with ``overwrite=True`` -- a folder bitmosaic saved that holds nothing else (a user's other files in
it are named and refused, never deleted: :func:`~bitmosaic.io.saved.integrity.foreign_files`).
:func:`check_writable` refuses a path below a file or in a folder without write permission.  Both are
cheap: call them before a long run.

**Lock.**  :func:`output_lock` holds ``.<name>.lock`` beside the output folder ``<name>`` for as long
as a run may write it (``quantize --out`` from start to end, ``save_quantized``, a streamed run).  It
is an advisory ``flock``: the kernel drops it when the process dies, even by ``kill -9``, so a
killed run never blocks the next one, while a second live run into the same folder refuses at once
in one line naming the first one's pid (:class:`~bitmosaic.errors.OutputLockedError`).  The lock is
re-entrant within a process (the CLI holds it around ``save_quantized``, which takes it too).  The
lock file holds the owner's pid and is removed on release.

**Temporaries.**  A save writes into ``.<name>.tmp-XXXX`` and, with ``--overwrite``, moves the old
folder to ``.<name>.old-XXXX`` until the new one is in place; each carries a marker file
(``.bitmosaic-temporary``: which folder it is for and what it is).  A ``kill -9`` leaves them behind;
the next run that takes a lock in the same parent folder removes every marked temporary whose output
is not locked by a live run -- and when an ``.old-`` folder is all that is left of its output (killed
between the two renames), it is put back in place instead.  Unmarked folders are never touched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ...errors import OutputExistsError, OutputLockedError, OutputWriteError
from .integrity import TEMP_MARKER, foreign_files

try:
    import fcntl
except ImportError:  # not POSIX: no locking (and no cleanup of other runs' temporaries)
    fcntl = None

__all__ = [
    "atomic_write_text", "check_writable", "check_output_dir", "replace_dir", "make_temporary", "output_lock",
    "lock_path", "mark_temporary", "clean_stale_temporaries",
]  # fmt: skip


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file and an atomic rename.  The file gets the mode
    a plain ``open(path, "w")`` would give it (an existing file's, else 0666 less the umask), not
    ``mkstemp``'s owner-only 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777 if path.is_file() else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.chmod(tmp, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _bitmosaic_qc(folder: Path) -> dict | None:
    """``quantization_config`` of ``folder`` if bitmosaic wrote it, else ``None`` (never raises)."""
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    return qc if isinstance(qc, dict) and qc.get("quant_method") == "bitmosaic" else None


def check_writable(path: str | os.PathLike, flag: str = "--out") -> None:
    """Raise :class:`~bitmosaic.errors.OutputWriteError` when ``path`` (a file or folder to create or
    replace) cannot be written: the nearest existing folder above it is a file, or not writable.  Cheap:
    call it before a long run."""
    p = Path(path).expanduser().absolute()
    anc = p.parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise OutputWriteError(
            f"{flag} {path} cannot be written: {anc} is a file, not a folder; choose another {flag}"
        )
    if not os.access(anc, os.W_OK | os.X_OK):
        raise OutputWriteError(
            f"{flag} {path} cannot be written: no permission to write in {anc}; choose another {flag}"
        )


def check_output_dir(out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """The resolved ``out_dir`` if :func:`save_quantized` may write there, else :class:`OutputExistsError`.

    Allowed: a path that does not exist, an empty folder, and -- only with ``overwrite=True`` -- a folder
    that bitmosaic saved and that holds only what bitmosaic wrote there.  A file, a non-empty folder that
    bitmosaic did not write (a float model, a folder of notes), or a bitmosaic folder with a user's other
    files in it, is always refused.  Cheap: call it before a long quantization run.
    """
    out = Path(out_dir).expanduser().resolve()
    check_writable(out, "--out")
    if not out.exists():
        return out
    if not out.is_dir():
        raise OutputExistsError(f"output {out} exists and is not a folder; choose another --out")
    if not any(out.iterdir()):
        return out
    if _bitmosaic_qc(out) is None:
        raise OutputExistsError(
            f"output folder {out} is not empty and is not a bitmosaic model folder (no config.json with "
            "quantization_config.quant_method 'bitmosaic'); bitmosaic never replaces it: choose another --out"
        )
    if not overwrite:
        raise OutputExistsError(
            f"output folder {out} already holds a bitmosaic model; pass --overwrite (overwrite=True) "
            "to replace it, or choose another --out"
        )
    foreign = foreign_files(out)
    if foreign:  # replacing the folder would delete them
        more = f" (and {len(foreign) - 5} more)" if len(foreign) > 5 else ""
        raise OutputExistsError(
            f"--overwrite would delete files bitmosaic did not write in {out}: {', '.join(foreign[:5])}"
            f"{more}; move them out of the folder, or choose another --out"
        )
    return out


def replace_dir(tmp: Path, out_dir: Path) -> None:
    """Move the finished ``tmp`` to ``out_dir``; an old ``out_dir`` is removed only after that worked.
    The old folder waits under a marked ``.<name>.old-`` name, so a run killed in between leaves
    something the next run can put back or remove (:func:`clean_stale_temporaries`)."""
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        (out_dir / TEMP_MARKER).unlink(missing_ok=True)  # the temporary's marker: now it is the output
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    old.rmdir()  # a fresh unique name for the old folder
    mark_temporary(out_dir, out_dir, "old")
    try:
        os.replace(out_dir, old)
    except BaseException:
        (out_dir / TEMP_MARKER).unlink(missing_ok=True)
        raise
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        os.replace(old, out_dir)  # put the old model back
        (out_dir / TEMP_MARKER).unlink(missing_ok=True)
        raise
    (out_dir / TEMP_MARKER).unlink(missing_ok=True)
    shutil.rmtree(old, ignore_errors=True)


def make_temporary(out_dir: Path) -> Path:
    """A fresh marked ``.<name>.tmp-`` folder beside ``out_dir`` to build it in."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # the output's mode, as mkdir gives it (mkdtemp's is owner-only)
    mark_temporary(tmp, out_dir, "tmp")
    return tmp


_HELD: dict[str, int] = {}  # resolved output path -> nesting depth, in this process
_TEMP = re.compile(r"^\.(.+)\.(tmp|old)-[^/]+$")


def lock_path(out: str | os.PathLike) -> Path:
    out = Path(out)
    return out.parent / f".{out.name}.lock"


def _key(out) -> Path:
    return Path(out).expanduser().resolve()


def _try_acquire(out: Path) -> int | str | None:
    """The locked file descriptor, or the holder's pid text when a live run holds it."""
    lock = lock_path(out)
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputWriteError(
                f"cannot create the lock file {lock} ({e.strerror or e}); choose another --out"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            return pid
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            same = False
        if same:  # not a file its last holder removed while we opened it
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)


def _release(out: Path, fd: int) -> None:
    try:
        lock_path(out).unlink(missing_ok=True)
    finally:
        os.close(fd)


def _made_dirs(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; the ones created, deepest first."""
    made = []
    p = folder
    while not p.exists() and p != p.parent:
        made.append(p)
        p = p.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputWriteError(f"cannot create {folder} ({e.strerror or e}); choose another --out") from None
    return made


@contextmanager
def output_lock(out: str | os.PathLike) -> Iterator[Path]:
    """Hold the lock of output folder ``out`` (module doc); yields ``out`` resolved.  Taking it also
    cleans the stale temporaries of its parent folder.  Folders it had to create for the lock file are
    removed again on release when they are still empty."""
    out = _key(out)
    key = str(out)
    if key in _HELD or fcntl is None:
        _HELD[key] = _HELD.get(key, 0) + 1
        try:
            yield out
        finally:
            _HELD[key] -= 1
            if not _HELD[key]:
                del _HELD[key]
        return
    made = _made_dirs(out.parent)
    got = _try_acquire(out)
    if not isinstance(got, int):
        raise OutputLockedError(
            f"output folder {out} is being written by another bitmosaic run (pid {got}, lock file "
            f"{lock_path(out)}); wait for it to finish, or choose another --out"
        )
    _HELD[key] = 1
    try:
        clean_stale_temporaries(out.parent)
        yield out
    finally:
        del _HELD[key]
        _release(out, got)
        for d in made:
            try:
                d.rmdir()
            except OSError:
                break


def mark_temporary(folder: Path, target: Path, kind: str) -> None:
    """Mark ``folder`` as bitmosaic's temporary ``kind`` (``tmp`` or ``old``) for output ``target``."""
    info = {"kind": kind, "target": Path(target).name, "pid": os.getpid()}
    (Path(folder) / TEMP_MARKER).write_text(json.dumps(info), encoding="utf-8")


def _marked(p: Path) -> tuple[str, str] | None:
    m = _TEMP.match(p.name)
    if not m or p.is_symlink() or not p.is_dir():
        return None
    try:
        info = json.loads((p / TEMP_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or info.get("target") != m.group(1) or info.get("kind") != m.group(2):
        return None
    return m.group(1), m.group(2)


def clean_stale_temporaries(parent: str | os.PathLike) -> list[str]:
    """Remove (or, for an ``.old-`` folder whose output is gone, restore) every marked temporary in
    ``parent`` whose output no live run holds (module doc); returns one line per action, also printed
    on stderr."""
    if fcntl is None:
        return []
    parent = Path(parent)
    done = []
    try:
        entries = sorted(parent.iterdir())
    except OSError:
        return []
    for p in entries:
        found = _marked(p)
        if found is None:
            continue
        name, kind = found
        target = parent / name
        fd = None
        if str(_key(target)) not in _HELD:
            got = _try_acquire(_key(target))
            if not isinstance(got, int):
                continue  # its run is alive
            fd = got
        try:
            if kind == "old" and not target.exists():
                os.replace(p, target)
                (target / TEMP_MARKER).unlink(missing_ok=True)
                done.append(f"restored {target} from {p.name}, left by an interrupted --overwrite")
            else:
                shutil.rmtree(p, ignore_errors=True)
                done.append(f"removed {p}, left by an interrupted save")
        finally:
            if fd is not None:
                _release(_key(target), fd)
    for line in done:
        print(f"bitmosaic: {line}", file=sys.stderr)
    return done
