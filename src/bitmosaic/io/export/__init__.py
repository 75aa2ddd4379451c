"""Export a bitmosaic result to the checkpoint formats serving stacks load: GPTQ
(:mod:`~bitmosaic.io.export.gptq`) and compressed-tensors
(:mod:`~bitmosaic.io.export.compressed_tensors`).

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

FORMATS = ("gptq", "compressed-tensors")


def export_model(
    src: str | os.PathLike,
    out: str | os.PathLike,
    fmt: str,
    *,
    lossy: bool = False,
    gptq_v2: bool = False,
    overwrite: bool = False,
) -> ExportResult:
    """Export the bitmosaic folder ``src`` to ``out`` in ``fmt`` (``"gptq"`` or ``"compressed-tensors"``).

    Raises :class:`ExportError` (one line: the layers and why) when a layer has no exact form and
    ``lossy`` is false, or when ``out`` may not be written (see :func:`~.common.check_export_dir`).
    """
    from .common import check_export_dir

    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if gptq_v2 and fmt != "gptq":
        raise ExportError("--gptq-v2 applies to --format gptq only")
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
