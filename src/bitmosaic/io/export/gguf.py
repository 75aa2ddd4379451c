"""Export to GGUF, the file llama.cpp (and ollama, LM Studio, llama-cpp-python) runs.

``bitmosaic export DIR --format gguf [--gguf-type TYPE] --out FILE.gguf`` writes one file with the
``gguf`` package's ``GGUFWriter``:

- the quantized linears as GGUF blocks of ``TYPE`` (:mod:`.gguf_blocks`): Q4_0 / Q5_0 / Q8_0 hold
  symmetric 2-4 / 5 / 6-8-bit integers exactly, Q4_1 / Q5_1 asymmetric ones (groups contiguous and a
  multiple of 32 columns).  The default ``TYPE`` is the smallest of them for the layers' widths and
  symmetry.  Every written tensor is dequantized with ``gguf.quants`` and compared bit for bit with
  bitmosaic's own weights (else an internal error).  What a type cannot hold -- act-order ``g_idx``
  groups, groups that are not a multiple of 32, integers wider than the type, asymmetric offsets fp16
  cannot hold, activation quantizers, kinds without integer weights -- is refused in one line, or with
  ``lossy`` re-rounded (offsets rounded to fp16; else llama.cpp's own rounding of the type on
  bitmosaic's weights), with the weight error each layer gains.  ``F32`` / ``F16`` / ``BF16`` write the
  quantized weights as floats (exact in F32).
- on request only, the k-quants ``Q2_K`` / ``Q3_K`` / ``Q4_K`` / ``Q5_K`` / ``Q6_K``
  (:mod:`.gguf_kquants`): our integers kept (when the type's codes hold them, up to a shift per
  sub-block), the small integer sub-block scales (and mins) and the fp16 ``d`` (``dmin``) of each
  256-column super-block fitted by least squares to our weights.  Exact only when every scale of a
  super-block is an integer multiple of one fp16 number in the type's range -- practically never for a
  calibrated layer -- so a k-quant is refused in one line naming the relative weight error it would add
  (mean and max over the layers) unless ``lossy``, which writes it and records each layer's error.
  Sub-blocks whose integers the type cannot hold (wider, or an asymmetric range a symmetric type cannot
  offset), act-order layers and kinds without integer weights are re-rounded from our weights
  (``lossy``).  Layers whose input width is not a multiple of 256 are written in their exact legacy
  default type, as llama.cpp falls back for such tensors (a note says how many).  The written blocks are
  read back with ``gguf.quants`` and must equal the refit's own float model bit for bit.
- layers that ``bitmosaic quantize --method gptq --gguf-type T`` solved on a GGUF type's own grid
  (``IQ4_NL`` / ``IQ4_XS``, the k-quants, the presets ``Q4_K_M`` ...) hold their GGUF blocks already
  (:class:`~bitmosaic.modules.gguf_grid.GGUFGridLinear`): written as they are (exact, no ``lossy``), the
  preset's legacy fallback layers (integer grids) in their exact default type; a ``--gguf-type`` other
  than those types is refused (``F32`` / ``F16`` / ``BF16`` write the weights as floats).  An IQ4 type is
  refused for a model without such layers (bitmosaic has no IQ4 form of integers it did not calibrate
  on that grid).
- every other tensor (embeddings, norms, biases, an untied head) in the first of (the source file's
  block type, F16, BF16, F32) that holds it exactly; 1-D tensors in F32.  A float model (a model
  argument such as ``smollm2-135m``, not a saved folder) exports the same way, with ``TYPE`` one of
  ``F32`` / ``F16`` / ``BF16`` for all its matrices (refused unless exact, or ``lossy``).
- metadata, tokenizer and chat template copied from the GGUF file the model was loaded from (the saved
  folder records it; ``source_gguf`` names another), with the tensor names of that file.  Tensors that
  transformers reorders on reading (Llama's q/k rows) are written back in the file's order -- the
  exact inverse of transformers' processing, found by reading row numbers through it; tensors whose
  values it changes (Gemma's norms) are refused.  Converting a Hugging Face tokenizer (a model
  without a source GGUF) is not implemented: refused in one line.

A mixture-of-experts model (its experts quantized one linear per expert projection) is written in
llama.cpp's MoE layout, its metadata from the Hugging Face config (:mod:`.gguf_moe`).

The file is written in a marked temporary folder beside ``out`` and renamed into place when complete
(what a ``kill -9`` leaves, the next run into the folder removes); one export per ``out`` at a time; an
existing ``out`` is replaced only with ``overwrite`` and only when bitmosaic wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...modules.actquant import input_quant_spec
from ...modules.experts import RoutedExperts
from . import gguf_kquants as kq
from . import gguf_moe as moe
from .common import ExportResult, Source, collect, record
from .gguf_blocks import BLOCK, BLOCK_TYPES, BlockType, fit, float_tensor, pack
from .gguf_file import check_gguf_out, source_metadata, tensors_in_file_order, write_gguf
from .gguf_mx import MXFP4_TYPE, mxfp4_blocks
from .gguf_refit import kquant_layer, kquant_refusal
from .layers import ExportError, Refusal, regroup

__all__ = ["GGUF_TYPES", "FLOAT_TYPES", "K_QUANTS", "default_types", "export_gguf"]

FLOAT_TYPES = ("F32", "F16", "BF16")
K_QUANTS = tuple(kq.K_TYPES)  # Q2_K .. Q6_K
# written from layers calibrated on them (GGUFGridLinear), as they are
GRID_TYPES = ("IQ4_NL", "IQ4_XS", "IQ3_S", "IQ2_S", "IQ2_XS", "IQ3_XXS", "IQ2_XXS")
GGUF_TYPES = (*BLOCK_TYPES, *K_QUANTS, *GRID_TYPES, *FLOAT_TYPES, MXFP4_TYPE)
_ALL_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


@dataclass
class _Model:
    """What is exported: the quantized modules (none for a float model) and every other tensor."""

    spec: str  # what was given
    config: dict
    qmods: dict
    plain: dict  # the model's name -> a function giving the float tensor
    source_model: str | None  # the model argument the saved folder was quantized from
    notes: list[str] = field(default_factory=list)
    experts: int = 0  # routed experts per MoE layer (0: a dense model)

    @classmethod
    def read(cls, spec: str) -> _Model:
        from ..sources.loading import resolve_model_spec

        kind, info = resolve_model_spec(str(spec))
        if kind == "bitmosaic":
            src = Source.read(spec)
            plain = {k: (lambda v=v: v) for k, v in src.plain_tensors().items()}
            for n, m in src.qmods.items():
                if m.bias is not None:
                    plain[f"{n}.bias"] = lambda b=m.bias: b.detach()
            n = max((len(m) for m in src.model.modules() if isinstance(m, RoutedExperts)), default=0)
            return cls(str(src.path), src.config, src.qmods, plain, src.qc.get("source_model"), experts=n)
        from ..sources.opener import open_checkpoint

        ckpt, _ = open_checkpoint(str(spec))  # a float model (a GGUF file, a folder or an alias)
        plain = {k: (lambda k=k: ckpt.get(k)) for k in ckpt.keys()}
        return cls(str(spec), ckpt.config().to_dict(), {}, plain, str(spec))


def _source_gguf(model: _Model, given) -> Path:
    from ..sources.loading import ModelSpecError, resolve_model_spec

    if given is not None:
        p = Path(given).expanduser()
        if not p.is_file():
            raise ExportError(f"--source-gguf {given}: no such file; give the GGUF the model was loaded from")
        return p.resolve()
    spec = model.source_model
    try:
        kind, info = resolve_model_spec(spec) if spec else (None, None)
    except ModelSpecError:
        kind = None
    if kind != "gguf":
        raise ExportError(
            f"{model.spec} was not loaded from a GGUF file (source: {spec or 'not recorded'}), and GGUF "
            "export takes metadata and tokenizer from one (converting a Hugging Face tokenizer is not "
            "implemented); pass --source-gguf FILE with the GGUF of the same model"
        )
    return Path(info["path"]).resolve()


def default_types(bits: int, symmetric: bool) -> tuple[str, ...]:
    """The block types tried, in order, for a layer of ``bits`` and symmetry when no ``--gguf-type`` is
    given: the smallest that holds such integers, then one that always does.  Asymmetric 4-bit blocks
    whose codes span all 16 values fit Q4_1 only when their offset ``m`` is an fp16 number; Q5_0 (10%
    larger) holds every 4-bit asymmetric block (``code - zero`` is in [-15, 15]), Q8_0 every 5-7-bit one."""
    if symmetric:
        return ("Q4_0",) if bits <= 4 else ("Q5_0",) if bits == 5 else ("Q8_0",)
    return ("Q4_1", "Q5_0") if bits <= 4 else ("Q5_1", "Q8_0") if bits == 5 else ("Q8_0",)


def _first_default(m) -> str:
    return default_types(getattr(m, "bits", 8), bool(getattr(m, "symmetric", True)))[0]


def _why_wide(form, t: BlockType) -> str:
    if not t.with_min and not form.symmetric and form.bits <= t.bits:
        lo, hi = t.value_range
        use = "--gguf-type F32 for exact weights" if t.bits == 8 else f"use {t.name[:-1]}1"
        return f"asymmetric integers outside [{lo}, {hi}] ({t.name} is symmetric: {use})"
    return f"{form.bits}-bit integers wider than {t.name} holds ({t.bits} bits)"


def _blocks(form, t: BlockType, lossy: bool) -> tuple[np.ndarray | None, str | None, list[str]]:
    """``(bytes, why not exact, changes)`` of an INT form as type ``t``: bytes ``None`` when only a
    re-rounding can give ``t`` (``lossy``) or ``t`` cannot hold it (``why``)."""
    if not form.contiguous:
        return None, "act-order groups (g_idx): a GGUF block is 32 consecutive columns", []
    if form.group_size % BLOCK:
        return None, f"groups of {form.group_size} columns (GGUF blocks need a multiple of {BLOCK})", []
    split = regroup(form, BLOCK)
    f = fit(split.values(), split.scales, t)
    if f.wide:
        return None, _why_wide(form, t), []
    if f.inexact_m:
        why = f"asymmetric offsets m = -k*scale that {t.name}'s fp16 m cannot hold"
        data = pack(f, t) if lossy else None
        return data, why, [f"{t.name} offsets m rounded to fp16 in {f.inexact_m} blocks"]
    return pack(f, t), None, []


def _block_layer(gguf_type: str | None, lossy: bool):
    """``fn(name, module, changes)`` -> ``(bytes, type)``: the layer's GGUF blocks of ``gguf_type`` (else
    the first of :func:`default_types` that holds it exactly); with ``lossy`` the nearest form of the
    first type (offsets rounded, else llama.cpp's own rounding of bitmosaic's weights)."""
    from gguf import quants

    def fn(name, m, changes):
        mx = getattr(m, "fmt", None) == "mxfp4" and input_quant_spec(m) is None
        if gguf_type in (None, MXFP4_TYPE) and mx:
            return mxfp4_blocks(m), MXFP4_TYPE  # exact (gguf_mx.py)
        if gguf_type == MXFP4_TYPE:
            if not lossy:
                raise Refusal(
                    "weights that are not MXFP4 (GGUF MXFP4 holds bitmosaic's mxfp4 layers exactly)"
                )
            changes.append("re-rounded with llama.cpp's MXFP4 rounding of the bitmosaic weights")
            w = m.dequantize_reference(torch.float32).numpy()
            return quants.quantize(w, quants.GGMLQuantizationType.MXFP4), MXFP4_TYPE
        why: list[str] = []
        spec = input_quant_spec(m)
        if spec is not None:
            why.append(f"activation quantization ({spec.label}): GGUF holds weights only")
        if m.in_features % BLOCK:
            raise Refusal(f"an input width that is not a multiple of {BLOCK} (GGUF blocks)", fixable=False)
        try:
            form = m.int_form(_ALL_BITS, False, [])
        except Refusal as r:
            form = None
            why.extend(r.reasons)
        if gguf_type:
            types = (gguf_type,)
        else:
            bits, sym = (
                (form.bits, form.symmetric) if form else (getattr(m, "bits", 8), getattr(m, "symmetric", 1))
            )
            types = default_types(bits, bool(sym))
        nearest = None
        if form is not None:
            tried = []
            for typ in types:
                data, not_exact, lossy_changes = _blocks(form, BLOCK_TYPES[typ], lossy)
                if not_exact is None and not why:
                    return data, typ
                tried.append(not_exact or "")
                if nearest is None and data is not None:
                    nearest = (data, typ, lossy_changes)
            why.append(tried[0])
        why = [w for w in why if w]
        if not lossy:
            raise Refusal(why[-1], also=tuple(why[:-1]))
        if spec is not None:
            changes.append(f"activation quantizer {spec.label} dropped")
        if nearest is not None:
            changes.extend(nearest[2])
            return nearest[0], nearest[1]
        changes.append(f"re-rounded with llama.cpp's {types[0]} rounding of the bitmosaic weights")
        w = m.dequantize_reference(torch.float32).numpy()
        return quants.quantize(w, BLOCK_TYPES[types[0]].qtype), types[0]

    return fn


def _file_type(qtypes: list[str], types: list[str]):
    """``general.file_type``: the commonest type of the quantized matrices, else of the float ones."""
    from collections import Counter

    from gguf import LlamaFileType as F

    named = {"F32": F.ALL_F32, "F16": F.MOSTLY_F16, "BF16": F.MOSTLY_BF16}
    named.update({t: F[f"MOSTLY_{t}"] for t in (*BLOCK_TYPES, *GRID_TYPES)})
    named[MXFP4_TYPE] = F.MOSTLY_MXFP4_MOE  # llama.cpp's one MXFP4 file type (gpt-oss)
    named.update({t: F[f"MOSTLY_{t}" + ("" if t in ("Q2_K", "Q6_K") else "_S")] for t in K_QUANTS})
    # named as llama.cpp's preset file, for its narrowest lattice type (IQ3_XXS's attn_output is IQ3_S, its
    # attn_q / attn_k IQ2_S); llama.cpp's IQ2_S preset is IQ2_XS with IQ3_S for attn_v / attn_output / the
    # first ffn_down, its IQ2_M preset the IQ2_S type with the same IQ3_S tensors
    lattice = [t for t in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ2_S", "IQ3_S") if t in qtypes]
    if lattice:
        if lattice[0] == "IQ2_XS" and "IQ3_S" in qtypes:
            return F.MOSTLY_IQ2_S
        return F.MOSTLY_IQ2_M if lattice[0] == "IQ2_S" else named[lattice[0]]
    kquants = [t for t in qtypes if t in K_QUANTS]  # a k-quant file is named for its k-quant type
    if kquants:
        return named[Counter(kquants).most_common(1)[0][0]]
    if "IQ4_XS" in qtypes:  # an IQ4_XS file (its narrow layers in IQ4_NL, as llama.cpp's) is named for it
        return named["IQ4_XS"]
    if qtypes:
        return named[Counter(qtypes).most_common(1)[0][0]]
    return next((named[t] for t in ("BF16", "F16") if t in types), named["F32"])


def export_gguf(src, out, *, gguf_type: str | None = None, lossy: bool = False, overwrite: bool = False,
                source_gguf=None) -> ExportResult:  # fmt: skip
    """Write ``src`` (a saved bitmosaic folder or a float model argument) as the GGUF file ``out``
    (module doc).  Raises :class:`ExportError` (one line) for what the file cannot hold exactly."""
    if gguf_type is not None:
        gguf_type = gguf_type.upper()
        if gguf_type not in GGUF_TYPES:
            raise ExportError(f"unknown --gguf-type {gguf_type!r}; choose one of {', '.join(GGUF_TYPES)}")
    out = check_gguf_out(out, overwrite)
    model = _Model.read(src)
    if Path(model.spec) == out:
        raise ExportError(f"--out {out} is the source; choose another --out")
    if model.experts:
        return _export_moe(model, out, gguf_type, lossy, overwrite, source_gguf)
    gpath = _source_gguf(model, source_gguf)
    if gpath == out:
        raise ExportError(f"--out {out} is the source GGUF file; choose another --out")
    ckpt, orders = _open_source_gguf(gpath)
    if not model.qmods and (gguf_type in BLOCK_TYPES or gguf_type in K_QUANTS):
        raise ExportError(
            f"{model.spec} has no quantized layers: GGUF block types are written from bitmosaic's integers; "
            "quantize it first (bitmosaic quantize ... --out DIR) or choose --gguf-type F32, F16 or BF16"
        )
    records, tensors, qtypes = [], {}, []  # tensors: model name -> (data, type name)
    if model.qmods:
        records, tensors, qtypes = _quantized_tensors(model, gguf_type, lossy)
    forced = gguf_type if gguf_type in FLOAT_TYPES and not model.qmods else None
    files = ckpt.file_tensors()
    _plain_tensors(model, ckpt, files, forced, lossy, tensors)
    ordered = tensors_in_file_order(ckpt, orders, tensors, files)
    types = [typ for _, typ in tensors.values()]
    counts = ", ".join(f"{t} x{types.count(t)}" for t in sorted(set(types)))
    notes = [*model.notes, f"metadata and tokenizer copied from {gpath}", f"tensor types: {counts}"]
    result = ExportResult(out, "gguf", records, notes)
    write_gguf(
        out,
        overwrite,
        source_metadata(gpath),
        ckpt.arch,
        ordered,
        _file_type(qtypes, types),
        {"source": model.spec, **result.summary()},
    )
    return result


def _open_source_gguf(gpath: Path):
    """``(checkpoint, row orders)`` of the source GGUF file: each tensor's order of rows in the file
    (refuses, in one line, a file whose tensors transformers changes on reading)."""
    from ..sources.gguf_checkpoint import GGUFCheckpoint, UnsupportedGGUFError

    try:
        ckpt = GGUFCheckpoint(gpath)
        orders = {n: ckpt.row_order(n) for n in ckpt.names}  # refuses a file transformers changes on reading
    except UnsupportedGGUFError as e:
        raise ExportError(f"cannot export as gguf: {e}".split("; use --stream")[0]) from None
    return ckpt, orders


def _layer_blocks(model: _Model, gguf_type: str | None, lossy: bool) -> tuple[dict, dict, dict]:
    """``(blocks, changes, rerounded)`` of the quantized layers: per layer its ``(bytes, type)``
    (bytes ``None`` for a float type, written by the caller) and its changes; ``rerounded``: per layer,
    the k-quant sub-blocks whose integers the type cannot hold (k-quants only)."""
    rerounded: dict[str, int] = {}
    grid = {n for n, m in model.qmods.items() if hasattr(m, "gguf_data")}
    if grid and gguf_type not in FLOAT_TYPES:
        return _grid_blocks(model, gguf_type, lossy, grid)
    if gguf_type in GRID_TYPES:
        raise ExportError(
            f"cannot export as gguf: {gguf_type} is written from layers calibrated on its grid, and "
            f"{model.spec} has none; quantize with --method gptq --gguf-type {gguf_type}, or choose another "
            "--gguf-type"
        )
    if gguf_type in FLOAT_TYPES:
        blocks, changes = {n: (None, gguf_type) for n in model.qmods}, {n: [] for n in model.qmods}
    elif gguf_type in K_QUANTS:
        narrow: list[str] = []
        fn = kquant_layer(gguf_type, lossy, narrow, rerounded, _block_layer(None, lossy))
        blocks, changes = collect(model.qmods, fn, "gguf", lossy)
        if narrow:
            model.notes.append(
                f"{len(narrow)} layer(s) whose input width is not a multiple of {kq.QK_K} (a {gguf_type} "
                f"super-block) written in their default legacy type (e.g. {blocks[narrow[0]][1]} for "
                f"{narrow[0]}), as llama.cpp falls back for such tensors"
            )
    else:
        blocks, changes = collect(model.qmods, _block_layer(gguf_type, lossy), "gguf", lossy)
    if model.experts:  # llama.cpp stacks a layer's experts into one tensor of one type
        model.notes.extend(moe.unify_expert_types(blocks, changes, lambda t, ns: _redo(model, t, ns)))
    return blocks, changes, rerounded


def _grid_blocks(model: _Model, gguf_type: str | None, lossy: bool, grid: set) -> tuple[dict, dict, dict]:
    """:func:`_layer_blocks` of a model whose layers ``grid`` hold their own GGUF blocks: those as they
    are; any others as the default block types would write them.  A ``gguf_type`` other than the
    layers' own grid types is refused in one line."""
    own = {n: model.qmods[n].gguf_data() for n in grid}
    types = sorted({t for _, t in own.values()})
    if gguf_type is not None and gguf_type not in (*GRID_TYPES, *types):
        raise ExportError(
            f"cannot export as gguf: {len(grid)} layer(s) were calibrated on the GGUF grid of "
            f"{'/'.join(types)} (e.g. {min(grid)}), which {gguf_type} cannot hold; leave out --gguf-type, "
            "or choose F32 / F16 for floats"
        )
    rest = {n: m for n, m in model.qmods.items() if n not in grid}
    blocks, changes = collect(rest, _block_layer(None, lossy), "gguf", lossy) if rest else ({}, {})
    blocks.update(own)
    changes.update({n: [] for n in grid})
    return blocks, changes, {}


