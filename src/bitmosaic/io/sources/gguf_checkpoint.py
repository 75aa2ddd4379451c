"""A GGUF file read one tensor at a time, for streaming quantization of GGUF models of any size.

:class:`GGUFCheckpoint` has the interface of :class:`~bitmosaic.io.sources.checkpoint.Checkpoint` (``keys``,
``in``, ``get``, ``fingerprint``, ``config``, ``empty_model``, ``fill``) and reads what transformers'
GGUF loader would, without ever holding more than the one tensor asked for:

- the config is transformers' own (``AutoConfig.from_pretrained(folder, gguf_file=name)``), and so is
  the per-architecture tensor processing (its ``TENSOR_PROCESSORS``: the reverse permutation of
  Llama's q/k rows, Gemma's norms stored as ``w + 1``), configured with the metadata transformers
  gives it (``load_gguf_checkpoint(..., return_tensors=False)``);
- GGUF tensor names map to the model's names with transformers' ``get_gguf_hf_weights_map`` on the
  empty (``meta``) model; an output head absent from the file means tied embeddings, as there;
- ``get`` maps only that tensor's bytes from the file (``numpy.memmap`` at its offset, released when
  the read is done, so no page of the file stays mapped), dequantizes it with
  ``gguf.quants.dequantize``, applies the processing and returns float32 -- bit for bit the tensor
  ``from_pretrained(..., gguf_file=..., dtype=torch.float32)`` builds, and that the converted copy
  (:mod:`bitmosaic.io.sources.gguf_cache`) holds -- cast to the requested dtype.

Architectures: those whose GGUF tensors map one to one onto the model's and whose conversion has been
checked against transformers' loader (:data:`STREAMABLE`); others are refused in one line
(:class:`UnsupportedGGUFError`).  The resume fingerprint is the file's path, size and modification
time and the transformers and gguf versions (:func:`gguf_fingerprint`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ...errors import CorruptModelError, ModelSpecError, check_finite
from .checkpoint import Checkpoint, missing_tensor

__all__ = [
    "GGUFCheckpoint", "STREAMABLE", "UnsupportedGGUFError", "check_layout", "gguf_fingerprint", "open_gguf",
]  # fmt: skip

# GGUF ``general.architecture`` values read tensor by tensor (each checked against transformers' loader
# in tests/io/test_gguf_checkpoint.py).  Mistral GGUFs say "llama".
STREAMABLE = ("gemma2", "gemma3", "llama", "phi3", "qwen2", "qwen3")


class UnsupportedGGUFError(ModelSpecError):
    """A GGUF file whose architecture cannot be read tensor by tensor."""


class _Tensor(NamedTuple):
    """Where one tensor's bytes are in the file, as ``GGUFReader`` lays them out for ``dequantize``."""

    qtype: object  # gguf.GGMLQuantizationType
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]


def gguf_fingerprint(path: str | os.PathLike) -> str:
    """What identifies a GGUF file's float tensors cheaply: its resolved path, size and modification
    time, and the versions of transformers (the conversion) and gguf (the dequantization)."""
    import gguf
    import transformers

    path = Path(path)
    st = path.stat()
    info = {"gguf_file": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "transformers": transformers.__version__,
            "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf")}  # fmt: skip
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:24]


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def _unsupported(spec: str, arch: str, why: str = "") -> UnsupportedGGUFError:
    return UnsupportedGGUFError(
        f"{spec}: GGUF architecture {arch!r} cannot be streamed tensor by tensor{why} (streamable: "
        f"{', '.join(STREAMABLE)}); use --stream off (the model is loaded whole), or convert it with "
        "transformers (AutoModelForCausalLM.from_pretrained(folder, gguf_file=NAME).save_pretrained(DIR)) "
        "and stream DIR"
    )


def _file_name(spec: str, path: Path) -> str:
    """How errors name the file: ``GGUF file PATH``, after the model spec when that differs."""
    return ("" if str(spec) == str(path) else f"{spec}: ") + f"GGUF file {path}"


def _damaged(spec: str, path: Path, e: BaseException) -> CorruptModelError:
    reason = " ".join(str(e).split())[:160] or type(e).__name__
    return CorruptModelError(f"{_file_name(spec, path)} is truncated or damaged ({reason}); re-download it")


