"""Streaming quantization: a model larger than memory, one decoder layer at a time, resumable.

:func:`quantize_streaming` never holds the whole model.  It builds the model with its parameters on
the ``meta`` device (:class:`~bitmosaic.io.sources.checkpoint.Checkpoint`), reads the embeddings, captures
the calibration inputs of layer 0 and writes the embeddings to the output, then for each decoder
layer: reads it from the checkpoint (memory-mapped safetensors, or a GGUF file tensor by tensor:
:class:`~bitmosaic.io.sources.gguf_checkpoint.GGUFCheckpoint`), calibrates and quantizes it with the
very pipeline the in-memory path uses (:func:`~bitmosaic.pipeline.pipeline.quantize_model` with a
:class:`LayerStore`), writes its packed tensors as one finished shard, and frees it.  Peak host memory
is about one decoder layer in the compute dtype, its Hessians, and the calibration activations (in the
model's dtype, as the in-memory path keeps them; past the memory budget they spill to a
``.bitmosaic-spill-*`` folder inside the work folder and are read back one batch at a time:
:mod:`bitmosaic.pipeline.spill`).
The output is sharded safetensors with an index, as ``save_pretrained`` writes, and loads with
``bitmosaic.load``, ``load_quantized`` and ``from_pretrained`` exactly as before.

**Resume.**  Work goes to ``.<out>.partial/`` beside the output folder.  After each layer it holds the
layer's shard, the next layer's calibration inputs (``inputs-NNNNN.safetensors``, with the random
generator's state; written and read one batch at a time) and ``progress.json``: finished layers, their
report rows and saved settings, and the run's fingerprint (source checkpoint, recipe, calibration
tokens, pipeline settings, library version).  ``progress.json`` is written last, atomically, so a
crash or ``kill -9`` at any moment leaves a consistent record.  Rerunning the same command continues
after the last finished layer and gives the same bytes as an uninterrupted run; a rerun with anything
in the fingerprint changed refuses in one line naming it.  When the run completes, the folder is
renamed into place.  Inside a layer, each finished solve is journaled (``layer-LLLLL/``,
:mod:`bitmosaic.pipeline.journal`), so a rerun keeps the experts a killed run had solved.

Methods with a whole-model step (a ``prepare`` or ``finalize`` hook, e.g. a global bit allocation
from gradients through the full model) cannot stream and are refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
from torch import nn

from .._version import __version__
from ..errors import OptionError
from ..io.saved.outdir import atomic_write_text, check_output_dir, output_lock, replace_dir
from ..io.saved.save import finish_folder, saved_config
from ..io.saved.shards import SAVE_META, shard_name, shards_index, tensors_for_save, write_index, write_shard
from ..io.sources.checkpoint import Checkpoint
from ..models.arch import get_arch
from ..modules.qmodules import full_layer_config
from .journal import LayerJournal, journal_dir, jsonable
from .run import run, source_name
from .settings import Calibration, RunSettings
from .spill import SPILL_PREFIX, TensorFile, write_tensor_file

__all__ = ["LayerStore", "finished_layers", "quantize_streaming", "partial_dir", "streamable"]

PROGRESS = "progress.json"
_PROGRESS_VERSION = 1


def partial_dir(out: str | os.PathLike) -> Path:
    """Where an unfinished streaming run into ``out`` keeps its work."""
    out = Path(out)
    return out.parent / f".{out.name}.partial"


def streamable(recipe) -> str | None:
    """``None`` when every method of ``recipe`` can run layer by layer, else why not (one line)."""
    if getattr(recipe, "rotate", "none") != "none":
        return (
            f"--rotate {recipe.rotate} folds rotations into the embeddings, the head and every layer of the "
            "float model before calibration, so it cannot stream one layer at a time; use --stream off"
        )
    entries = [recipe.default()]
    entries += [recipe._entry_config(r, f"recipe overrides[{i}]") for i, r in enumerate(recipe.overrides)]
    for method, config in entries:
        if method is not None and (method.needs_prepare(config) or method.has_finalize):
            return (
                f"method {method.name} has a whole-model step (its prepare/finalize hooks see every layer at "
                "once), so it cannot stream one layer at a time; use --stream off (the model is then loaded "
                "whole)"
            )
    return None


class _Freed(nn.Module):
    """What a finished decoder layer leaves in the model: nothing."""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:24]


_FINGERPRINT = (("version", "bitmosaic version"), ("source", "model checkpoint"), ("recipe", "recipe"),
                ("calibration", "calibration tokens"), ("settings", "pipeline settings"))  # fmt: skip


class LayerStore:
    """The pipeline's source and sink of decoder layers in a streaming run (module doc)."""

    def __init__(self, ckpt: Checkpoint, model: nn.Module, work: Path, dtype: torch.dtype, fingerprint: dict):
        self.ckpt, self.model, self.work, self.dtype = ckpt, model, work, dtype
        self.arch = get_arch(model)
        self.layers = self.arch.layers(model)
        self.n_shards = len(self.layers) + 2  # embeddings, one per layer, the rest (final norm, head)
        self.fingerprint = fingerprint
        self._t = time.perf_counter()
        self._outside_freed = False
        self.state = {"version": _PROGRESS_VERSION, "fingerprint": fingerprint, "layers_done": 0,
                      "rows": [], "modules": {}, "total_bits": 0.0, "total_weights": 0}  # fmt: skip
        prog = work / PROGRESS
        if prog.is_file():
            try:
                old = json.loads(prog.read_text(encoding="utf-8"))
            except ValueError:
                old = None
            if isinstance(old, dict) and old.get("version") == _PROGRESS_VERSION:
                self._check_same_run(old.get("fingerprint") or {})
                self.state = old

    def _check_same_run(self, old: dict) -> None:
        for key, what in _FINGERPRINT:
            if old.get(key) != self.fingerprint.get(key):
                raise OptionError(
                    f"{self.work} holds an unfinished run with a different {what} ({old.get(key)} vs "
                    f"{self.fingerprint.get(key)}); rerun the exact command that started it, or delete "
                    f"{self.work} to start over"
                )

    def shard(self, i: int) -> str:
        return shard_name(i, self.n_shards)

    def _write(self, i: int, sd: dict[str, torch.Tensor]) -> None:
        write_shard(self.work / self.shard(i), tensors_for_save(sd))  # atomic: no half-written shard left

    # -- what the pipeline calls -----------------------------------------------------------------
    def resume(self, report, gen: torch.Generator, inputs) -> tuple[int, float, int]:
        k = int(self.state["layers_done"])
        if k == 0:
            return 0, 0.0, 0
        with TensorFile(self.work / f"inputs-{k:05d}.safetensors") as saved:  # one batch at a time
            gen.set_state(saved.get("gen_state"))
            if inputs is not None:
                for i in range(len(inputs)):
                    inputs.set(i, saved.get(f"b{i}"))
                inputs.advance()
        report.layers.extend(self.state["rows"])
        for li in range(k):
            self.layers[li] = _Freed()
            shutil.rmtree(journal_dir(self.work, li), ignore_errors=True)  # killed after the commit
        return k, float(self.state["total_bits"]), int(self.state["total_weights"])

    def load(self, li: int, layer: nn.Module, skip=()) -> None:
        """Fill decoder layer ``li`` from the checkpoint, less the submodules named in ``skip`` (left on
        ``meta``: experts read part by part, :meth:`reader`)."""
        if not self._outside_freed:  # the layer-0 inputs are captured: the embeddings are not needed
            _free_outside(self.model, self.arch.layers_path)
            self._outside_freed = True
        self.ckpt.fill(layer, f"{self.arch.layers_path}.{li}.", self.dtype, skip=skip)

    def journal(self, li: int) -> LayerJournal:
        """Layer ``li``'s units finished so far (journal.py): those of a killed run, on a rerun."""
        return LayerJournal(journal_dir(self.work, li), begin=self._begin)

    def _begin(self) -> None:
        """Before the first unit of the first layer is journaled: ``progress.json`` with the fingerprint,
        so that a rerun with anything changed refuses instead of installing another run's modules."""
        if not (self.work / PROGRESS).is_file():
            atomic_write_text(self.work / PROGRESS, json.dumps(self.state, indent=1))

    def reader(self, li: int):
        """``read(name, module)``: fill submodule ``name`` of layer ``li`` from the checkpoint."""
        pre = f"{self.arch.layers_path}.{li}."
        return lambda name, module: self.ckpt.fill(module, f"{pre}{name}.", self.dtype)

    def done(self, li, layer, rows, inputs, gen, total_bits, total_weights) -> None:
        prefix = f"{self.arch.layers_path}.{li}."
        mods = {prefix + n: full_layer_config(m) for n, m in layer.named_modules()
                if hasattr(m, "layer_config")}  # fmt: skip
        self._write(li + 1, {prefix + k: v for k, v in layer.state_dict().items()})
        batches = [(f"b{i}", *inputs.spec(i)) for i in range(len(inputs))] if inputs is not None else []
        state = gen.get_state()
        specs = [*batches, ("gen_state", tuple(state.shape), state.dtype)]
        tmp = self.work / f"inputs-{li + 1:05d}.safetensors.tmp"  # written one batch at a time
        try:
            write_tensor_file(tmp, specs, lambda i: inputs.stored(i) if i < len(batches) else state,
                              SAVE_META)  # fmt: skip
            os.replace(tmp, self.work / f"inputs-{li + 1:05d}.safetensors")
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        st = self.state
        st["layers_done"] = li + 1
        st["rows"] = st["rows"] + json.loads(json.dumps(rows, default=jsonable))
        st["modules"].update(mods)
        st["total_bits"], st["total_weights"] = total_bits, total_weights
        now = time.perf_counter()  # wall time per layer (the first one includes the capture)
        st["layer_seconds"] = [*st.get("layer_seconds", []), round(now - self._t, 3)]
        self._t = now
        atomic_write_text(self.work / PROGRESS, json.dumps(st, indent=1))  # the commit point
        (self.work / f"inputs-{li:05d}.safetensors").unlink(missing_ok=True)
        shutil.rmtree(journal_dir(self.work, li), ignore_errors=True)  # the shard holds it all now
        self.layers[li] = _Freed()