def _redo(model: _Model, typ: str, names: list[str]) -> dict | None:
    """The layers ``names`` as exact blocks of ``typ`` (``None`` when one has no exact form)."""
    fn = _block_layer(typ, False)
    try:
        return {n: fn(n, model.qmods[n], []) for n in names}
    except Refusal:
        return None


def _export_moe(
    model: _Model, out: Path, gguf_type, lossy: bool, overwrite: bool, source_gguf
) -> ExportResult:
    """A mixture-of-experts model in llama.cpp's layout, its metadata from the Hugging Face config
    (:mod:`.gguf_moe`): the quantized layers as the dense path writes them, each layer's experts
    stacked into one tensor, every other tensor in the first float type that holds it exactly."""
    arch, kv = moe.hf_metadata(model.config, model.experts)
    given = None
    if source_gguf is not None:
        given = Path(source_gguf).expanduser().resolve()
        if not given.is_file():
            raise ExportError(
                f"--source-gguf {source_gguf}: no such file; give a GGUF with the model's vocabulary"
            )
    kv += moe.tokenizer_metadata(Path(model.spec), given)
    records, tensors, qtypes = _quantized_tensors(model, gguf_type, lossy) if model.qmods else ([], {}, [])
    tied = bool(model.config.get("tie_word_embeddings"))
    for name, get in model.plain.items():
        if not (tied and name == "lm_head.weight"):
            data, typ, _ = float_tensor(get(), None, None, lossy)
            tensors[name] = (data, typ)
    rows = [(g, data, typ) for g, (data, typ) in moe.stack_experts(tensors, model.config).items()]
    types = [typ for _, _, typ in rows]
    counts = ", ".join(f"{t} x{types.count(t)}" for t in sorted(set(types)))
    result = ExportResult(
        out, "gguf", records, [*model.notes, f"llama.cpp architecture {arch}", f"tensor types: {counts}"]
    )
    report = {"source": model.spec, **result.summary()}
    write_gguf(out, overwrite, kv, arch, rows, _file_type(qtypes, types), report)
    return result


