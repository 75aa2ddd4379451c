"""Checks of a float model folder before its weights are read (``load_model`` and streamed runs).

transformers reports these after a long load, or over many lines, or not at all: a ``model_type`` it
does not know (a paragraph), a shard that the safetensors index names but that is missing (a bare
``No such file``), a tensor whose shape disagrees with ``config.json`` (a load report and a
traceback).  :func:`check_float_folder` turns each into one line naming the file, from the config and
the safetensors headers only (no tensor is read; the model is built on the meta device).
"""

from __future__ import annotations

import json
from pathlib import Path

from ...errors import CorruptModelError, ModelSpecError

__all__ = ["check_float_folder"]

_FIX = "re-download the model, or fix its config.json"


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(folder.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names: dict[str, list[str]] = {}
        for k, v in weight_map.items():
            names.setdefault(str(v), []).append(k)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptModelError(f"{index} is not a valid safetensors index ({e}); re-download it") from None
    for name, keys in sorted(names.items()):
        if Path(name).name != name:
            raise CorruptModelError(f"{index} names a file outside the folder ({name!r}); re-download it")
        if not (folder / name).is_file():
            raise CorruptModelError(
                f"{folder / name} is missing: {index.name} puts {len(keys)} tensor(s) in it (e.g. "
                f"{keys[0]}); re-download the model"
            )
    return [folder / n for n in sorted(names)]


def _check_model_type(folder: Path) -> None:
    import transformers
    from transformers import CONFIG_MAPPING

    cfg = folder / "config.json"
    try:
        raw = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # resolve_model_spec and the loader report these
    mt = raw.get("model_type") if isinstance(raw, dict) else None
    if not isinstance(mt, str) or mt not in CONFIG_MAPPING:
        raise ModelSpecError(
            f"{cfg}: model_type {mt!r} is not an architecture transformers {transformers.__version__} knows "
            "(bitmosaic never runs a model's own code); check the config's model_type, or upgrade "
            "transformers if the model is newer"
        )


def check_float_folder(folder: str | Path) -> None:
    """One line for a float folder whose config or weights cannot make the model (module doc)."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    _check_model_type(folder)
    files = _weight_files(folder)
    if not files:
        return
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    from .model_class import auto_model_class

    try:
        config = AutoConfig.from_pretrained(folder)
        with init_empty_weights(include_buffers=True):
            model = auto_model_class(config).from_config(config)
    except Exception as e:  # transformers raises many kinds on configs it cannot build
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise ModelSpecError(
            f"{folder}/config.json does not describe a causal language model transformers can build "
            f"({reason}); {_FIX}"
        ) from None
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    del model
    for file in files:
        try:
            with safe_open(str(file), "pt") as st:
                shapes = {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}
        except (SafetensorError, OSError, ValueError):
            return  # a truncated or random file: the loader's own line names it
        for k, shape in shapes.items():
            want = expected.get(k)
            if want is not None and want != shape:
                raise CorruptModelError(
                    f"{file}: tensor {k} has shape {list(shape)} but {folder}/config.json makes it "
                    f"{list(want)}; the weights and the config disagree: {_FIX}"
                )