def open_gguf(path: str | os.PathLike, spec: str | None = None):
    """``gguf.GGUFReader`` of ``path``; a truncated or damaged file (numpy's "cannot reshape array",
    a bad magic, a short header) raises one line naming the file (:class:`CorruptModelError`)."""
    from gguf import GGUFReader

    path = Path(path)
    try:
        check_layout(path)  # before gguf-py walks it: a count the file cannot hold is refused at once
        reader = GGUFReader(os.fspath(path))
    except (ValueError, OSError, KeyError, IndexError, EOFError) as e:
        raise _damaged(spec or str(path), path, e) from None
    try:
        arch = _string_field(reader, "general.architecture")
    except (KeyError, IndexError, ValueError, UnicodeDecodeError):
        return reader  # no architecture: transformers refuses the file itself, before sizing anything
    for check in (_check_block_count, _check_heads, _check_sizes):  # metadata against the tensors
        check(reader, arch, _file_name(spec or str(path), path))
    return reader


_MAX_NESTING = 16  # arrays of arrays (models hold none; gguf-py recurses once per level)


def check_layout(path: Path) -> None:
    """Walk the header of GGUF ``path`` (metadata and tensor infos) with every count and length checked
    against the bytes left in the file, in constant memory; raise ``ValueError`` naming the first that
    does not fit.  gguf-py's reader trusts them: past the end of the file its reads return empty arrays
    and its offset stops, so an array whose count says more values than the file holds (2^64 - 2^48 + 128
    int32 token types, found by the long fuzz run) made it append empty views without end until the
    memory ran out (an OOM kill, or a MemoryError/SystemError at a random place under a memory limit).
    A file without the GGUF magic or of a version gguf-py does not read is left to gguf-py's own error."""
    import mmap

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            order = _byte_order(buf)
            if order is not None:
                _HeaderWalk(buf, size, order).walk()


def _byte_order(buf) -> str | None:
    """The ``struct`` byte order of a GGUF header (``"<"``, or ``">"`` for a file written on a machine
    of the other byte order, as gguf-py reads it), or ``None`` without the magic or for a version
    gguf-py does not read."""
    import struct

    if buf[:4] != b"GGUF":
        return None
    order = "<"
    version = struct.unpack_from("<I", buf, 4)[0]
    if version & 0xFFFF == 0:  # written on a machine of the other byte order (as gguf-py reads it)
        order, version = ">", struct.unpack_from(">I", buf, 4)[0]
    return order if version in (2, 3) else None


