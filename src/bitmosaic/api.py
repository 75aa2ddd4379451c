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
from .pipeline.report import RunReport
from .pipeline.run import run
from .pipeline.settings import Calibration, RunSettings, settings_fields

__all__ = ["quantize_", "as_recipe", "calibration_tokens", "draw_calibration", "RunSettings"]

_DATASETS = ("wikitext2", "wikitext-2")


def as_recipe(method, options: dict | None = None, scheme: str | None = None, rotate: str | None = None):
    """A :class:`~bitmosaic.pipeline.recipe.Recipe` from a method name (with config ``options``,
    ``scheme`` and ``rotate``), a ``Recipe``, a recipe dict, or the path of a YAML/JSON recipe file."""
    from .pipeline.recipe import Recipe, jsonable_options, load_recipe

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
    d = {"method": spec.name, "settings": jsonable_options(options)}
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


# quantize_'s keywords that say what it calibrates on (the rest: RunSettings fields, the method's options)
CALIBRATION_KEYWORDS = ("nsamples", "seqlen", "data_dir", "calib_source", "more_calib", "source_model")


def quantize_(model: nn.Module, method, calib, *, tokenizer=None, settings: RunSettings | None = None,
              **options) -> RunReport:  # fmt: skip
    """Quantize ``model`` in place and return the run report.

    ``method``: a registered method name (``options`` are then its config fields, the same names as
    the CLI flags: ``bits=4, group_size=128, order="act", damp=0.01``; ``scheme="W4A8"`` sets ``bits``
    and ``act`` at once; ``rotate="hadamard"`` folds QuaRot's rotations in first), or a recipe: a
    :class:`~bitmosaic.pipeline.recipe.Recipe`, a recipe dict or a YAML/JSON file (then no config
    options).  ``calib``: token ids ``[n, seqlen]``, or with ``tokenizer=`` a dataset name
    (``"wikitext2"``), a text file or raw text, cut into ``nsamples`` (default 128) windows of ``seqlen``
    (default 512) tokens drawn with ``seed`` (``data_dir``: the shared data folder).

    How the run runs -- ``batch_size``, ``hessian_dtype``, ``seed``, ``device``, ``compute_dtype``,
    ``offload_inputs``, ``max_memory``, ``spill_dir``, ``cache_outputs``, ``calib_cache``,
    ``analyze_orders``, ``measure_errors``, ``check_packing``, ``progress`` -- is a
    :class:`~bitmosaic.pipeline.settings.RunSettings` (``settings=``), or its fields given as keywords
    here (each documented there; they override ``settings``).  Options a method's ``prepare`` step
    takes (its ``prepare_inputs``; e.g. sfmp's ``salience``, a precomputed Fisher diagonal per decoder
    linear, or ``salience_tokens``) go to that step.  ``calib_source``/``source_model`` name the data a
    token tensor was drawn from and the model (default: its ``config._name_or_path``) for
    ``bitmosaic reproduce``; ``more_calib(n)`` draws ``n`` more samples for a prepare step that wants
    more than ``calib`` has (default: drawn again from ``calib``'s source).

    The report, the recipe and the provenance are attached as ``model.bitmosaic_run``;
    :func:`bitmosaic.io.save_quantized` writes them.  Bad arguments are one-line
    :class:`~bitmosaic.errors.OptionError` s.  See :func:`bitmosaic.pipeline.run.run`.
    """
    from .io.saved.save import quantized_modules
    from .methods import get_method, list_methods

    if not isinstance(model, nn.Module):
        raise OptionError(f"model must be a torch nn.Module (transformers model); got {type(model).__name__}")
    done = quantized_modules(model)
    if done:
        raise OptionError(
            f"the model is already quantized ({len(done)} bitmosaic layers, e.g. {next(iter(done))}); "
            "quantize the float model it was made from"
        )
    mine = {k: options.pop(k) for k in list(options) if k in settings_fields()}
    settings = (settings or RunSettings()).replace(**mine)
    cal = {k: options.pop(k) for k in CALIBRATION_KEYWORDS if k in options}
    source_model = cal.pop("source_model", None)
    takes = {i for m in list_methods() for i in get_method(m).prepare_inputs}
    inputs = {k: options.pop(k) for k in list(options) if k in takes}  # checked by the pipeline
    scheme, rotate = options.pop("scheme", None), options.pop("rotate", None)
    recipe = as_recipe(method, options, scheme, rotate)
    calibration = _calibration(calib, tokenizer, settings.seed, **cal)
    return run(model, recipe, calibration, settings, inputs=inputs, source_model=source_model)


def _calibration(calib, tokenizer, seed: int, nsamples: int = 128, seqlen: int = 512, data_dir=None,
                 calib_source: str | None = None, more_calib=None) -> Calibration:  # fmt: skip
    """The run's :class:`~bitmosaic.pipeline.settings.Calibration` from ``quantize_``'s arguments: the
    tokens, where they came from, whether they start with BOS, and how to draw more like them."""
    from .data import bos_token_id

    ids, source = calibration_tokens(calib, tokenizer, nsamples=nsamples, seqlen=seqlen, seed=seed,
                                     data_dir=data_dir)  # fmt: skip
    source = calib_source or source
    if more_calib is None and source is not None and tokenizer is not None:
        more_calib = _drawer(tokenizer, source, ids.shape[1], seed, data_dir)
    bos = bos_token_id(tokenizer) is not None if tokenizer is not None else False
    return Calibration(ids, source, bos, more_calib)


def draw_calibration(tokenizer, source: str, nsamples: int, seqlen: int, seed: int,
                     data_dir=None) -> Calibration:  # fmt: skip
    """``nsamples`` windows of ``seqlen`` tokens drawn with ``seed`` from ``source`` (a dataset name or a
    text file; ``data_dir``: the shared data folder), as a
    :class:`~bitmosaic.pipeline.settings.Calibration` that can draw more alike."""
    from .data import bos_token_id

    draw = _drawer(tokenizer, source, seqlen, seed, data_dir)
    return Calibration(draw(nsamples), source, bos_token_id(tokenizer) is not None, draw)


def _drawer(tokenizer, source: str, seqlen: int, seed: int, data_dir):
    """``draw(n)``: ``n`` calibration samples from ``source``, drawn as the run's own were."""
    from .data import calibration_samples

    def draw(n: int) -> torch.Tensor:
        return calibration_samples(tokenizer, source, n, seqlen, seed, data_dir=data_dir)

    return draw