def _free_outside(model: nn.Module, layers_path: str) -> None:
    """Put every parameter outside the decoder stack back on ``meta`` (they are in the output shards)."""
    for name, mod in model.named_modules():
        if name == layers_path or name.startswith(layers_path + "."):
            continue
        for n, p in list(mod._parameters.items()):
            if p is not None and p.device.type != "meta":
                mod._parameters[n] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)


def _write_outside(store: LayerStore, ckpt: Checkpoint, model: nn.Module) -> None:
    """The tensors outside the decoder stack: the input embeddings in the first shard, the rest (final
    norm, an untied output head) in the last; each read, cast and written alone."""
    layers_path = store.arch.layers_path + "."
    tied = getattr(model.config, "tie_word_embeddings", False)
    names = [n for n, _ in [*model.named_parameters(), *model.named_buffers()]
             if not n.startswith(layers_path) and n in ckpt
             and not (tied and n == "lm_head.weight")]  # fmt: skip
    embed = model.get_input_embeddings()
    emb_names = [n for n, p in model.named_parameters() if p is embed.weight and n in names]
    rest = [n for n in names if n not in emb_names]
    for i, group in ((0, emb_names), (store.n_shards - 1, rest)):
        if not (store.work / store.shard(i)).is_file():
            store._write(i, {n: ckpt.get(n, store.dtype) for n in group})