class _HeaderWalk:
    """The walk of :func:`check_layout` over a mapped GGUF file of ``size`` bytes, from the offset
    after the magic and version: each ``read``, ``skip`` and count is checked against the bytes left."""

    def __init__(self, buf, size: int, order: str) -> None:
        import struct

        from gguf import GGUFValueType as T

        self.buf, self.size, self.offs = buf, size, 8
        self.u32, self.u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")
        self.string_t, self.array_t = int(T.STRING), int(T.ARRAY)
        # the scalar value types and their sizes in bytes (the type names are numpy's: UINT8, FLOAT32, BOOL)
        self.sizes = {int(t): np.dtype(t.name.lower()).itemsize for t in T if t not in (T.STRING, T.ARRAY)}

    def walk(self) -> None:
        """The counts, the metadata (keys and values) and the tensor infos, in file order."""
        read, u32, u64 = self.read, self.u32, self.u64
        tensors, kvs = read(u64, "the tensor count"), read(u64, "the metadata count")
        self.fits(kvs, 13, "the metadata count", least=True)  # a key's length, its type and a byte
        for i in range(kvs):
            what = "metadata " + self.name(f"metadata key {i}")
            self.value(read(u32, what), what)
        self.fits(tensors, 24, "the tensor count", least=True)  # a name's length, dims, type, offset
        for i in range(tensors):
            what = "tensor info " + self.name(f"tensor info {i}")
            self.skip(read(u32, what), 8, f"the dimension count of {what}")
            read(u32, what), read(u64, what)

    def read(self, fmt, what: str) -> int:
        if fmt.size > self.size - self.offs:
            raise ValueError(f"the file ends inside {what}")
        self.offs += fmt.size
        return fmt.unpack_from(self.buf, self.offs - fmt.size)[0]

    def fits(self, count: int, each: int, what: str, least: bool = False) -> None:
        if count * each > self.size - self.offs:
            raise ValueError(f"{what} says {count} of {each}{' or more' if least else ''} bytes, "
                             f"but the file has {self.size - self.offs} bytes left")  # fmt: skip

    def skip(self, count: int, each: int, what: str) -> None:
        self.fits(count, each, what)
        self.offs += count * each

    def string(self, what: str) -> int:
        n = self.read(self.u64, f"the length of {what}")
        self.skip(n, 1, f"the length of {what}")
        return n

    def name(self, what: str) -> str:
        """A key's or a tensor's name, as much as errors show."""
        n = self.string(what)
        text = bytes(self.buf[self.offs - n : self.offs - n + min(n, 60)]).decode("utf-8", "replace")
        return "".join(c if c.isprintable() else "?" for c in text)

    def value(self, vtype: int, what: str, depth: int = 0) -> None:
        if vtype in self.sizes:
            self.skip(1, self.sizes[vtype], what)
        elif vtype == self.string_t:
            self.string(what)
        elif vtype == self.array_t:
            self.array(what, depth)
        else:
            raise ValueError(f"{what} has unknown value type {vtype}")

    def array(self, what: str, depth: int) -> None:
        if depth >= _MAX_NESTING:
            raise ValueError(f"{what} nests arrays more than {_MAX_NESTING} deep")
        itype, count = self.read(self.u32, what), self.read(self.u64, what)
        if itype in self.sizes:  # scalars: skipped at once
            self.skip(count, self.sizes[itype], f"the array {what}")
        elif itype in (self.string_t, self.array_t):  # a string's length or an array's type and count
            self.fits(count, 8 if itype == self.string_t else 12, f"the array {what}", least=True)
            for _ in range(count):
                self.value(itype, what, depth + 1)
        else:
            raise ValueError(f"{what} is an array of unknown value type {itype}")


_BLOCK = re.compile(r"(?:^|\.)blk\.(\d+)\.")


def _check_block_count(reader, arch: str, file: str) -> None:
    """The layer count in the metadata (``{arch}.block_count``) must be the number of ``blk.N``
    tensor groups in the file.  transformers sizes the model and gguf-py its tensor-name map from that
    number before any tensor is read: a damaged or hostile count (2^31) costs minutes and tens of GB
    there (found by the long fuzz run: killed by the kernel at 23.7 GB), and a missing one silently
    becomes the architecture's default (32 layers for Llama) with 31 of them uninitialised."""
    blocks = [int(m.group(1)) for t in reader.tensors if (m := _BLOCK.search(t.name))]
    present = max(blocks) + 1 if blocks else 0
    key = f"{arch}.block_count"
    field = reader.fields.get(key)
    try:
        count = int(field.parts[field.data[0]][0]) if field is not None else None
    except (IndexError, TypeError, ValueError):
        count = None
    if count is None and not blocks:
        return  # no layers named and none counted (e.g. an empty file of another architecture)
    if count is None:
        raise CorruptModelError(
            f"{file} has no readable {key} (its layer count) in its metadata; "
            "re-download it"
        )
    if count != present:
        raise CorruptModelError(
            f"{file} says it has {count} layers ({key}) but holds the tensors of "
            f"{present}; re-download it"
        )


def _uint_field(reader, key: str) -> int | None:
    """A scalar integer field, or ``None`` when absent or not one (e.g. a per-layer array)."""
    field = reader.fields.get(key)
    if field is None or len(field.data) != 1:
        return None
    try:
        value = field.parts[field.data[0]]
        return int(value[0]) if value.dtype.kind in "iu" and value.size == 1 else None
    except (IndexError, TypeError, ValueError, AttributeError):
        return None


