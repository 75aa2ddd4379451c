"""File hashes of saved model folders: what bitmosaic wrote, and whether it is still what it wrote.

Every folder bitmosaic saves (``save_quantized``, a streamed ``quantize``) ends with ``SHA256SUMS``:
one line ``<sha256 hex>  <file name>`` per file it wrote there (``config.json``, every safetensors
shard and the index, the tokenizer and generation files), in the format of ``sha256sum``, so
``sha256sum -c SHA256SUMS`` checks a folder without bitmosaic too.  The list is written last, just
before the folder is renamed into place.

- :func:`verify_folder` (``bitmosaic inspect DIR --verify``, and ``bitmosaic reproduce`` before it
  reruns anything) hashes every listed file again and raises one line naming the first file that
  differs or is missing, or a weight file or JSON file the list does not name; a folder saved before
  bitmosaic wrote the list returns ``None`` (nothing to verify).
- :func:`foreign_files` names what in a folder bitmosaic did not write (``--overwrite`` refuses to
  delete those): the files the list does not name or, in a folder from before the list, the files
  whose names are not ones bitmosaic writes.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from ...errors import CorruptModelError

__all__ = ["SUMS", "TEMP_MARKER", "file_sha256", "write_sums", "read_sums", "verify_folder", "foreign_files"]

SUMS = "SHA256SUMS"
TEMP_MARKER = ".bitmosaic-temporary"  # marks bitmosaic's own temporary folders (io/outlock.py)
_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")
_RESAVE = "save or download it again"
# what a folder from before SHA256SUMS may hold: the names save_quantized, a streamed run and the
# tokenizer's save_pretrained write
_KNOWN = re.compile(
    r"^(config\.json|generation_config\.json|model\.safetensors|model\.safetensors\.index\.json|"
    r"model-\d{5}-of-\d{5}\.safetensors|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|"
    r"tokenizer\.model|vocab\.json|vocab\.txt|merges\.txt|added_tokens\.json|spiece\.model|"
    r"chat_template\.(jinja|json))$"
)


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file, read in blocks (any size, little memory)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def write_sums(folder: str | Path) -> dict[str, str]:
    """Hash every file under ``folder`` (``SHA256SUMS`` and a temporary's marker aside) and write
    ``folder/SHA256SUMS``; returns name -> hex.  Call it when the folder is complete, before the rename."""
    folder = Path(folder)
    sums = {name: file_sha256(folder / name) for name in _files(folder) if name not in (SUMS, TEMP_MARKER)}
    (folder / SUMS).write_text("".join(f"{h}  {n}\n" for n, h in sums.items()), encoding="utf-8")
    return sums


def read_sums(folder: str | Path) -> dict[str, str] | None:
    """name -> hex of ``folder/SHA256SUMS``; ``None`` when the folder has none.  A malformed list, or
    one naming a path outside the folder, raises :class:`CorruptModelError`."""
    folder = Path(folder)
    file = folder / SUMS
    if not file.is_file():
        return None
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CorruptModelError(f"{file} is unreadable ({e}); {_RESAVE}") from None
    sums = {}
    for i, line in enumerate(lines, 1):
        m = _LINE.match(line)
        name = m.group(2) if m else ""
        if not m or name.startswith("/") or ".." in Path(name).parts:
            raise CorruptModelError(
                f"{file} line {i} is not '<sha256>  <file in the folder>'; the list is damaged: {_RESAVE}"
            )
        sums[name] = m.group(1)
    return sums


def verify_folder(folder: str | Path) -> list[str] | None:
    """Hash every file ``SHA256SUMS`` lists and compare (module doc): the names checked, or ``None``
    when the folder has no list.  The first file that differs, is missing, or is an unlisted weight
    or JSON file raises :class:`CorruptModelError` naming it."""
    folder = Path(folder)
    sums = read_sums(folder)
    if sums is None:
        return None
    for name, want in sums.items():
        f = folder / name
        if not f.is_file():
            raise CorruptModelError(f"{f} is missing ({SUMS} lists it); the model is damaged: {_RESAVE}")
        if file_sha256(f) != want:
            raise CorruptModelError(
                f"{f} differs from the file bitmosaic saved (its SHA-256 is not the one in {SUMS}): it was "
                f"changed or damaged after saving; {_RESAVE}"
            )
    stray = [n for n in _files(folder) if n not in sums and n.endswith((".safetensors", ".json"))]
    if stray:
        raise CorruptModelError(
            f"{folder / stray[0]} was not saved with this model (not in {SUMS}); remove it, or {_RESAVE}"
        )
    return list(sums)


def foreign_files(folder: str | Path) -> list[str]:
    """What under ``folder`` bitmosaic did not write (module doc): relative names, folders with a
    trailing ``/``."""
    folder = Path(folder)
    sums = read_sums(folder) if (folder / SUMS).is_file() else None
    out = []
    for p in sorted(folder.rglob("*")):
        name = p.relative_to(folder).as_posix()
        if p.is_dir():
            if sums is None or not any(n.startswith(name + "/") for n in sums):
                out.append(name + "/")
            continue
        if any(name.startswith(d) for d in out):
            continue
        if name in (SUMS, TEMP_MARKER):
            continue
        ours = name in sums if sums is not None else bool(_KNOWN.match(name))
        if not ours:
            out.append(name)
    return out
