"""Save and load quantized models: safetensors shards + ``config.json`` with a versioned
``quantization_config``.

``quantization_config`` = ``{"quant_method": "bitmosaic", "format_version": 1, "method": ...,
"bits": ..., "group_size": ..., "symmetric": ..., "order": ..., "config": {method options},
"modules": {qualified name: per-layer settings (bits, group, storage width, g_idx, ...)}}``.
``modules`` is the per-layer override table: every quantized linear is listed with its own
settings, so mixed-precision models load the same way.

Writing goes to a temporary sibling directory that is renamed into place only when complete, so
an interrupted save never leaves a partial model under the requested name; the folder ends with
``SHA256SUMS``, the hash of every file written (:mod:`bitmosaic.io.integrity`).  An existing folder is
replaced only when bitmosaic wrote it (its ``config.json`` says ``quant_method: "bitmosaic"``), holds
nothing else, *and* the caller passed ``overwrite=True``; any other non-empty folder, or a file, is never
touched (:func:`~bitmosaic.io.outdir.check_output_dir`).  One save at a time per folder
(:func:`~bitmosaic.io.outdir.output_lock`).

Loading checks what it reads: unreadable JSON, truncated or garbage safetensors, missing shards, and
tensors that do not match the model raise :class:`~bitmosaic.errors.CorruptModelError` (one line, naming
the file or tensor); NaN/Inf in a float tensor raises :class:`~bitmosaic.errors.NonFiniteError`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import CorruptModelError, OutputWriteError, check_finite
from ..formats.accounting import dtype_name_bits
from ..modules.qmodules import full_layer_config, module_from_layer_config
from .checkpoint import is_file_name
from .finish import finish_load, model_arch, quant_modules_by_kind
from .integrity import write_sums
from .outdir import (  # noqa: F401  (the names other modules import from here)
    _replace_dir,
    atomic_write_text,
    check_output_dir,
    check_writable,
    make_temporary,
    output_lock,
)

__all__ = [
    "FORMAT_VERSION",
    "save_quantized",
    "load_quantized",
    "quantized_modules",
    "atomic_write_text",
    "check_output_dir",
    "check_writable",
    "read_quant_config",
    "check_quant_config",
    "check_saved_tensors",
    "stored_tensors",
    "stored_tensors_of_file",
    "verify_saved",
    "install_quantized_modules",
    "stored_module_bits",
    "saved_config",
    "tensors_for_save",
    "write_shard",
    "finish_folder",
]

FORMAT_VERSION = 1
SHARD_BYTES = 2 * 1024**3
SAVE_META = {"format": "pt", "bitmosaic_format_version": str(FORMAT_VERSION)}


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if hasattr(m, "layer_config") and hasattr(m, "kind")}


def _state_dict_for_save(model: nn.Module) -> dict[str, torch.Tensor]:
    tied = getattr(model.config, "tie_word_embeddings", False)
    sd = model.state_dict()
    return tensors_for_save({k: v for k, v in sd.items() if not (tied and k == "lm_head.weight")})


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


def write_shard(file: Path, sd: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> None:
    """One safetensors file, its metadata table in sorted order (the same tensors give the same bytes)."""
    save_file(sd, str(file), metadata=meta or SAVE_META)
    _sort_safetensors_metadata(file)


def saved_config(model: nn.Module, quant_info: dict, modules: dict[str, dict]) -> dict:
    """The ``config.json`` of a quantized model: the model's config with its ``quantization_config``
    (``quant_info``, what each module kind records of itself, and ``modules``: per-layer settings)."""
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    qc = {"quant_method": "bitmosaic", "format_version": FORMAT_VERSION, **quant_info}
    rotation = getattr(model, "bitmosaic_rotation", None)
    if rotation:  # the online rotations every load path re-attaches (io/finish.py)
        qc["rotation"] = rotation
    for kind, mods in quant_modules_by_kind(model).items():  # what each kind records of itself
        qc.update(kind.saved_summary(model, mods, qc))
    qc["modules"] = modules
    cfg["quantization_config"] = qc
    return cfg


def write_safetensors(folder: Path, sd: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """``sd`` as ``model.safetensors``, or as shards of at most ``SHARD_BYTES`` plus the index."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in sd.items():
        nbytes = v.numel() * v.element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    if len(shards) == 1:
        write_shard(folder / "model.safetensors", shards[0], meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_shard(folder / name, shard, meta)
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())}}
    index["weight_map"] = weight_map
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def save_quantized(
    model: nn.Module,
    out_dir: str | os.PathLike,
    quant_info: dict | None = None,
    tokenizer=None,
    *,
    overwrite: bool = False,
) -> Path:
    """Save ``model`` (with QuantLinear modules) to ``out_dir`` atomically; returns the path.

    ``quant_info``: the ``quantization_config`` entries to record; ``None``: what the model carries
    from :func:`bitmosaic.quantize_` (``model.bitmosaic_run``: method, settings, recipe, provenance,
    so ``bitmosaic reproduce`` works on the folder).

    ``out_dir`` must be new or empty, or (with ``overwrite=True``) a folder bitmosaic saved before; see
    :func:`check_output_dir`.  Raises :class:`~bitmosaic.errors.OutputExistsError` otherwise.
    """
    qmods = quantized_modules(model)
    if not qmods:
        raise ValueError("model has no quantized layers; run quantization before saving")
    if quant_info is None:
        run = getattr(model, "bitmosaic_run", None)
        if not isinstance(run, dict):
            raise ValueError(
                "the model carries no quantization run (bitmosaic.quantize_ attaches one); pass quant_info"
            )
        from .provenance import saved_run_info

        quant_info = saved_run_info(run)
    out_dir = check_output_dir(out_dir, overwrite)
    with output_lock(out_dir):
        try:
            tmp = make_temporary(out_dir)
        except OSError as e:
            raise _write_error(out_dir, e) from None
        try:
            try:
                cfg = saved_config(model, quant_info, {n: full_layer_config(m) for n, m in qmods.items()})
                _write_config(tmp, cfg)
                gen = getattr(model, "generation_config", None)
                if gen is not None:
                    gen.save_pretrained(tmp)
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp)
                write_safetensors(tmp, _state_dict_for_save(model), SAVE_META)
                finish_folder(tmp)
            except (OSError, SafetensorError) as e:  # a full disk, a lost mount: one line, nothing left
                raise _write_error(out_dir, e) from None
            check_output_dir(out_dir, overwrite)  # again: the folder may have changed while we wrote
            _replace_dir(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir


def finish_folder(folder: Path) -> None:
    """The last step of a save, before the rename: hash every file (``SHA256SUMS``)."""
    write_sums(folder)


def _write_config(folder: Path, cfg: dict) -> None:
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))