def _fill_outside(ckpt: Checkpoint, model: nn.Module, layers_path: str, dtype: torch.dtype) -> None:
    """Everything outside the decoder stack except the output head (only the output needs it)."""
    head = model.get_output_embeddings()
    for name, child in model.named_children():
        for sub, mod in child.named_modules(prefix=name):
            if sub == layers_path or sub.startswith(layers_path + ".") or mod is head:
                continue
            own = [n for n, p in mod.named_parameters(recurse=False)]
            own += [n for n, _ in mod.named_buffers(recurse=False) if f"{sub}.{n}" in ckpt]
            if own:
                part = {}
                for n in own:
                    t = getattr(mod, n)
                    part[n] = ckpt.get(f"{sub}.{n}", dtype if t.is_floating_point() else None)
                mod.load_state_dict(part, strict=False, assign=True)


def quantize_streaming(
    ckpt: Checkpoint, tokenizer, out: str | os.PathLike, recipe, calibration,
    settings: RunSettings | None = None, *, dtype: torch.dtype = torch.float32, overwrite: bool = False,
):  # fmt: skip
    """Quantize checkpoint ``ckpt`` into folder ``out`` layer by layer (module doc); returns the run
    report.  ``calibration``: token ids or a :class:`~bitmosaic.pipeline.settings.Calibration`;
    ``settings``: the run's :class:`~bitmosaic.pipeline.settings.RunSettings` (those that change results
    join the resume fingerprint); ``dtype``: the dtype tensors are read in and unquantized tensors are
    saved in (as the in-memory path's load dtype); ``tokenizer`` is saved beside the model.  The
    provenance names the model by the checkpoint's spec (a local path resolved)."""
    why = streamable(recipe)
    if why:
        raise OptionError(why)
    out = check_output_dir(out, overwrite)
    with output_lock(out):  # one run per output folder; its .partial is this run's alone
        work = partial_dir(out)
        fresh = not (work / PROGRESS).is_file()
        try:
            return _quantize_streaming(ckpt, tokenizer, out, recipe, Calibration.of(calibration),
                                       settings or RunSettings(), dtype, overwrite)  # fmt: skip
        except BaseException as e:  # a refused recipe, an error in layer 0: nothing worth keeping (a signal
            # keeps layer 0's journaled solves: journal.py), so a rerun with the fix starts afresh
            done = finished_layers(work)
            if fresh and (done is None or (isinstance(e, Exception) and done == 0)):
                shutil.rmtree(work, ignore_errors=True)
            raise


