"""Read a saved bitmosaic folder, checking everything it reads: ``config.json`` and its
``quantization_config`` (:func:`read_quant_config`), the safetensors files and their headers
(:func:`stored_tensors`), every tensor's name, shape and kind of dtype against the model
(:func:`check_saved_tensors`), then the tensors themselves (:func:`load_quantized`).

Unreadable JSON, truncated or garbage safetensors, missing shards and tensors that do not match the model
raise :class:`~bitmosaic.errors.CorruptModelError` (one line, naming the file or tensor); NaN/Inf in a
float tensor raises :class:`~bitmosaic.errors.NonFiniteError`.  The writing side is
:mod:`bitmosaic.io.saved.save`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from ...errors import BitmosaicError, CorruptModelError, check_finite
from ...formats.accounting import dtype_name_bits
from ...modules.experts import unfuse_experts
from ...modules.qmodules import module_from_layer_config
from ..sources.checkpoint import is_file_name
from ..sources.model_class import auto_model_class
from .finish import finish_load, model_arch

__all__ = [
    "FORMAT_VERSION",
    "load_quantized",
    "read_quant_config",
    "check_quant_config",
    "check_saved_tensors",
    "stored_tensors",
    "stored_tensors_of_file",
    "verify_saved",
    "install_quantized_modules",
    "stored_module_bits",
    "read_state_dict",
]

FORMAT_VERSION = 1

_RESAVE = "the saved model is damaged: save or download it again"


def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorruptModelError(f"{path} is missing; {_RESAVE}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptModelError(f"{path} is not valid JSON ({e}); {_RESAVE}") from None
    if not isinstance(raw, dict):
        raise CorruptModelError(f"{path} does not hold a JSON object; {_RESAVE}")
    return raw


def read_quant_config(path: str | os.PathLike) -> tuple[dict, dict]:
    """``(config.json as a dict, its quantization_config)`` of a bitmosaic folder, checked.

    Raises :class:`CorruptModelError` when the folder has no readable config.json, when it is not a
    bitmosaic folder, or when its ``modules`` table is missing or malformed; :class:`BitmosaicError` (a
    ``ValueError``) when it needs a newer bitmosaic.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CorruptModelError(f"{path} has no config.json: not a saved model folder")
    raw = _read_json(path / "config.json")
    qc = raw.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "bitmosaic":
        raise CorruptModelError(
            f"{path} is not a bitmosaic model (quantization_config.quant_method missing); "
            "load a float model with load_model"
        )
    check_quant_config(qc, path)
    return raw, qc


def check_quant_config(qc: dict, path) -> None:
    """Check a bitmosaic ``quantization_config`` (``path`` names its folder in errors): a readable
    ``format_version`` this bitmosaic knows and a ``modules`` table of per-layer dicts."""
    try:
        version = int(qc.get("format_version", 0))
    except (TypeError, ValueError):
        raise CorruptModelError(
            f"{path}/config.json: bad format_version {qc.get('format_version')!r}"
        ) from None
    if version > FORMAT_VERSION:
        raise BitmosaicError(
            f"{path} uses bitmosaic format v{version}, newer than this version (v{FORMAT_VERSION}); "
            "upgrade bitmosaic"
        )
    mods = qc.get("modules")
    if not isinstance(mods, dict) or not all(isinstance(v, dict) for v in mods.values()):
        raise CorruptModelError(
            f"{path}/config.json: quantization_config.modules is missing or not a table of layers; {_RESAVE}"
        )


def _st_error(file: Path, e: BaseException) -> CorruptModelError:
    reason = " ".join(str(e).split()) or type(e).__name__
    return CorruptModelError(
        f"weights file {file} is truncated or not a safetensors file ({reason}); {_RESAVE}"
    )


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise CorruptModelError(f"weights file {file} is missing; {_RESAVE}")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise _st_error(file, e) from None


