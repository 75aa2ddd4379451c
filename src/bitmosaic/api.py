"""One entry point: ``quantize_(model, method_or_recipe, calib, **options)`` (torchao-style).

The run is attached to the model (``model.bitmosaic_run``: report, recipe, provenance), so
:func:`bitmosaic.io.save_quantized` writes what ``bitmosaic reproduce`` needs, whether the model was
quantized from Python or by ``bitmosaic quantize``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from .errors import OptionError
from .pipeline.pipeline import RunReport

__all__ = ["quantize_", "as_recipe", "calibration_tokens"]

_DATASETS = ("wikitext2", "wikitext-2")


def as_recipe(method, options: dict | None = None, scheme: str | None = None, rotate: str | None = None):
    """A :class:`~bitmosaic.pipeline.recipe.Recipe` from a method name (with config ``options``,
    ``scheme`` and ``rotate``), a ``Recipe``, a recipe dict, or the path of a YAML/JSON recipe file."""
    from .pipeline.recipe import Recipe, _jsonable, load_recipe

    options = dict(options or {})
    if isinstance(method, (Recipe, dict)) or (isinstance(method, (str, os.PathLike)) and _is_file(method)):
        if options or scheme is not None or rotate is not None:
            given = sorted(options) + (["scheme"] if scheme is not None else [])
            given += ["rotate"] if rotate is not None else []
            raise OptionError(
                f"a recipe sets the method and its settings, so {given} cannot be "
                "given too; put them in the recipe (its settings, or its 'rotate' key)"
            )
        if isinstance(method, Recipe):
            return method
        return Recipe.from_dict(method) if isinstance(method, dict) else load_recipe(method)
    if not isinstance(method, str):
        raise OptionError(
            f"method must be a method name (`bitmosaic methods`), a Recipe, a recipe dict or a recipe file; "
            f"got {type(method).__name__}"
        )
    from .methods import get_method
    from .methods.options import rename_old_keys

    try:
        spec = get_method(method)
    except ValueError as e:
        raise OptionError(str(e)) from None
    options = rename_old_keys(spec.config_cls, options, f"method {spec.name!r}: ")
    d = {"method": spec.name, "settings": _jsonable(options)}
    if scheme is not None:
        d["scheme"] = scheme
    if rotate is not None:
        d["rotate"] = rotate
    return Recipe.from_dict(d)


def _is_file(p) -> bool:
    try:
        return Path(p).suffix.lower() in (".yaml", ".yml", ".json") and Path(p).is_file()
    except (OSError, ValueError):
        return False


def calibration_tokens(calib, tokenizer=None, *, nsamples: int = 128, seqlen: int = 512, seed: int = 0,
                       data_dir=None) -> tuple[torch.Tensor, str | None]:  # fmt: skip
    """``(LongTensor [nsamples, seqlen], source)`` from token ids, a dataset name (``"wikitext2"``), a
    text file or raw text (the last three need ``tokenizer``); ``source`` is ``None`` for ids and for raw
    text (nothing to draw them from again)."""
    from .data import calibration_samples

    if isinstance(calib, torch.Tensor):
        if calib.dtype.is_floating_point or calib.dtype == torch.bool or calib.dim() != 2:
            raise OptionError(
                f"calib must be a [nsamples, seqlen] integer tensor of token ids, got {calib.dtype} "
                f"{list(calib.shape)}; or pass a dataset name, a text file or text with tokenizer="
            )
        return calib.long(), None
    if not isinstance(calib, (str, os.PathLike)):
        raise OptionError(
            f"calib must be token ids (LongTensor [n, seqlen]), a dataset name ('wikitext2'), a text file "
            f"or text; got {type(calib).__name__}"
        )
    text = os.fspath(calib)
    if tokenizer is None:
        raise OptionError(f"calib {text[:40]!r} is text: pass tokenizer= (the model's) to tokenize it")
    kind = "dataset" if text.lower() in _DATASETS else "file" if _exists(text) else "text"
    if kind == "text" and len(text.split()) < 2:
        raise OptionError(
            f"calib {text!r} is no dataset name ({', '.join(_DATASETS)}), no existing file and not text; "
            "fix the name or the path"
        )
    if kind != "text":
        source = text if kind == "dataset" else str(Path(text).resolve())
        return calibration_samples(tokenizer, source, nsamples, seqlen, seed, data_dir=data_dir), source
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "calib.txt"
        f.write_text(text, encoding="utf-8")
        return calibration_samples(tokenizer, f, nsamples, seqlen, seed), None


def _exists(p: str) -> bool:
    try:
        return len(p) < 4096 and "\n" not in p and Path(p).is_file()
    except (OSError, ValueError):
        return False


def quantize_(
    model: nn.Module,
    method,
    calib,
    *,
    tokenizer=None,
    nsamples: int = 128,
    seqlen: int = 512,
    data_dir=None,
    batch_size: int = 4,
    hessian_dtype: torch.dtype = torch.float32,
    progress: bool = True,
    cache_outputs: bool | None = None,
    analyze_orders: tuple[str, ...] | None = None,
    scheme: str | None = None,
    seed: int = 0,
    device: str | torch.device | None = None,
    offload_inputs: bool | None = None,
    max_memory: int | str | None = None,
    spill_dir=None,
    measure_errors: bool = False,
    calib_cache=None,
    calib_source: str | None = None,
    source_model: str | None = None,
    more_calib=None,
    store=None,
    rotate: str | None = None,
    **options,
) -> RunReport:
    """Quantize ``model`` in place and return the run report.

    ``method``: a registered method name (``options`` are its config fields, the same names as the
    CLI flags: ``bits=4, group_size=128, order="act", damp=0.01``; ``scheme="W4A8"`` sets ``bits`` and
    ``act`` at once), or a recipe: a :class:`~bitmosaic.pipeline.recipe.Recipe`, a recipe dict or a
    YAML/JSON file (then no ``options``).  ``calib``: token ids ``[n, seqlen]``, or with ``tokenizer=``
    a dataset name (``"wikitext2"``), a text file or raw text, cut into ``nsamples`` windows of
    ``seqlen`` tokens drawn with ``seed``.  ``device`` is where calibration and the solvers run
    (``"auto"``: CUDA when available; the model stays in host memory and each decoder layer visits the
    device in turn); ``offload_inputs`` keeps the calibration activations in host memory;
    ``max_memory`` (bytes or ``"8GB"``; default: the memory available) is the host-memory budget: past
    40% of it one layer's activations, in and out, spill to a temporary folder made in ``spill_dir``
    (default: the system's temporary folder) and are read back batch by batch, with the same results;
    ``measure_errors`` calibrates even Hessian-free methods (RTN, FP8) for the report's error metrics.
    ``rotate`` (``"none"``, ``"hadamard"``, ``"random"``; a recipe's ``rotate`` key) folds QuaRot's
    rotations into the float model first (:mod:`bitmosaic.pipeline.rotate`; seeded by ``seed``).
    Options a method's ``prepare`` step takes (its ``prepare_inputs``; e.g. sfmp's ``salience``, a
    precomputed Fisher diagonal per decoder linear, or ``salience_tokens``) go to that step.
    ``calib_cache`` (a :class:`~bitmosaic.pipeline.calib_cache.CalibCache`) shares the float-model
    statistics between runs.  ``calib_source``/``source_model`` name the data a token tensor was drawn
    from and the model (default: its ``config._name_or_path``) for ``bitmosaic reproduce``.

    The report, the recipe and the provenance are attached as ``model.bitmosaic_run``;
    :func:`bitmosaic.io.save_quantized` writes them.  Bad arguments are one-line
    :class:`~bitmosaic.errors.OptionError` s.  See :func:`bitmosaic.pipeline.pipeline.quantize_model`.
    """
    from .data import bos_token_id
    from .methods import get_method, list_methods
    from .pipeline.recipe import quantize_with_recipe

    if not isinstance(model, nn.Module):
        raise OptionError(f"model must be a torch nn.Module (transformers model); got {type(model).__name__}")
    from .io.saved.save import quantized_modules

    done = quantized_modules(model)
    if done:
        raise OptionError(
            f"the model is already quantized ({len(done)} bitmosaic layers, e.g. {next(iter(done))}); "
            "quantize the float model it was made from"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise OptionError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    takes = {i for m in list_methods() for i in get_method(m).prepare_inputs}
    inputs = {k: options.pop(k) for k in list(options) if k in takes}  # checked by the pipeline
    recipe = as_recipe(method, options, scheme, rotate)
    ids, source = calibration_tokens(
        calib, tokenizer, nsamples=nsamples, seqlen=seqlen, seed=seed, data_dir=data_dir
    )
    source = calib_source or source
    if more_calib is None and source is not None and tokenizer is not None:
        from .data import calibration_samples

        def more_calib(n: int) -> torch.Tensor:  # a prepare step that wants more samples
            return calibration_samples(tokenizer, source, n, ids.shape[1], seed, data_dir=data_dir)

    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    report = quantize_with_recipe(
        model,
        ids,
        recipe,
        batch_size=batch_size,
        hessian_dtype=hessian_dtype,
        progress=progress,
        cache_outputs=cache_outputs,
        analyze_orders=analyze_orders,
        seed=seed,
        device=device,
        offload_inputs=offload_inputs,
        max_memory=max_memory,
        spill_dir=spill_dir,
        measure_errors=measure_errors,
        method_inputs=inputs,
        calib_cache=calib_cache,
        more_calib=more_calib,
        store=store,
    )
    bos = bos_token_id(tokenizer) is not None if tokenizer is not None else False
    report.calibration.update({"source": source or "tensor", "seed": seed, "bos": bos})
    from .io.saved.provenance import run_provenance

    spec = source_model or getattr(getattr(model, "config", None), "_name_or_path", None) or None
    prov = run_provenance(
        ids, source=source, seed=seed, bos=bos, model=spec, device=report.device, dtype=dtype,
        batch_size=batch_size, hessian_dtype=hessian_dtype, analyze_orders=analyze_orders,
    )  # fmt: skip
    model.bitmosaic_run = {"report": report, "recipe": recipe, "provenance": prov}
    return report
