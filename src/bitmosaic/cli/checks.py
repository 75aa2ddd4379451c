"""Checks a command runs on its arguments before any work: the input model is not a quantized
folder.  Each failure is one line (a
:class:`~bitmosaic.errors.BitmosaicError`, exit status 2), not a usage text or a traceback hours later."""

from __future__ import annotations

from ..errors import OptionError

__all__ = ["check_float_model"]

def check_float_model(spec: str) -> None:
    """``quantize --model`` must be a float model: a saved bitmosaic folder is refused, naming the float
    model it records (its provenance) when it does."""
    import json
    from pathlib import Path

    from ..io.loading import resolve_model_spec

    kind, info = resolve_model_spec(spec)
    if kind != "bitmosaic":
        return
    try:
        raw = json.loads((Path(info["path"]) / "config.json").read_text(encoding="utf-8"))
        qc = raw["quantization_config"]
        source = (qc.get("provenance") or {}).get("model")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        source = None
    made_from = f" (it was made from {source})" if isinstance(source, str) and source else ""
    raise OptionError(
        f"--model {spec} is a bitmosaic model folder, already quantized{made_from}; give the float model to "
        "quantize (bitmosaic eval/inspect/export take the quantized folder)"
    )