def _check_heads(reader, arch: str, file: str) -> None:
    """The attention head counts in the metadata must split the attention weights into whole heads
    of one width: transformers' Llama reader reshapes the q/k rows per head (and per rotary half)
    before any check, so a damaged ``head_count_kv`` (258, found by the long fuzz run) raised numpy's
    "cannot reshape array" from inside transformers, in both loaders."""
    h = _uint_field(reader, f"{arch}.attention.head_count")
    if h is None:
        return  # absent or per layer: transformers' defaults and its own checks apply
    kv = _uint_field(reader, f"{arch}.attention.head_count_kv")
    kv = h if kv is None else kv

    def refuse(why: str):
        raise CorruptModelError(f"{file} {why}; re-download it")

    keys = f"{arch}.attention.head_count {h}, head_count_kv {kv}"
    if h < 1 or kv < 1 or h % kv:
        refuse(f"has attention head counts that no model has ({keys}: each must be at least 1, and kv "
               "heads must divide the heads)")  # fmt: skip
    halves = 2 if arch == "llama" else 1  # transformers un-permutes Llama's rotary halves per head
    width = {}
    for t in reader.tensors:
        kind = t.name.rsplit(".", 2)[-2] if t.name.endswith(".weight") else None
        if kind not in ("attn_q", "attn_k") or len(t.shape) != 2:
            continue
        n, rows = (h if kind == "attn_q" else kv), int(t.shape[1])  # GGUF shapes are [in, out]
        if rows % (n * halves):
            refuse(f"has {t.name} of {rows} rows, which {n} attention heads do not split ({keys})")
        width.setdefault(kind, rows // n)
    if len(set(width.values())) > 1:
        refuse(f"has query heads of {width['attn_q']} and key heads of {width['attn_k']} columns ({keys})")


# metadata size -> (tensor, its dimension in GGUF order [in, out]) that must have that size
_SIZES = {"embedding_length": ("token_embd.weight", 0), "vocab_size": ("token_embd.weight", 1),
          "feed_forward_length": ("blk.0.ffn_up.weight", 1)}  # fmt: skip


def _check_sizes(reader, arch: str, file: str) -> None:
    """The model sizes in the metadata must be the tensors' sizes: transformers builds the model from
    the metadata, then re-initialises every tensor whose shape differs -- a damaged
    ``embedding_length`` (found by the long fuzz run) gave a model of random weights, or allocated
    tens of GB for it."""
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    for key, (tensor, dim) in _SIZES.items():
        size = _uint_field(reader, f"{arch}.{key}")
        shape = shapes.get(tensor)
        if size is None or shape is None or len(shape) <= dim or shape[dim] == size:
            continue
        if key == "feed_forward_length" and "blk.0.ffn_gate.weight" not in shapes:
            continue  # gate and up fused into one tensor (Phi-3): twice the width
        raise CorruptModelError(
            f"{file} says {arch}.{key} is {size} but its {tensor} has {shape[dim]}; "
            "re-download it"
        )


class GGUFCheckpoint(Checkpoint):
    """The float tensors of a GGUF file, by the model's names, dequantized one per read (module doc)."""

    def __init__(self, path: str | os.PathLike, spec: str | None = None) -> None:
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
            load_gguf_checkpoint,
        )

        self.path = Path(path)
        self.folder = self.path.parent
        self.spec = spec or str(path)
        reader = open_gguf(self.path, self.spec)
        try:
            arch = _string_field(reader, "general.architecture")
            # only offsets and layouts are kept: the reader's map of the whole file is dropped with it
            self._tensors = {
                t.name: _Tensor(t.tensor_type, int(t.data_offset), t.data.dtype, tuple(t.data.shape))
                for t in reader.tensors
            }
        except (ValueError, OSError, KeyError, IndexError) as e:
            raise _damaged(self.spec, self.path, e) from None
        del reader
        self.arch = arch
        if arch not in STREAMABLE:
            raise _unsupported(self.spec, arch)
        self._config = None
        try:
            # the metadata transformers' weight loader configures its tensor processor with
            params = load_gguf_checkpoint(os.fspath(self.path), return_tensors=False)
            self._processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=params["config"])
            gguf_to_hf = get_gguf_hf_weights_map(self.empty_model(torch.float32), self._processor)
        except (NotImplementedError, ValueError) as e:  # e.g. a model type gguf-py has no name map for
            raise _unsupported(self.spec, arch, f" ({' '.join(str(e).split())[:160]})") from None
        # the model's name -> the file's; in file order, a later tensor wins, as in transformers' loop
        self.names = {gguf_to_hf[g]: g for g in self._tensors if g in gguf_to_hf}

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def keys(self) -> list[str]:
        return list(self.names)

    def gguf_name(self, name: str) -> str:
        """The file's name for the model's tensor ``name``."""
        return self.names[name]

    def file_tensors(self) -> dict[str, tuple[object, tuple[int, ...]]]:
        """Every tensor of the file, in file order: its GGUF name -> ``(GGMLQuantizationType, shape)``
        (numpy order, the model's ``[out, in]`` for a linear weight)."""
        from gguf import quant_shape_from_byte_shape

        return {g: (t.qtype, tuple(quant_shape_from_byte_shape(t.shape, t.qtype)) if t.dtype == np.uint8
                    else t.shape) for g, t in self._tensors.items()}  # fmt: skip

    def row_order(self, name: str) -> np.ndarray | None:
        """How reading tensor ``name`` reorders the file's rows: ``None`` when it is read as stored, else
        ``p`` with the model's row ``i`` = the file's row ``p[i]`` (Llama's q/k permutation).  Found by
        reading row numbers through transformers' own processing, so a writer that stores ``w[p]`` back
        is its exact inverse.  Raises :class:`UnsupportedGGUFError` when reading changes values (Gemma's
        norms stored as ``w + 1``: not invertible bit for bit in float32)."""
        gname = self.names[name]
        shape = self.file_tensors()[gname][1]
        probe = np.arange(shape[0], dtype=np.float32).reshape((shape[0],) + (1,) * (len(shape) - 1))
        got = np.asarray(self._processor.process(weights=probe.copy(), name=gname).weights)
        if got.shape == probe.shape and np.array_equal(got, probe):
            return None
        if got.shape == probe.shape and np.array_equal(np.sort(got.ravel()), probe.ravel()):
            return got.ravel().astype(np.int64)
        raise UnsupportedGGUFError(
            f"{self.spec}: reading tensor {gname} of GGUF architecture {self.arch!r} changes its values, "
            "so it cannot be written back bit for bit"
        )

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``name`` as transformers loads it in float32 (then in ``dtype`` when given), checked
        for NaN/Inf.  Only this tensor's bytes are mapped, dequantized and processed."""
        from gguf import quants

        if name not in self.names:
            raise CorruptModelError(missing_tensor(self.spec, name))
        gname = self.names[name]
        info = self._tensors[gname]
        try:
            raw = np.memmap(self.path, dtype=info.dtype, mode="r", offset=info.offset, shape=info.shape)
        except (OSError, ValueError) as e:
            raise CorruptModelError(
                f"cannot read tensor {gname} of {self.path} ({' '.join(str(e).split())}); re-download it"
            ) from None
        try:
            w = quants.dequantize(raw, info.qtype)
        except (ValueError, TypeError, IndexError) as e:  # e.g. a shape that no block count matches
            raise CorruptModelError(
                f"tensor {gname} of {self.path} is damaged ({' '.join(str(e).split())[:160]}); re-download it"
            ) from None
        res = self._processor.process(weights=w, name=gname)
        if res.name != gname:  # a processor that merges or renames tensors is not streamable
            raise _unsupported(self.spec, self.arch, f" (tensor {gname} is not read one to one)")
        w = res.weights
        if not (w.flags.writeable and w.flags.c_contiguous):  # a view of the file: copy it out
            w = np.copy(w)
        del raw, res
        t = torch.from_numpy(w).to(torch.float32)  # the dtype the converted copy is made in
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        check_finite(t, f"weight {name} of model {self.spec!r}")
        return t

    def fingerprint(self) -> str:
        return gguf_fingerprint(self.path)

    def empty_model(self, dtype: torch.dtype):
        """As :meth:`Checkpoint.empty_model`; the config names the model class, as the converted copy's
        does (``save_pretrained`` writes it; a GGUF file's config has none)."""
        model = super().empty_model(dtype)
        if not model.config.architectures:
            model.config.architectures = [type(model).__name__]
        return model

    def config(self):
        """transformers' config of the file (read once; a copy each call)."""
        if self._config is None:
            from transformers import AutoConfig

            try:
                self._config = AutoConfig.from_pretrained(self.folder, gguf_file=self.path.name)
            except Exception as e:  # noqa: BLE001 - transformers' config validators raise many kinds
                raise ModelSpecError(
                    f"could not read the config of {self.spec!r}: {' '.join(str(e).split())[:200]}"
                ) from None
        return copy.deepcopy(self._config)


def _string_field(reader, key: str) -> str:
    f = reader.fields[key]
    return bytes(f.parts[f.data[0]]).decode("utf-8")
