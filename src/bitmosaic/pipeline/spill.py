"""Calibration activations on disk: the memory budget, the spill files, a streamed tensor file.

The pipeline keeps one layer's calibration activations -- the hidden states entering it, one tensor
per batch, and the outputs that become the next layer's inputs -- in the model's dtype.  At 128 x 2048
tokens of a hidden size 8192 that is 4.3 GB each in bf16, 8.6 GB in and out: more than a small
machine has beside the layer being quantized.  When they would take over :data:`SPILL_FRACTION` of
the memory budget (``--max-memory``, default: the memory available now, ``MemAvailable``), they
*spill*: each batch is written to a file as it is produced and read back, explicitly and one batch at
a time, when it is used (:class:`SpillStore`; :class:`~bitmosaic.pipeline.calibration.LayerInputs`
uses it).  The process then holds about one batch of inputs and one of outputs; what the kernel caches
of the files is page cache, which it gives back under pressure, not the process's own memory.  The
bytes read back are the bytes written, so results are bit-identical with and without spilling.

Where: a fresh folder ``.bitmosaic-spill-XXXXXXXX`` (:data:`SPILL_PREFIX`) inside the run's temporary
area -- a streamed run's ``.OUT.partial/`` work folder, else the folder the output goes to, else the
system's temporary folder (``$TMPDIR``; mind that ``/tmp`` may be a RAM disk) -- removed when the run
ends, also when it fails.  A folder left by a killed process is removed by the next streamed run into
the same output.

:func:`write_tensor_file` / :class:`TensorFile` write and read a safetensors file one tensor at a time
(the streamed run's resume file of the next layer's inputs), so neither holds more than one batch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..errors import OptionError

__all__ = [
    "SPILL_FRACTION",
    "SPILL_PREFIX",
    "SpillStore",
    "TensorFile",
    "available_bytes",
    "parse_size",
    "spill_decision",
    "write_tensor_file",
]

SPILL_FRACTION = 0.4  # the share of the budget one layer's inputs + outputs may take in memory
SPILL_PREFIX = ".bitmosaic-spill-"

_UNITS = {"": None, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)


def parse_size(value) -> int | None:
    """A memory size in bytes: an ``int`` (bytes), or text such as ``8GB``, ``512MB``, ``1.5T``,
    ``64GiB`` -- a number and a unit K, M, G or T (optionally followed by ``B`` or ``iB``; all are
    powers of 1024, so ``8GB`` is 8 x 2**30 bytes) or ``B`` for bytes.  ``None``/``"auto"``: ``None``
    (the memory available when the run decides).  Anything else is a one-line :class:`OptionError`."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise OptionError(f"max memory {value!r} is not a size; give bytes (an int) or text such as '8GB'")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(value)
        unit = (m.group(2).upper() or ("B" if m.group(3) and m.group(3).upper() == "B" else "")) if m else ""
        if m is None or _UNITS[unit] is None:
            raise OptionError(
                f"--max-memory {value!r} is not a size; give a number and a unit, e.g. 8GB, 512MB or 1.5TB "
                "(powers of 1024), or auto (the memory available now)"
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise OptionError(f"--max-memory {value!r} must be more than 0 bytes; e.g. 8GB, or auto")
    return n


def available_bytes() -> int:
    """The memory the machine can give a process now without swapping (``MemAvailable``)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def spill_decision(n_tokens: int, hidden: int, dtype: torch.dtype, budget: int | None, host: bool) -> dict:
    """Whether one layer's activations spill, as the run report records it: ``n_tokens`` calibration
    tokens of ``hidden`` values in ``dtype``, in and out (2 copies), against :data:`SPILL_FRACTION` of
    ``budget`` bytes (``None``: :func:`available_bytes` now).  ``host``: the activations would live in
    host memory (on the CPU, or offloaded from a GPU); on a GPU they are not the host's to spill."""
    need = 2 * n_tokens * hidden * dtype.itemsize
    given = budget is not None
    budget = budget if given else available_bytes()
    return {
        "spilled": bool(host and need > SPILL_FRACTION * budget),
        "dir": None,
        "activations_mb": round(need / 2**20, 2),
        "budget_mb": round(budget / 2**20, 2),
        "budget_from": "max_memory" if given else "MemAvailable",
    }


def _spill_root(root: str | os.PathLike | None) -> Path:
    if root is not None and Path(root).is_dir():
        return Path(root)
    return Path(tempfile.gettempdir())


def _as_bytes(t: torch.Tensor):
    """A host tensor's bytes as a buffer (no copy when it is contiguous)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _read_exact(f, n: int, what: str) -> torch.Tensor:
    buf = torch.empty(n, dtype=torch.uint8)
    got = f.readinto(buf.numpy()) if n else 0
    if got != n:
        raise OSError(f"{what} is truncated ({got} of {n} bytes); the run's temporary files were damaged")
    return buf


class SpillStore:
    """Batches of calibration activations in files, one file per generation (module doc).

    Generation 0 is filled with :meth:`append`; :meth:`read` gives batch ``i`` of the current
    generation (a fresh host tensor, read explicitly: nothing of the file stays mapped);
    :meth:`write` puts batch ``i`` of the next generation in a second file as it is produced, so the
    current batch ``i`` can still be read until then; :meth:`advance` makes the next generation the
    current one and deletes the old file.  :meth:`close` removes the folder (idempotent)."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=SPILL_PREFIX, dir=_spill_root(root)))
        self._gen = 0
        self._cur: list[tuple[int, tuple[int, ...], torch.dtype]] = []  # offset, shape, dtype per batch
        self._next: dict[int, tuple[int, tuple[int, ...], torch.dtype]] = {}
        self._writer = None
        self._reader = None

    def _path(self, gen: int) -> Path:
        return self.dir / f"activations-{gen:05d}.bin"

    def __len__(self) -> int:
        return len(self._cur)

    def spec(self, i: int) -> tuple[tuple[int, ...], torch.dtype]:
        return self._cur[i][1:]

    def _put(self, gen: int, t: torch.Tensor):
        t = t.detach().to("cpu").contiguous()
        try:
            if self._writer is None:
                self._writer = open(self._path(gen), "ab")
            entry = (self._writer.tell(), tuple(t.shape), t.dtype)
            self._writer.write(_as_bytes(t))
        except OSError as e:  # e.g. a full disk: say what was being written and what to do
            raise OSError(
                f"spilling calibration activations to {self.dir} failed ({e}); free disk space there, "
                "or raise --max-memory so that they stay in memory"
            ) from e
        return entry

    def append(self, t: torch.Tensor) -> None:
        """Add a batch to generation 0 (the first layer's inputs, as they are captured)."""
        if self._gen != 0 or self._next:
            raise RuntimeError("SpillStore.append fills the first generation only")
        self._cur.append(self._put(0, t))

    def read(self, i: int) -> torch.Tensor:
        """Batch ``i`` of the current generation: a new host tensor of its shape and dtype."""
        if self._writer is not None and not self._next:  # generation 0 still being appended
            self._writer.flush()
        if self._reader is None:
            self._reader = open(self._path(self._gen), "rb")
        off, shape, dtype = self._cur[i]
        self._reader.seek(off)
        what = f"spilled activation batch {i} ({self._path(self._gen)})"
        buf = _read_exact(self._reader, _numel(shape) * dtype.itemsize, what)
        return buf.view(dtype).reshape(shape)

    def write(self, i: int, t: torch.Tensor) -> None:
        """Batch ``i`` of the next generation (any order; each batch once)."""
        if self._writer is not None and not self._next:  # generation 0 complete
            self._writer.close()
            self._writer = None
        if not 0 <= i < len(self._cur) or i in self._next:
            raise IndexError(f"batch {i} of {len(self._cur)} written twice or out of range")
        self._next[i] = self._put(self._gen + 1, t)

    def advance(self) -> None:
        """The next generation becomes the current one (every batch must have been written)."""
        if len(self._next) != len(self._cur):
            raise RuntimeError(f"only {len(self._next)} of {len(self._cur)} next-layer batches were written")
        for f in (self._writer, self._reader):
            if f is not None:
                f.close()
        self._writer = self._reader = None
        self._path(self._gen).unlink(missing_ok=True)
        self._gen += 1
        self._cur = [self._next[i] for i in range(len(self._next))]
        self._next = {}

    def nbytes(self) -> int:
        return sum(dtype.itemsize * _numel(shape) for _, shape, dtype in self._cur)

    def close(self) -> None:
        for f in (self._writer, self._reader):
            if f is not None:
                f.close()
        self._writer = self._reader = None
        shutil.rmtree(self.dir, ignore_errors=True)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_ST_DTYPE = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
             torch.uint8: "U8", torch.bool: "BOOL"}  # fmt: skip