def _weight_files(path: Path) -> tuple[list[Path], dict | None]:
    """The safetensors files of a saved folder (``model.safetensors``, or the shards its index names)
    and the index's ``weight_map`` (``None`` for one file); a missing file or a bad index raises
    :class:`CorruptModelError`."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.exists() or not index.exists():
        if not single.exists():
            raise CorruptModelError(
                f"{path} has neither model.safetensors nor model.safetensors.index.json; {_RESAVE}"
            )
        return [single], None
    weight_map = _read_json(index).get("weight_map")
    names = list(weight_map.values()) if isinstance(weight_map, dict) else [None]
    if not names or not all(map(is_file_name, names)):
        raise CorruptModelError(f"{index}: weight_map is missing or names files outside the folder")
    files = [path / n for n in sorted(set(names))]
    for f in files:
        if not f.is_file():
            raise CorruptModelError(f"weights file {f} is missing; {_RESAVE}")
    return files, weight_map


def _check_placement(file: Path, keys, weight_map: dict | None) -> None:
    if weight_map is None:
        return
    stray = sorted(k for k in keys if weight_map.get(k) != file.name)
    if stray:
        raise CorruptModelError(f"{file} holds tensors the index does not put there: {stray[:3]}")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the saved folder ``path`` (one file or the shards its index names), each shard's
    tensors checked against the index; damaged or missing files raise
    :class:`~bitmosaic.errors.CorruptModelError`."""
    files, weight_map = _weight_files(path)
    sd: dict[str, torch.Tensor] = {}
    for file in files:
        shard = _load_safetensors(file)
        _check_placement(file, shard, weight_map)
        sd.update(shard)
    return sd


def stored_tensors(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Name -> (shape, dtype) of every tensor a saved folder stores, read from the safetensors headers
    only (``dtype`` ``None``: a type torch does not have).  Damaged or missing files raise
    :class:`CorruptModelError`, with the messages :func:`load_quantized` gives."""
    path = Path(path)
    files, weight_map = _weight_files(path)
    out: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
    for file in files:
        one = stored_tensors_of_file(file)
        _check_placement(file, one, weight_map)
        out.update(one)
    return out


def stored_tensors_of_file(file: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """:func:`stored_tensors` of one safetensors file (its header only)."""
    from safetensors import safe_open
    from safetensors.torch import _TYPES

    file = Path(file)
    if not file.is_file():
        raise CorruptModelError(f"weights file {file} is missing; {_RESAVE}")
    out = {}
    try:
        with safe_open(str(file), "pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                out[k] = (tuple(int(d) for d in sl.get_shape()), _TYPES.get(sl.get_dtype()))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise _st_error(file, e) from None
    return out


def check_saved_tensors(
    path, model: nn.Module, stored: dict[str, tuple[tuple[int, ...], torch.dtype | None]], tied: bool
) -> None:
    """Every tensor ``model`` (its quantized modules installed; may be on the meta device) needs is in
    ``stored`` (:func:`stored_tensors`), with its shape and kind of dtype, and nothing else is: else a
    one-line :class:`CorruptModelError`.  Every loader (``load_quantized``, ``bitmosaic.load``,
    ``AutoModelForCausalLM.from_pretrained``) and ``inspect`` run it, so they refuse alike."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in stored and not (tied and k == "lm_head.weight")]
    unexpected = [k for k in stored if k not in expected]
    mods = dict(model.named_modules())
    unlisted = sorted(
        {
            k.rpartition(".")[0]
            for k in unexpected
            if isinstance(mods.get(k.rpartition(".")[0]), nn.Linear)
            and f"{k.rpartition('.')[0]}.weight" in missing
        }
    )
    if unlisted:
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        raise CorruptModelError(
            f"{path}: layer {unlisted[0]}{more} has quantized tensors in the weights but no entry in "
            f"config.json's quantization_config.modules; {_RESAVE}"
        )
    bad = []
    for k, (shape, dtype) in stored.items():
        e = expected.get(k)
        if e is None:
            continue
        if tuple(shape) != tuple(e.shape):
            bad.append(f"{k} has shape {list(shape)}, expected {list(e.shape)}")
        elif dtype != e.dtype and not (
            dtype is not None and dtype.is_floating_point and e.is_floating_point()
        ):
            bad.append(f"{k} has dtype {dtype}, expected {e.dtype}")
    if missing or unexpected or bad:
        parts = [
            f"missing {missing[:3]}" if missing else "",
            f"unexpected {unexpected[:3]}" if unexpected else "",
        ]
        what = "; ".join(p for p in parts + bad[:3] if p)
        raise CorruptModelError(f"{path}: the saved tensors do not match the model ({what}); {_RESAVE}")


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
)


def _load_tokenizer(path: Path):
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # tokenizers raise many kinds of errors on damaged files
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise CorruptModelError(
            f"the tokenizer files in {path} are unreadable ({reason}); {_RESAVE}"
        ) from None


