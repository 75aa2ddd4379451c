"""The one writer of a saved folder's safetensors: shard names, each shard written atomically, the index.

Both ways of saving write through here, so their files agree byte for byte in layout:

- the in-memory save (:func:`~bitmosaic.io.saved.save.save_quantized`, and export's checkpoints) hands
  the whole state dict to :func:`write_safetensors`: one ``model.safetensors``, or shards of at most
  :data:`SHARD_BYTES` plus the index;
- a streamed run (:mod:`bitmosaic.pipeline.stream`) writes one shard per decoder layer as it finishes
  (:func:`write_shard` under :func:`shard_name`), then the index of the shards it wrote
  (:func:`shards_index`, :func:`write_index`).

:func:`write_shard` writes ``<file>.tmp`` and renames it into place: any exception, ``KeyboardInterrupt``
and ``SystemExit`` included, leaves no partial file under either name.  Its safetensors metadata table is
in sorted key order (safetensors writes it in hash order), so the same tensors give the same bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .load import FORMAT_VERSION

__all__ = [
    "INDEX",
    "SAVE_META",
    "SHARD_BYTES",
    "SINGLE",
    "shard_name",
    "shards_index",
    "tensors_for_save",
    "write_index",
    "write_safetensors",
    "write_shard",
]

SHARD_BYTES = 2 * 1024**3  # the largest shard of an in-memory save
SAVE_META = {"format": "pt", "bitmosaic_format_version": str(FORMAT_VERSION)}
SINGLE = "model.safetensors"  # the one file of an unsharded save
INDEX = "model.safetensors.index.json"
TMP_SUFFIX = ".tmp"  # a shard being written: ``<name>.tmp`` (a killed run's is removed by the next)


def shard_name(i: int, n: int) -> str:
    """The file name of shard ``i`` (from 0) of ``n``: ``model-0000{i+1}-of-0000{n}.safetensors``."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def tensors_for_save(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` as safetensors can write it: detached, contiguous, on the CPU, one copy per shared tensor."""
    out = {}
    seen_ptrs = {}
    for k, v in sd.items():
        ptr = (v.data_ptr(), v.numel(), v.dtype) if v.numel() else None
        if ptr is not None and ptr in seen_ptrs:  # shared tensor: keep one copy
            v = v.clone()
        seen_ptrs.setdefault(ptr, k)
        out[k] = v.detach().contiguous().cpu()
    return out


def _sort_safetensors_metadata(file: Path) -> None:
    """safetensors writes its ``__metadata__`` table in hash order, which changes from run to run; put
    it in sorted key order in place (same length, every other byte untouched), so that saving the same
    model twice gives the same file, bit for bit."""
    with open(file, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = f.read(n)
        meta = json.loads(header).get("__metadata__")
        if not meta:
            return
        old = b'"__metadata__":' + json.dumps(meta, separators=(",", ":")).encode()
        new = b'"__metadata__":' + json.dumps(dict(sorted(meta.items())), separators=(",", ":")).encode()
        at = header.find(old)
        if at >= 0 and old != new:
            f.seek(8 + at)
            f.write(new)


def write_shard(file: str | os.PathLike, sd: dict[str, torch.Tensor], meta: dict | None = None) -> None:
    """One safetensors file ``file`` holding ``sd`` (tensors as :func:`tensors_for_save` gives them),
    its metadata table (``meta``, default :data:`SAVE_META`) in sorted order; written as ``file.tmp`` and
    renamed into place, so that no exception leaves a partial file (module doc)."""
    file = Path(file)
    tmp = file.with_name(file.name + TMP_SUFFIX)
    try:
        save_file(sd, str(tmp), metadata=meta or SAVE_META)
        _sort_safetensors_metadata(tmp)
        os.replace(tmp, file)
    except BaseException:  # SIGINT, SIGTERM, a full disk: no half-written shard left
        tmp.unlink(missing_ok=True)
        raise


def write_index(folder: str | os.PathLike, weight_map: dict[str, str], total_size: int) -> None:
    """``folder/model.safetensors.index.json``: ``total_size`` (bytes of tensor data) and ``weight_map``
    (tensor name -> shard file name, in the order given), as ``save_pretrained`` writes it."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (Path(folder) / INDEX).write_text(json.dumps(index, indent=2))


def write_safetensors(
    folder: str | os.PathLike, sd: dict[str, torch.Tensor], meta: dict[str, str], max_bytes: int | None = None
) -> None:
    """``sd`` as ``model.safetensors``, or as shards of at most ``max_bytes`` (default
    :data:`SHARD_BYTES`) plus the index (its weight map in ``sd``'s order)."""
    folder = Path(folder)
    max_bytes = max_bytes or SHARD_BYTES
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in sd.items():
        nbytes = v.numel() * v.element_size()
        if size and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    if len(shards) == 1:
        write_shard(folder / SINGLE, shards[0], meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = shard_name(i, len(shards))
        write_shard(folder / name, shard, meta)
        weight_map.update({k: name for k in shard})
    write_index(folder, weight_map, sum(v.numel() * v.element_size() for v in sd.values()))


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}  # fmt: skip


def shards_index(folder: str | os.PathLike, names: list[str]) -> tuple[dict[str, str], int]:
    """``(weight_map, total_size)`` of the shard files ``names`` already written in ``folder``, read from
    their headers (no tensor data): every tensor's shard, sorted by tensor name, and the bytes of all."""
    weight_map, total = {}, 0
    for name in names:
        with safe_open(str(Path(folder) / name), "pt") as f:
            for k in f.keys():
                weight_map[k] = name
                sl = f.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * _ITEMSIZE.get(sl.get_dtype(), 1)
    return dict(sorted(weight_map.items())), total