_TORCH_DTYPE = {v: k for k, v in _ST_DTYPE.items()}


def write_tensor_file(
    path: str | os.PathLike,
    specs: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
    get: Callable[[int], torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    """A safetensors file of the tensors ``specs`` names (name, shape, dtype), written in that order,
    each fetched by ``get(i)`` only when its turn comes (so at most one is held)."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    off = 0
    for name, shape, dtype in specs:
        n = _numel(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for i, (name, shape, dtype) in enumerate(specs):
            t = get(i).detach().to("cpu").contiguous()
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"{name}: got {tuple(t.shape)} {t.dtype}, announced {tuple(shape)} {dtype}")
            f.write(_as_bytes(t))


class TensorFile:
    """A safetensors file read one tensor at a time, explicitly (no mapping of the whole file)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._f = open(self.path, "rb")
        try:
            (n,) = struct.unpack("<Q", self._f.read(8))
            header = json.loads(self._f.read(n))
        except (struct.error, ValueError) as e:
            self._f.close()
            raise OSError(f"{self.path} is not a readable safetensors file ({e})") from e
        header.pop("__metadata__", None)
        self._base = 8 + n
        self._entries = header

    def keys(self) -> list[str]:
        return list(self._entries)

    def get(self, name: str) -> torch.Tensor:
        e = self._entries[name]
        begin, end = e["data_offsets"]
        self._f.seek(self._base + begin)
        buf = _read_exact(self._f, end - begin, f"{name} in {self.path}")
        return buf.view(_TORCH_DTYPE[e["dtype"]]).reshape(e["shape"])

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