def install_quantized_modules(model: nn.Module, modules: dict, path) -> None:
    """Put an empty quantized module of the saved kind at every name of ``modules`` (the per-layer
    table of a ``quantization_config``); a bad entry raises :class:`CorruptModelError`."""
    for name, lc in modules.items():
        try:
            model.set_submodule(name, module_from_layer_config(lc))
        except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError, RuntimeError) as e:
            # e.g. width 0, or sizes whose storage overflows
            reason = " ".join(str(e).split())[:200]
            raise CorruptModelError(
                f"{path}/config.json: quantized layer {name!r} has a bad entry "
                f"({type(e).__name__}: {reason}); {_RESAVE}"
            ) from None


def _skeleton(path: Path, qc: dict, meta: bool = False) -> tuple[nn.Module, bool]:
    """The model of a saved folder with empty quantized modules installed, and whether its head is
    tied; ``meta``: the quantized modules on the meta device too (nothing allocated)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises ValueError, KeyError, OSError, ... on bad configs
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise CorruptModelError(f"{path}/config.json is not a usable model config ({reason})") from None
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    try:
        with init_empty_weights(include_buffers=meta):
            model = auto_model_class(config).from_config(config)  # a multimodal model: its own class
    except Exception as e:  # noqa: BLE001 - a config transformers reads but cannot build (negative sizes, ...)
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise CorruptModelError(
            f"{path}/config.json describes no model transformers can build ({type(e).__name__}: {reason})"
        ) from None
    unfuse_experts(model)  # a mixture of experts is saved one linear per expert projection
    if meta:
        with torch.device("meta"):
            install_quantized_modules(model, qc["modules"], path)
    else:
        install_quantized_modules(model, qc["modules"], path)
    return model, bool(getattr(config, "tie_word_embeddings", False))


def verify_saved(path: str | os.PathLike) -> tuple[dict, dict]:
    """Check a saved folder without reading its tensors: ``config.json``, every per-layer entry, the
    weight files and every tensor's name, shape and kind of dtype (what the loaders check, in the same
    order, with the same one-line :class:`CorruptModelError`).  Returns ``read_quant_config``'s pair."""
    path = Path(path)
    raw, qc = read_quant_config(path)
    stored = stored_tensors(path)
    model, tied = _skeleton(path, qc, meta=True)
    check_saved_tensors(path, model, stored, tied)
    return raw, qc


def load_quantized(path: str | os.PathLike, load_tokenizer: bool = True, dtype: torch.dtype | None = None):
    """Load a bitmosaic model folder -> ``(transformers model, tokenizer or None)``.

    The tokenizer is ``None`` when ``load_tokenizer`` is false or none was saved.  ``dtype`` casts the
    parameters that are not quantized (embeddings, norms, an untied head); quantized modules keep their
    stored formats and compute in their input's dtype.  Damaged folders raise
    :class:`~bitmosaic.errors.CorruptModelError`, NaN/Inf in a stored float tensor
    :class:`~bitmosaic.errors.NonFiniteError`.
    """
    path = Path(path)
    _, qc = read_quant_config(path)
    stored = stored_tensors(path)  # the files first, as bitmosaic.load does
    model, tied = _skeleton(path, qc)
    check_saved_tensors(path, model, stored, tied)
    sd = read_state_dict(path)
    for k, v in sd.items():
        check_finite(v, f"tensor {k} of the saved model {path}")
    model.load_state_dict(sd, strict=False, assign=True)
    if tied:
        model.tie_weights()
    finish_load(model, qc, model_arch(model), dtype)  # the same end as the transformers loader's
    tok = _load_tokenizer(path) if load_tokenizer else None
    return model, tok


def stored_module_bits(path: str | os.PathLike, names) -> dict[str, int]:
    """Bits each named quantized module really stores (all its tensors but the bias), read from the
    safetensors headers only.  Damaged files raise :class:`CorruptModelError`."""
    from safetensors import safe_open

    bits = dict.fromkeys(names, 0)
    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as st:
                for key in st.keys():
                    mod, _, leaf = key.rpartition(".")
                    if mod in bits and leaf != "bias":
                        sl = st.get_slice(key)
                        n = 1
                        for d in sl.get_shape():
                            n *= d
                        bits[mod] += n * dtype_name_bits(sl.get_dtype())
        except (SafetensorError, OSError) as e:
            reason = " ".join(str(e).split()) or type(e).__name__
            raise CorruptModelError(
                f"weights file {f} is truncated or not a safetensors file ({reason}); {_RESAVE}"
            ) from None
    return bits
