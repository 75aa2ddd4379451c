"""Export a bitmosaic result to the checkpoint formats serving stacks load: GPTQ
(:mod:`~bitmosaic.io.export.gptq`), compressed-tensors
(:mod:`~bitmosaic.io.export.compressed_tensors`) and GGUF for llama.cpp (:mod:`~bitmosaic.io.export.gguf`).

:func:`export_model` writes the layers a format can hold bit-identically; a layer it cannot hold is
refused with the reason the module kind gives (``QuantModule.int_form``: entropy-coded integers,
FP8-domain scales, sparse residuals, no-clip integers, act-order in compressed-tensors, ...), unless
``lossy`` asks for the nearest representable form -- then the result lists, per layer, what changed
and the weight error it adds.
"""

from __future__ import annotations

import os
from pathlib import Path

from .common import MARKER, ExportResult, LayerRecord, Source, write
from .ct_compat import fix_compressed_tensors_loading
from .layers import ExportError

__all__ = [
    "FORMATS", "MARKER", "ExportError", "ExportResult", "LayerRecord", "export_model",
    "fix_compressed_tensors_loading",
]  # fmt: skip

FORMATS = ("gptq", "compressed-tensors", "gguf")


def export_model(
    src: str | os.PathLike,
    out: str | os.PathLike,
    fmt: str,
    *,
    lossy: bool = False,
    gptq_v2: bool | None = None,
    overwrite: bool = False,
    gguf_type: str | None = None,
    source_gguf: str | os.PathLike | None = None,
) -> ExportResult:
    """Export the bitmosaic folder ``src`` to ``out`` in ``fmt`` (``"gptq"``, ``"compressed-tensors"`` or
    ``"gguf"``: one file, :func:`~.gguf.export_gguf`, which also takes a float model argument).

    ``gptq_v2``: GPTQ's ``checkpoint_format`` -- ``True`` gptq_v2, ``False`` gptq (v1), ``None`` (default)
    v2 when any layer is asymmetric, else v1 (:mod:`~.gptq`).

    Raises :class:`ExportError` (one line: the layers and why) when a layer has no exact form and
    ``lossy`` is false, or when ``out`` may not be written (see :func:`~.common.check_export_dir`).
    """
    from .common import check_export_dir

    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if gptq_v2 is not None and fmt != "gptq":
        raise ExportError("--gptq-format applies to --format gptq only")
    if (gguf_type is not None or source_gguf is not None) and fmt != "gguf":
        raise ExportError("--gguf-type and --source-gguf apply to --format gguf only")
    if fmt == "gguf":
        from .gguf import export_gguf

        if _is_saved(src):  # a float model (gguf exports those too) has no rotation to refuse
            _refuse_rotation(src, fmt)
        return export_gguf(
            src, out, gguf_type=gguf_type, lossy=lossy, overwrite=overwrite, source_gguf=source_gguf
        )
    _refuse_rotation(src, fmt)
    source = Source.read(src)
    check_export_dir(out, overwrite, source.path)  # fail before converting
    if fmt == "gptq":
        from .gptq import build_gptq

        tensors, qconfig, records, notes = build_gptq(source, lossy, gptq_v2)
    else:
        from .compressed_tensors import build_compressed_tensors

        tensors, qconfig, records, notes = build_compressed_tensors(source, lossy)
    result = ExportResult(Path(out).expanduser().resolve(), fmt, records, notes)
    write(source, result.out, overwrite, tensors, qconfig, result)
    return result


def _is_saved(src) -> bool:
    """``src`` is a saved bitmosaic folder (not a float model spec)."""
    import json
    from pathlib import Path

    cfg = Path(str(src)) / "config.json"
    try:
        return cfg.is_file() and "quantization_config" in json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False


def _refuse_rotation(src, fmt: str) -> None:
    """A rotated model (``--rotate``) needs its online rotations at run time, which neither format holds."""
    from ..saved.load import read_quant_config

    rotation = read_quant_config(src)[1].get("rotation")
    if rotation:
        online = list(rotation.get("online") or {})
        eg = f" (e.g. {online[0].rsplit('.', 1)[-1]})" if online else ""
        raise ExportError(
            f"cannot export as {fmt}: the model was quantized with --rotate {rotation.get('kind')}, whose "
            "online "
            f"rotation at the input of {len(online)} layer(s){eg} a {fmt} checkpoint cannot express (its "
            "loaders would compute another function); load the bitmosaic folder itself (bitmosaic.load or "
            "from_pretrained), or quantize with --rotate none to export"
        )
