"""Resume inside a streamed layer, expert by expert (issue 71, item 4: "resume after kill -9 works per
expert").

A streamed run commits once per decoder layer (:mod:`bitmosaic.pipeline.stream`).  A mixture-of-experts
layer is long -- about two minutes for a Qwen3-30B-A3B layer on 2 cores, over an hour for a
DeepSeek-V3 layer -- so a ``kill -9`` inside it would throw that work away.  :class:`LayerJournal` keeps
what the layer has finished: each time the loop solves the linears that read one Hessian (one expert's
``gate_proj`` + ``up_proj``, one expert's ``down_proj``, the attention's ``q/k/v``...), their packed
modules, final report rows and static input scales go to one file ``unit-NNNNN.safetensors`` in
``layer-LLLLL/`` of the run's work folder, written to a temporary name and renamed (a kill leaves whole
units only).  The layer's shard, committed by ``progress.json``, replaces the journal.

A rerun of the same command (the run's fingerprint is checked by ``progress.json``, which the first unit
writes if the layer is the run's first) redoes the layer's *statistics* passes -- cheap beside the solves
-- and, where the loop would solve a Hessian whose linears are all journaled, installs the journaled
modules instead: the dequantized weights go in place as the solve put them (the packing check makes them
the solve's own values), the rows and bit totals are appended in the same order, the input quantizers
get the same scales.  So the layer's remaining groups calibrate on exactly the weights an uninterrupted
run had, and the output has its bytes (tested with a kill between experts and with ``kill -9`` of the
CLI).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from ..io.saved.shards import tensors_for_save, write_shard
from ..modules.qmodules import module_from_layer_config

__all__ = ["LayerJournal", "journal_dir", "jsonable"]

_UNIT = "unit-{:05d}.safetensors"


def journal_dir(work: Path, li: int) -> Path:
    """The journal folder of layer ``li`` in a streamed run's work folder."""
    return Path(work) / f"layer-{li:05d}"


def jsonable(v):
    """``json.dumps``' ``default`` for report rows: tensors and numpy scalars as plain values."""
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if hasattr(v, "item"):
        return v.item()
    return str(v)


class LayerJournal:
    """The finished units of one streamed layer (module doc).  ``begin()`` is called before the first
    unit is written (the store makes sure its ``progress.json`` exists, so a rerun is checked against
    the run's fingerprint)."""

    def __init__(self, folder: Path, begin=None) -> None:
        self.folder, self._begin = Path(folder), begin
        self.where: dict[str, Path] = {}  # linear name -> the unit file that holds it
        self.count = 0
        if not self.folder.is_dir():
            return
        for tmp in self.folder.glob("*.tmp"):  # a unit a killed run was writing
            tmp.unlink(missing_ok=True)
        while (f := self.folder / _UNIT.format(self.count)).is_file():
            with safe_open(str(f), "pt") as fh:
                names = json.loads(fh.metadata()["unit"])["names"]
            self.where.update(dict.fromkeys(names, f))
            self.count += 1

    def __len__(self) -> int:
        return len(self.where)

    def solved(self, names) -> bool:
        """Whether every linear of ``names`` was journaled (then :meth:`take` gives them back)."""
        return all(n in self.where for n in names)

    def take(self, names) -> list[tuple[str, nn.Module, dict, torch.Tensor | None]]:
        """``(name, packed module, report row, static input scale)`` of each journaled linear of ``names``,
        in the order they were solved."""
        out = []
        for f in dict.fromkeys(self.where[n] for n in names):
            unit = json.loads(_metadata(f)["unit"])
            tensors = load_file(str(f))
            for name, cfg, row in zip(unit["names"], unit["configs"], unit["rows"], strict=True):
                q = module_from_layer_config(cfg)
                pre = f"m::{name}::"
                q.load_state_dict({k[len(pre) :]: v for k, v in tensors.items() if k.startswith(pre)},
                                  strict=True, assign=True)  # fmt: skip
                out.append((name, q, row, tensors.get(f"s::{name}")))
        return out

    def add(self, solved: list[tuple[str, nn.Module, dict, torch.Tensor | None]]) -> None:
        """Journal one unit: ``(name, packed module, final report row, static input scale)`` each."""
        if not solved:
            return
        if self.count == 0:
            if self._begin is not None:
                self._begin()
            self.folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, q, _, scale in solved:
            tensors.update({f"m::{name}::{k}": v for k, v in q.state_dict().items()})
            if scale is not None:
                tensors[f"s::{name}"] = scale
        unit = {"names": [s[0] for s in solved], "configs": [s[1].layer_config() for s in solved],
                "rows": [s[2] for s in solved]}  # fmt: skip
        f = self.folder / _UNIT.format(self.count)
        meta = {"format": "pt", "unit": json.dumps(unit, default=jsonable)}
        write_shard(f, tensors_for_save(tensors), meta)
        self.where.update(dict.fromkeys(unit["names"], f))
        self.count += 1

    def clear(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.where, self.count = {}, 0


def _metadata(f: Path) -> dict:
    with safe_open(str(f), "pt") as fh:
        return fh.metadata()
