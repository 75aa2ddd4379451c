"""What every export shares: read a bitmosaic folder, convert its layers (collecting refusals), measure
the error a lossy form adds, and write the new checkpoint atomically.

The output is built in a marked temporary sibling folder and renamed into place only when complete, so
an interrupted export never leaves a partial checkpoint, and the next run into the same parent folder
removes what a ``kill -9`` left (:func:`~bitmosaic.io.saved.outdir.clean_stale_temporaries`); one export at a
time per output folder (:func:`~bitmosaic.io.saved.outdir.output_lock`).  An existing output folder is
replaced only with ``overwrite`` and only when a previous export wrote it (it holds :data:`MARKER`); a
user folder is never touched.  Besides the quantized tensors, the export copies every tensor outside the
quantized layers (embeddings, norms, an untied ``lm_head``) unchanged, and the tokenizer and generation
files.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ...modules.experts import RoutedExperts
from ..saved.integrity import SUMS
from ..saved.load import load_quantized, read_quant_config, read_state_dict
from ..saved.outdir import make_temporary, output_lock, replace_dir
from ..saved.save import quantized_modules
from ..saved.shards import write_safetensors
from .layers import ExportError, Refusal, weight_error

__all__ = [
    "MARKER",
    "LayerRecord",
    "ExportResult",
    "Source",
    "collect",
    "record",
    "check_export_dir",
    "write",
    "serving_config",
]

MARKER = "bitmosaic_export.json"  # the export report; also marks a folder an export may replace
_NOT_COPIED = {"config.json", "model.safetensors.index.json", MARKER, SUMS}  # SUMS: the source's hashes


@dataclass
class LayerRecord:
    name: str
    changes: list[str]
    rel_err: float  # ||W_exported - W||_F / ||W||_F
    max_abs: float  # max |W_exported - W|


@dataclass
class ExportResult:
    out: Path
    format: str
    records: list[LayerRecord]
    notes: list[str] = field(default_factory=list)

    @property
    def changed(self) -> list[LayerRecord]:
        return [r for r in self.records if r.changes]

    def summary(self) -> dict:
        ch = self.changed
        return {
            "layers": len(self.records),
            "changed_layers": len(ch),
            "mean_rel_err": sum(r.rel_err for r in self.records) / max(1, len(self.records)),
            "max_rel_err": max((r.rel_err for r in self.records), default=0.0),
            "max_abs": max((r.max_abs for r in self.records), default=0.0),
        }


@dataclass
class Source:
    """A loaded bitmosaic folder: its config, model, quantized modules and raw stored tensors."""

    path: Path
    config: dict
    qc: dict
    model: torch.nn.Module
    qmods: dict

    @classmethod
    def read(cls, path) -> Source:
        path = Path(path).expanduser().resolve()
        raw, qc = read_quant_config(path)
        model, _ = load_quantized(path, load_tokenizer=False)
        return cls(path, raw, qc, model, quantized_modules(model))

    def plain_tensors(self) -> dict[str, torch.Tensor]:
        """Stored tensors outside the quantized layers (embeddings, norms, an untied head), unchanged."""
        sd = read_state_dict(self.path)
        names = tuple(n + "." for n in self.qmods)
        return {k: v for k, v in sd.items() if not k.startswith(names)}

    def unquantized_linears(self) -> list[str]:
        """The float linears a loader must leave unquantized (compressed-tensors' ``ignore``): every
        ``nn.Linear`` not quantized, and a mixture of experts' routers (``mlp.gate``; transformers 5
        holds them as modules of their own with a 2-D ``weight``) and shared-expert gates."""
        names = [
            n for n, m in self.model.named_modules() if isinstance(m, torch.nn.Linear) and n not in self.qmods
        ]
        for parent in (
            n.rpartition(".")[0] for n, m in self.model.named_modules() if isinstance(m, RoutedExperts)
        ):
            for child, m in self.model.get_submodule(parent).named_children():
                w = getattr(m, "weight", None)
                name = f"{parent}.{child}"
                if (
                    isinstance(w, torch.Tensor)
                    and w.ndim == 2
                    and name not in self.qmods
                    and name not in names
                ):
                    names.append(name)
        return names


def collect(qmods: dict, fn: Callable, fmt: str, lossy: bool) -> tuple[dict, dict[str, list[str]]]:
    """``fn(name, module, changes)`` for every quantized layer; all refusals in one :class:`ExportError`."""
    out, changes, refused, fatal = {}, {}, {}, set()
    for name, m in qmods.items():
        changes[name] = []
        try:
            out[name] = fn(name, m, changes[name])
        except Refusal as r:
            for why in r.reasons:
                refused.setdefault(why, []).append(name)
            if not r.fixable:
                fatal.add(r.reason)
    if refused:
        parts = [f"{why} ({len(ns)} layer(s), e.g. {ns[0]})" for why, ns in refused.items()]
        if fatal:
            hint = "no lossy form exists for: " + "; ".join(sorted(fatal))
        else:
            hint = "pass --lossy to export the nearest representable form and print the error it adds"
        raise ExportError(f"cannot export as {fmt}: " + "; ".join(parts) + f"; {hint}")
    return out, changes


def record(name: str, module, exported: torch.Tensor, changes: list[str]) -> LayerRecord:
    """The error the exported weight adds; an unchanged layer must be bit-identical (else a bug)."""
    ref = module.dequantize_reference(torch.float32)
    err = weight_error(ref, exported.float())
    if not changes and not torch.equal(ref, exported.float()):
        raise RuntimeError(f"internal error: the exact export of {name} differs from its weights ({err})")
    return LayerRecord(name, list(changes), err["rel_err"], err["max_abs"])


# the key the hub checkpoints (and vLLM's model code) read the routed expert count from, where
# transformers 5 writes its own alias ``num_local_experts`` instead
_EXPERT_COUNT_KEY = {"qwen3_moe": "num_experts", "qwen2_moe": "num_experts", "olmoe": "num_experts"}


def serving_config(src: Source) -> dict:
    """The exported ``config.json`` (less ``quantization_config``): the source's, with the routed expert
    count also under the key the hub checkpoints use (vLLM's Qwen-MoE / OLMoE read ``num_experts``,
    which transformers 5 saves as ``num_local_experts``) and ``architectures`` filled in where the
    source left it empty (a model made from a config; vLLM picks its model class from it)."""
    cfg = {k: v for k, v in src.config.items() if k != "quantization_config"}
    key = _EXPERT_COUNT_KEY.get(cfg.get("model_type"))
    if key and key not in cfg and "num_local_experts" in cfg:
        cfg[key] = cfg["num_local_experts"]
    if not cfg.get("architectures"):
        cfg["architectures"] = [type(src.model).__name__]
    return cfg


def check_export_dir(out, overwrite: bool, src: Path) -> Path:
    out = Path(out).expanduser().resolve()
    if out == src:
        raise ExportError(f"--out {out} is the source folder; choose another --out")
    if not out.exists():
        return out
    if not out.is_dir():
        raise ExportError(f"output {out} exists and is not a folder; choose another --out")
    if not any(out.iterdir()):
        return out
    if not (out / MARKER).is_file():
        raise ExportError(
            f"output folder {out} is not empty and was not written by bitmosaic export (no {MARKER}); "
            "it is never replaced: choose another --out"
        )
    if not overwrite:
        raise ExportError(f"output folder {out} holds an earlier export; pass --overwrite to replace it")
    return out


def _check_inside(f: Path, folder: Path) -> None:
    """A file to copy from the saved ``folder`` must be its own: a symlink pointing outside it (a
    downloaded folder's ``tokenizer.json -> ~/.ssh/id_rsa``) would put a stranger's choice of the user's
    files into the export.  A Hugging Face cache snapshot's links into its ``blobs`` folder are fine."""
    target = f.resolve()
    inside = target.is_relative_to(folder.resolve())
    hub_blob = target.parent == folder.resolve().parent.parent / "blobs"  # snapshots/<rev> -> blobs
    if f.is_symlink() and not (inside or hub_blob):
        raise ExportError(
            f"{f} is a symlink to {target}, outside the saved folder; export copies only the folder's own "
            "files: replace the link by the file it should be, or remove it"
        )


def write(
    src: Source, out: Path, overwrite: bool, tensors: dict, qconfig: dict, result: ExportResult
) -> None:
    """The checkpoint folder: config with ``qconfig``, tensors, tokenizer files and the export report."""
    out = check_export_dir(out, overwrite, src.path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out):  # one export per --out; stale temporaries of a killed one are cleaned
        _write_locked(src, out, overwrite, tensors, qconfig, result)


def _write_locked(
    src: Source, out: Path, overwrite: bool, tensors: dict, qconfig: dict, result: ExportResult
) -> None:
    tmp = make_temporary(out)  # marked: a kill -9 leaves nothing the next run does not clean
    try:
        cfg = serving_config(src)
        cfg["quantization_config"] = qconfig
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        for f in sorted(src.path.iterdir()):  # tokenizer, generation config, chat template ...
            if f.is_file() and f.name not in _NOT_COPIED and not f.name.endswith(".safetensors"):
                _check_inside(f, src.path)
                shutil.copy2(f, tmp / f.name)
        sd = {k: v.contiguous() for k, v in {**src.plain_tensors(), **tensors}.items()}
        write_safetensors(tmp, sd, {"format": "pt"})
        report = {
            "source": str(src.path),
            "format": result.format,
            "summary": result.summary(),
            "notes": result.notes,
            "layers": [asdict(r) for r in result.records],
        }
        (tmp / MARKER).write_text(json.dumps(report, indent=2))
        check_export_dir(out, overwrite, src.path)  # again: the folder may have changed meanwhile
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