def finished_layers(work: str | os.PathLike) -> int | None:
    """How many layers the unfinished run in ``work`` committed (``None``: no readable record)."""
    try:
        return int(json.loads((Path(work) / PROGRESS).read_text(encoding="utf-8"))["layers_done"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _fingerprint(ckpt: Checkpoint, recipe, calib: torch.Tensor, settings: RunSettings, dtype) -> dict:
    """What a resumed run must share with the run that started it (module doc)."""
    changes = {**settings.record(), "seed": settings.seed, "device": str(settings.device),
               "dtype": str(dtype)}  # fmt: skip
    return {
        "version": __version__,
        "source": ckpt.fingerprint(),
        "recipe": _sha(json.dumps(recipe.to_dict(), sort_keys=True, default=str).encode()),
        "calibration": _sha(str(tuple(calib.shape)).encode() + calib.to(torch.int64).numpy().tobytes()),
        "settings": _sha(json.dumps(changes, sort_keys=True, default=str).encode()),
    }


def _quantize_streaming(ckpt, tokenizer, out: Path, recipe, calibration, settings, dtype, overwrite):
    work = partial_dir(out)
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob(SPILL_PREFIX + "*"):  # spilled activations of a run that was killed
        shutil.rmtree(old, ignore_errors=True)
    for old in work.glob("*.tmp"):  # a shard or inputs file a killed run was writing
        old.unlink(missing_ok=True)
    model = ckpt.empty_model(dtype)
    fingerprint = _fingerprint(ckpt, recipe, calibration.tokens, settings, dtype)
    store = LayerStore(ckpt, model, work, dtype, fingerprint)
    arch = store.arch
    _write_outside(store, ckpt, model)
    _fill_outside(ckpt, model, arch.layers_path, dtype)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    report = run(model, recipe, calibration, settings, store, source_model=source_name(ckpt.spec))
    from ..io.saved.provenance import saved_run_info

    cfg = saved_config(model, saved_run_info(model.bitmosaic_run), store.state["modules"])
    (work / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(work)
    if tokenizer is not None:
        tokenizer.save_pretrained(work)
    write_index(work, *shards_index(work, [store.shard(i) for i in range(store.n_shards)]))
    for f in work.glob("inputs-*.safetensors"):
        f.unlink()
    (work / PROGRESS).unlink()
    finish_folder(work)
    check_output_dir(out, overwrite)
    replace_dir(work, out)
    shutil.rmtree(work, ignore_errors=True)
    model.bitmosaic_run["saved_to"] = str(out)
    return report
