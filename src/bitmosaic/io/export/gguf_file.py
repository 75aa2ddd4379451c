"""Writing an export's GGUF file (:mod:`.gguf`): the ``--out`` checks, the tensors in the source file's
order (rows back in the file's order), the source's metadata copied, and the write through a marked
temporary renamed into place under the output lock."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from ..._version import __version__
from ..saved.outdir import make_temporary, output_lock
from .layers import ExportError

__all__ = ["check_gguf_out", "source_metadata", "tensors_in_file_order", "write_gguf"]

_SKIP_KV = ("GGUF.", "general.architecture", "general.file_type", "general.quantization_version",
            "general.alignment", "general.quantized_by", "bitmosaic.")  # fmt: skip


def check_gguf_out(out, overwrite: bool) -> Path:
    """``out`` resolved, if a GGUF export may write there: a new path, or (with ``overwrite``) a file an
    earlier bitmosaic export wrote; a folder or anyone else's file raises :class:`ExportError`."""
    out = Path(out).expanduser().resolve()
    if out.is_dir():
        raise ExportError(f"--out {out} is a folder; GGUF export writes one file (e.g. --out model.gguf)")
    if out.exists():
        if not _written_by_us(out):
            raise ExportError(
                f"{out} exists and was not written by bitmosaic export; it is never replaced: "
                "choose another --out"
            )
        if not overwrite:
            raise ExportError(f"{out} holds an earlier export; pass --overwrite to replace it")
    return out


def _written_by_us(path: Path) -> bool:
    from gguf import GGUFReader

    from ..sources.gguf_checkpoint import check_layout

    try:
        check_layout(path)  # a damaged file at --out: gguf-py alone could read it without end
        f = GGUFReader(os.fspath(path)).fields.get("general.quantized_by")
        return f is not None and f.contents().startswith("bitmosaic")
    except Exception:  # not a GGUF file at all
        return False


def tensors_in_file_order(
    ckpt, orders: dict, tensors: dict, files: dict
) -> list[tuple[str, np.ndarray, str]]:
    """``(GGUF name, data, type)`` in the source file's order, rows back in the file's order; source
    tensors the model has no parameter for (e.g. ``rope_freqs``) copied as they are."""
    import gguf

    to_model = {g: n for n, g in ckpt.names.items()}
    name_map = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == ckpt.arch),
        int(ckpt.config().num_hidden_layers),
    )
    rows, seen = [], set()
    for g in files:
        n = to_model.get(g)
        if n is None:
            rows.append((g, _raw(ckpt, g), files[g][0].name))
        elif n in tensors:
            rows.append((g, *_file_rows(orders[n], *tensors[n])))
            seen.add(n)
        else:
            raise ExportError(
                f"cannot export as gguf: the model has no tensor {n} that {ckpt.path.name} has ({g})"
            )
    for n in tensors:
        if n not in seen:  # e.g. a quantized head the (tied) source file does not store
            base, suffix = n.rsplit(".", 1)
            g = name_map.get_name(base)
            if g is None:
                raise ExportError(f"cannot export as gguf: tensor {n} has no GGUF name for {ckpt.arch!r}")
            rows.append((f"{g}.{suffix}", *tensors[n]))
    return rows


def _file_rows(p: np.ndarray | None, data: np.ndarray, typ: str) -> tuple[np.ndarray, str]:
    if p is None:
        return data, typ
    stored = np.empty_like(data)
    stored[p] = data  # the model's row i is the file's row p[i]
    return stored, typ


def _raw(ckpt, gname: str) -> np.ndarray:
    from gguf import GGUFReader

    t = next(t for t in GGUFReader(os.fspath(ckpt.path)).tensors if t.name == gname)
    return np.array(t.data)


def source_metadata(gpath: Path) -> list[tuple]:
    """The metadata of the source GGUF file ``gpath`` as ``(key, value, type, sub type)``, less what the
    export sets itself (``file_type``, who quantized it, the report)."""
    import gguf

    out = []
    for key, f in gguf.GGUFReader(os.fspath(gpath)).fields.items():
        if key.startswith(_SKIP_KV):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        out.append((key, f.contents(), f.types[0], sub))
    return out


def write_gguf(out: Path, overwrite: bool, kv: list[tuple], arch: str, rows, file_type, report: dict) -> None:
    """Write ``rows`` (``(GGUF name, data, type)``: :func:`tensors_in_file_order`) to the GGUF file
    ``out`` with the metadata ``kv`` (``(key, value, type, sub type)``, :func:`source_metadata`; a type
    ``None`` for a string) and the export's own (``file_type``, who quantized it, the ``report``),
    through a marked temporary renamed into place under the output lock."""
    with output_lock(out):  # one export per --out; stale temporaries of a killed one are cleaned
        tmpdir = make_temporary(out)  # marked: what a kill -9 leaves, the next run removes
        try:
            _write_file(tmpdir / out.name, out, overwrite, kv, arch, rows, file_type, report)
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _write_file(tmp: Path, out: Path, overwrite: bool, kv, arch: str, rows, file_type, report) -> None:
    import gguf

    try:
        w = gguf.GGUFWriter(tmp, arch)
        for key, value, typ, sub in kv:
            if typ is None:
                w.add_string(key, value)
            else:
                w.add_key_value(key, value, typ, sub_type=sub)
        w.add_file_type(int(file_type))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_quantized_by(f"bitmosaic {__version__}")
        w.add_string("bitmosaic.export", json.dumps(report))
        for g, data, typ in rows:
            q = gguf.GGMLQuantizationType[typ]
            if typ in ("F32", "F16"):
                w.add_tensor(g, np.ascontiguousarray(data))
            else:
                w.add_tensor(g, np.ascontiguousarray(data), raw_dtype=q)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        check_gguf_out(out, overwrite)  # again: the path may have changed meanwhile
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
