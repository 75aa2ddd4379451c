"""Save quantized models: safetensors shards (:mod:`bitmosaic.io.saved.shards`) + ``config.json`` with a
versioned ``quantization_config``.

``quantization_config`` = ``{"quant_method": "bitmosaic", "format_version": 1, "method": ...,
"bits": ..., "group_size": ..., "symmetric": ..., "order": ..., "config": {method options},
"modules": {qualified name: per-layer settings (bits, group, storage width, g_idx, ...)}}``.
``modules`` is the per-layer override table: every quantized linear is listed with its own
settings, so mixed-precision models load the same way.

Writing goes to a temporary sibling directory that is renamed into place only when complete, so
an interrupted save never leaves a partial model under the requested name; the folder ends with
``SHA256SUMS``, the hash of every file written (:mod:`bitmosaic.io.saved.integrity`).  An existing folder is
replaced only when bitmosaic wrote it (its ``config.json`` says ``quant_method: "bitmosaic"``), holds
nothing else, *and* the caller passed ``overwrite=True``; any other non-empty folder, or a file, is never
touched (:func:`~bitmosaic.io.saved.outdir.check_output_dir`).  One save at a time per folder
(:func:`~bitmosaic.io.saved.outdir.output_lock`).

Loading (and every check of what it reads) is :mod:`bitmosaic.io.saved.load`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from ...errors import OutputWriteError
from ...modules.qmodules import full_layer_config
from .finish import quant_modules_by_kind
from .integrity import write_sums
from .load import FORMAT_VERSION
from .outdir import check_output_dir, make_temporary, output_lock, replace_dir
from .shards import SAVE_META, tensors_for_save, write_safetensors

__all__ = ["save_quantized", "quantized_modules", "state_dict_for_save", "saved_config", "finish_folder"]


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every bitmosaic layer of ``model`` by qualified name (a module with ``layer_config`` and ``kind``)."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "layer_config") and hasattr(m, "kind")}


def state_dict_for_save(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a save writes: ``model``'s state dict without a tied ``lm_head.weight``, as
    :func:`~bitmosaic.io.saved.shards.tensors_for_save` gives them."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    sd = model.state_dict()
    return tensors_for_save({k: v for k, v in sd.items() if not (tied and k == "lm_head.weight")})


def saved_config(model: nn.Module, quant_info: dict, modules: dict[str, dict]) -> dict:
    """The ``config.json`` of a quantized model: the model's config with its ``quantization_config``
    (``quant_info``, what each module kind records of itself, and ``modules``: per-layer settings)."""
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    qc = {"quant_method": "bitmosaic", "format_version": FORMAT_VERSION, **quant_info}
    rotation = getattr(model, "bitmosaic_rotation", None)
    if rotation:  # the online rotations every load path re-attaches (io/saved/finish.py)
        qc["rotation"] = rotation
    for kind, mods in quant_modules_by_kind(model).items():  # what each kind records of itself
        qc.update(kind.saved_summary(model, mods, qc))
    qc["modules"] = modules
    cfg["quantization_config"] = qc
    return cfg


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
                write_safetensors(tmp, state_dict_for_save(model), SAVE_META)
                finish_folder(tmp)
            except (OSError, SafetensorError) as e:  # a full disk, a lost mount: one line, nothing left
                raise _write_error(out_dir, e) from None
            check_output_dir(out_dir, overwrite)  # again: the folder may have changed while we wrote
            replace_dir(tmp, out_dir)
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