def _quantized_tensors(model: _Model, gguf_type: str | None, lossy: bool) -> tuple[list, dict, list]:
    """``(records, tensors, types)`` of the quantized layers' weights: each layer's blocks (or float
    tensor) read back with ``gguf.quants`` for its record.  Refuses an inexact k-quant (without
    ``lossy``) or float type; notes the layers written in a wider exact type than the default."""
    blocks, changes, rerounded = _layer_blocks(model, gguf_type, lossy)
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    records, tensors, qtypes = [], {}, []
    for name, m in model.qmods.items():
        data, typ = blocks[name]
        if data is None:  # a float type for the quantized weights
            data, typ, exact = float_tensor(m.dequantize_reference(torch.float32), typ, None, True)
            if not exact:
                if not lossy:
                    raise ExportError(
                        f"cannot export as gguf: {typ} cannot hold the quantized weights exactly (e.g. "
                        f"{name}); use --gguf-type F32, or pass --lossy"
                    )
                changes[name].append(f"weights rounded to {typ}")
        deq = np.asarray(quants.dequantize(data, Q[typ])).reshape(m.out_features, m.in_features)
        records.append(record(name, m, torch.from_numpy(np.ascontiguousarray(deq)), changes[name]))
        tensors[f"{name}.weight"] = (data, typ)
        qtypes.append(typ)
    if gguf_type in K_QUANTS and not lossy and any(r.changes for r in records):
        t = kq.K_TYPES[gguf_type]
        m = model.qmods[next(r.name for r in records if r.changes)]
        exact = " or ".join(default_types(getattr(m, "bits", 8), bool(getattr(m, "symmetric", True))))
        raise ExportError(kquant_refusal(t, records, sum(rerounded.values()), exact))
    fallback = [
        n
        for n, (_, t) in blocks.items()
        if gguf_type is None
        and not hasattr(model.qmods[n], "gguf_data")
        and t != _first_default(model.qmods[n])
    ]
    if fallback:
        model.notes.append(
            f"{len(fallback)} asymmetric layer(s) written in the wider exact type (e.g. "
            f"{blocks[fallback[0]][1]}): the fp16 offsets m of Q4_1/Q5_1 cannot hold theirs; "
            "--gguf-type Q4_1 (or Q5_1) --lossy rounds the offsets instead"
        )
    return records, tensors, qtypes


def _plain_tensors(model: _Model, ckpt, files: dict, forced: str | None, lossy: bool, tensors: dict) -> None:
    """Add every other tensor to ``tensors`` (a tied head left out), each in the first type that holds
    it exactly (:func:`_float_tensor`); refuses, in one line, a ``forced`` type that cannot hold some
    unless ``lossy`` (then noted as rounded)."""
    bad, rounded = [], []
    tied = bool(model.config.get("tie_word_embeddings")) and "lm_head.weight" not in ckpt.names
    for name, get in model.plain.items():
        if tied and name == "lm_head.weight":
            continue
        src_type = files[ckpt.names[name]][0] if name in ckpt.names else None
        data, typ, exact = float_tensor(get(), forced, src_type, lossy)
        if data is None:
            bad.append(name)
            continue
        if not exact:
            rounded.append(name)
        tensors[name] = (data, typ)
    if bad:
        raise ExportError(
            f"cannot export as gguf: {forced} cannot hold {len(bad)} tensor(s) exactly (e.g. {bad[0]}); "
            f"choose --gguf-type F32 or pass --lossy to round them"
        )
    if rounded:
        model.notes.append(f"{len(rounded)} float tensor(s) rounded to {forced} (--lossy)")