def _write_error(out_dir: Path, e: BaseException) -> OutputWriteError:
    reason = getattr(e, "strerror", None) or " ".join(str(e).split()) or type(e).__name__
    return OutputWriteError(
        f"cannot write the model to {out_dir}: {reason}; nothing was saved there (free some space or "
        "choose another --out)"
    )


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
    bitmosaic folder, or when its ``modules`` table is missing or malformed; ``ValueError`` when it needs
    a newer bitmosaic.
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
        raise ValueError(
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


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
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
        except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as e:  # e.g. width 0
            raise CorruptModelError(
                f"{path}/config.json: quantized layer {name!r} has a bad entry ({type(e).__name__}: {e}); "
                f"{_RESAVE}"
            ) from None


def _skeleton(path: Path, qc: dict, meta: bool = False) -> tuple[nn.Module, bool]:
    """The model of a saved folder with empty quantized modules installed, and whether its head is
    tied; ``meta``: the quantized modules on the meta device too (nothing allocated)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises ValueError, KeyError, OSError, ... on bad configs
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise CorruptModelError(f"{path}/config.json is not a usable model config ({reason})") from None
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with init_empty_weights(include_buffers=meta):
        model = AutoModelForCausalLM.from_config(config)
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
    sd = _read_state_dict(path)
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
