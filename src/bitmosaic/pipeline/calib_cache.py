"""On-disk cache of the calibration statistics that quantization runs can share.

**What is shareable.**  The pipeline (:mod:`bitmosaic.pipeline.pipeline`) is sequential: the inputs of
decoder layer ``i > 0`` -- and of every group of a layer after its first -- are computed by the
already *quantized* earlier layers and groups, so they, their Hessians ``2/n XᵀX`` and their
activation statistics differ from method to method (and from config to config).  Only statistics of
the *float* model can be shared, and only these are consumed from it:

``inputs``
    The hidden states entering decoder layer 0 and the keyword arguments (rotary embeddings,
    masks, positions) every kind of layer receives
    (:func:`~bitmosaic.pipeline.calibration.capture_layer_inputs`).
    Every calibrating method (and static activation scales) starts from them.
``captures``
    The float statistics of layer 0's groups that a smoothing ``transform`` reads
    (:func:`~bitmosaic.pipeline.capture.capture_groups`): per-channel ``max|x|`` and ``mean|x|``, the
    Hessian and the seeded token sample (its size, the config's ``max_tokens``, is part of the key,
    so methods whose transforms sample the same number of tokens share an entry), plus ``mean x``
    (so the observer is whole) and the state of the sample generator after the capture, so the later
    layers draw the very same samples.  Layer 0 only: the transforms of later
    layers see inputs from quantized layers.
``fisher``
    The Fisher-diagonal salience of every decoder linear (the pipeline's Fisher service,
    :mod:`bitmosaic.pipeline.fisher`, for methods whose ``prepare`` asks for it), computed with the
    whole float model.

Not cached: Hessians and observers of the sequential pass (per-channel statistics for static masks and
static activation scales are gathered there too), since they depend on how earlier layers were
quantized.  (The one exception, the Hessian of layer 0's first group -- q/k/v read the float
layer-0 inputs when no transform changed layer 0 -- is about 1/(4L) of the pass and is not cached.)
No pipeline mode gathers Hessians on float inputs (a "non-sequential" GPTQ), so there are no float
Hessians per linear to share beyond layer 0's captures above.

**Keys.**  One scheme for every kind (:func:`cache_key`, also Fisher's): SHA-256 of the model's
config, a checksum (shape, sum, sum of magnitudes) of every tensor the entry depends on, the exact
calibration token tensor (which fixes data, sample count, sequence length and the sampling seed),
a format version and the run settings the values depend on (batch size, device, compute dtype,
seed, threads, torch version), so a hit returns bit for bit what the run would compute.  Fisher's
key checksums the decoder linears only (its original scheme, kept so entries stored before this
module stay valid): two models that differ only in embeddings or norms would share an entry.

**Storage.**  ``<root>/<kind>/<key>.safetensors``; ``root`` is ``$BITMOSAIC_CACHE`` or
``~/.cache/bitmosaic`` (``--cache-dir`` / ``--no-cache`` on ``quantize`` and ``compare``).  Each entry
is written to a temporary file and renamed into place (a crash leaves no partial entry) and holds a
SHA-256 of its tensors, checked on load: an entry that does not load or whose checksum differs is
reported in one warning line, deleted and recomputed.  After each write the oldest entries are
deleted while the folder holds more than ``$BITMOSAIC_CACHE_MAX_GB`` (default 20) GB.  The layer-0
inputs take ``samples x seqlen x hidden`` values of the model's dtype (SmolLM2-135M, 128 x 2048 in
float32: 604 MB), so a hit trades a read for one embedding pass -- the big saving is Fisher's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from ..paths import default_cache_root
from .capture import GroupCapture, capture_groups, foldable, gqa_tie

__all__ = ["CalibCache", "RunCache", "cache_key", "default_cache_root"]

FORMAT_VERSION = 1
_META = "bitmosaic_tree"
_ENTRY = re.compile(r"[0-9a-f]{24}\.safetensors")


def cache_key(
    model: nn.Module,
    tokens: torch.Tensor,
    tensors: list[tuple[str, torch.Tensor]],
    version: int,
    extra: dict | None = None,
) -> str:
    """Hex key of (model config, checksums of ``tensors`` [(label, tensor)], exact ``tokens``,
    ``version``, ``extra`` settings).  Without ``extra`` this is the Fisher cache's original key."""
    h = hashlib.sha256()
    cfg = getattr(model, "config", None)
    h.update(json.dumps(cfg.to_dict() if cfg is not None else {}, sort_keys=True, default=str).encode())
    for n, w in tensors:
        w = w.detach()
        h.update(
            f"{n}:{tuple(w.shape)}:{float(w.double().sum()):.17g}:{float(w.double().abs().sum()):.17g}".encode()
        )
    t = tokens.to(torch.int64).cpu().contiguous()
    h.update(str(tuple(t.shape)).encode())
    h.update(t.numpy().tobytes())
    h.update(f"v{version}".encode())
    if extra:
        h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()[:24]


# -- one entry: a tree of dicts/lists/tuples/scalars with tensor leaves, in one safetensors file ------
class _Uncacheable(Exception):
    """The value holds something other than tensors, containers and scalars."""


def _flatten(obj, tensors: dict[str, torch.Tensor], seen: dict[int, str], storages: set[int]):
    if torch.is_tensor(obj):
        name = seen.get(id(obj))
        if name is None:  # one tensor referenced twice is stored once and shared again on load
            name = seen[id(obj)] = f"t{len(seen)}"
            t = obj.detach().cpu()
            if t.untyped_storage().data_ptr() in storages or not t.is_contiguous():
                t = t.clone(memory_format=torch.contiguous_format)  # views of one storage: copies
            storages.add(t.untyped_storage().data_ptr())
            tensors[name] = t
        return {"t": name}
    if obj is None or isinstance(obj, bool | int | float | str):
        return {"v": obj}
    if isinstance(obj, tuple | list):
        return {type(obj).__name__: [_flatten(o, tensors, seen, storages) for o in obj]}
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        return {"dict": [[k, _flatten(v, tensors, seen, storages)] for k, v in obj.items()]}
    raise _Uncacheable(type(obj).__name__)


def _unflatten(node, tensors: dict[str, torch.Tensor]):
    (kind, val), = node.items()  # fmt: skip
    if kind == "t":
        return tensors[val]
    if kind == "v":
        return val
    if kind in ("tuple", "list"):
        items = [_unflatten(o, tensors) for o in val]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: _unflatten(v, tensors) for k, v in val}
    raise ValueError(f"unknown node {kind!r}")


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def write_entry(path: Path, obj) -> None:
    """Store ``obj`` at ``path`` atomically (temporary file, then rename).  Raises ``_Uncacheable``."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    tree = _flatten(obj, tensors, {}, set())
    meta = {_META: json.dumps(tree), "sha256": _digest(tensors), "format": str(FORMAT_VERSION)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_entry(path: Path):
    """The value stored at ``path``; ``ValueError``/``OSError``/``SafetensorError`` when damaged.
    A file without a tree (a Fisher entry written before this module) is a flat {name: tensor}."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no mapping)
    if _META not in meta:
        return tensors
    if meta.get("format") != str(FORMAT_VERSION) or _digest(tensors) != meta.get("sha256"):
        raise ValueError("checksum mismatch")
    try:
        return _unflatten(json.loads(meta[_META]), tensors)
    except (KeyError, TypeError) as e:
        raise ValueError(f"bad structure ({e})") from None


class CalibCache:
    """A cache folder plus what this process found in it.

    ``root``: a folder, ``"auto"`` (:func:`default_cache_root`) or ``None`` (off: nothing is read or
    written, and Fisher is not cached either).  ``dirs`` overrides the folder of one kind (Fisher's
    ``fisher_cache`` option).  ``max_gb``: size cap (default ``$BITMOSAIC_CACHE_MAX_GB`` or 20).
    ``hits`` / ``misses`` / ``corrupt`` list the kinds looked up, in order."""

    def __init__(self, root="auto", *, dirs: dict[str, Path] | None = None, max_gb: float | None = None):
        self.root = None if root is None else default_cache_root() if root == "auto" else Path(root)
        self.dirs = {k: Path(v) for k, v in (dirs or {}).items()}
        if max_gb is None:
            env = os.environ.get("BITMOSAIC_CACHE_MAX_GB", "20")
            try:
                max_gb = float(env)
            except ValueError:
                raise ValueError(f"BITMOSAIC_CACHE_MAX_GB={env!r} is not a size in GB; set e.g. 20") from None
        self.max_bytes = int(max_gb * 2**30)
        self.hits: list[str] = []
        self.misses: list[str] = []
        self.corrupt: list[str] = []
        self.load_seconds = 0.0

    @property
    def enabled(self) -> bool:
        return self.root is not None or bool(self.dirs)

    def path(self, kind: str, key: str) -> Path | None:
        folder = self.dirs.get(kind) or (self.root / kind if self.root is not None else None)
        return None if folder is None else folder / f"{key}.safetensors"

    def load(self, kind: str, key: str, valid=None):
        """The entry, or ``None`` (a miss; a damaged entry or one ``valid(value)`` rejects is
        deleted with a one-line warning)."""
        path = self.path(kind, key)
        if path is None or not path.is_file():
            self.misses.append(kind)
            return None
        from safetensors import SafetensorError

        t0 = time.perf_counter()
        try:
            value = read_entry(path)
            if valid is not None and not valid(value):
                raise ValueError("unexpected contents")
        except (OSError, ValueError, SafetensorError) as e:  # unreadable, truncated, checksum
            warnings.warn(f"calibration cache: {path} is damaged ({e}); recomputing it", stacklevel=2)
            path.unlink(missing_ok=True)
            self.corrupt.append(kind)
            self.misses.append(kind)
            return None
        os.utime(path)  # recently used: evicted last
        self.load_seconds += time.perf_counter() - t0
        self.hits.append(kind)
        return value

    def store(self, kind: str, key: str, value) -> bool:
        """Write the entry (False when off, or when ``value`` holds objects a file cannot)."""
        path = self.path(kind, key)
        if path is None:
            return False
        try:
            write_entry(path, value)
        except _Uncacheable as e:
            warnings.warn(f"calibration cache: {kind} holds a {e} and is not cached", stacklevel=2)
            return False
        except OSError as e:  # full disk, no permission: the run goes on without the entry
            warnings.warn(f"calibration cache: cannot write {path} ({e}); not cached", stacklevel=2)
            return False
        if kind not in self.dirs:  # a folder given for one kind is the user's: never pruned
            self._evict(path)
        return True

    def _evict(self, keep: Path) -> None:
        """Delete the least recently used entries under ``root`` (only files named like entries, in
        the kinds' folders) while they hold more than the cap; never ``keep``.  Temporary files of
        writers killed over a day ago go too."""
        for tmp in self.root.glob("*/*.safetensors.tmp*"):  # left by a killed writer a day ago
            st = _stat(tmp)
            if _ENTRY.fullmatch(tmp.name.split(".tmp")[0]) and st and time.time() - st.st_mtime > 86400:
                tmp.unlink(missing_ok=True)
        files = [(st, p) for p in self.root.glob("*/*.safetensors")
                 if _ENTRY.fullmatch(p.name) and p != keep and (st := _stat(p))]  # fmt: skip
        files.sort(key=lambda f: f[0].st_mtime)
        kept = _stat(keep)
        total = sum(st.st_size for st, _ in files) + (kept.st_size if kept else 0)
        for st, p in files:
            if total <= self.max_bytes:
                break
            total -= st.st_size
            p.unlink(missing_ok=True)

    def summary(self) -> dict:
        return {"root": None if self.root is None else str(self.root), "hits": list(self.hits),
                "misses": list(self.misses), "corrupt": list(self.corrupt),
                "load_seconds": self.load_seconds}  # fmt: skip

    def bind(self, model, layers, calib, *, batch_size, device, compute_dtype, seed) -> RunCache:
        return RunCache(self, model, layers, calib, batch_size, device, compute_dtype, seed)


class RunCache:
    """A :class:`CalibCache` bound to one pipeline run: the key parts its entries share are fixed
    when it is made, before anything changes the model (config, checksums of every tensor outside
    the decoder stack and of layer 0, the calibration tokens, batch size, device, threads); layer 0's
    captures add the compute dtype, the seed and the sample size."""

    def __init__(self, cache, model, layers, calib, batch_size, device, compute_dtype, seed) -> None:
        self.cache = cache
        if not cache.enabled:
            return
        inside = {id(t) for t in layers.parameters()} | {id(t) for t in layers.buffers()}
        named = [*model.named_parameters(), *model.named_buffers()]
        tensors = [(f"{n}:{t.dtype}", t) for n, t in named if id(t) not in inside]
        first = [*layers[0].named_parameters(), *layers[0].named_buffers()]
        tensors += [(f"layer0.{n}:{t.dtype}", t) for n, t in first]
        dev = torch.device(device)
        env = {"batch_size": batch_size, "device": dev.type, "torch": torch.__version__,
               "threads": torch.get_num_threads(),
               "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None}  # fmt: skip
        self.base = cache_key(model, calib, tensors, FORMAT_VERSION, env)
        self.run = {"compute_dtype": str(compute_dtype), "seed": seed}

    def layer_inputs(self, model, layers, calib, batch_size, device, capture):
        """``capture(model, layers, calib, batch_size, device)`` (layer-0 inputs, kwargs by kind),
        from the cache when it holds them (then on the CPU: the pipeline moves them)."""
        if not self.cache.enabled:
            return capture(model, layers, calib, batch_size, device)
        key = _sub_key(self.base, kind="inputs")
        got = self.cache.load("inputs", key, lambda v: isinstance(v, dict) and set(v) == {"first", "kwargs"})
        if got is not None:
            return list(got["first"]), {k: list(v) for k, v in got["kwargs"].items()}
        first, kwargs = capture(model, layers, calib, batch_size, device)
        self.cache.store("inputs", key, {"first": first, "kwargs": kwargs})
        return first, kwargs

    def group_captures(self, layer, arch, inputs, kwargs, *, max_tokens, generator) -> list[GroupCapture]:
        """:func:`capture_groups` of the float layer 0 on its float inputs, from the cache when it
        holds them; ``generator`` is left in the state the capture leaves it in either way."""
        if not self.cache.enabled:
            return capture_groups(layer, arch, inputs, kwargs, max_tokens=max_tokens, generator=generator)
        key = _sub_key(self.base, kind="captures", max_tokens=max_tokens, **self.run,
                       generator=_digest({"g": generator.get_state()}))  # fmt: skip
        n = sum(1 for i, g in enumerate(arch.groups(layer)) if g and not arch.expert_group(i))
        got = self.cache.load(
            "captures", key, lambda v: set(v) == {"groups", "generator"} and len(v["groups"]) == n
        )
        if got is not None:
            generator.set_state(got["generator"])
            return [_capture_from(layer, arch, g.get("index", i), g) for i, g in enumerate(got["groups"])]
        caps = capture_groups(layer, arch, inputs, kwargs, max_tokens=max_tokens, generator=generator)
        groups = [
            {
                "index": c.index,
                "hessian": c.hessian,
                "sample": c.sample,
                "absmax": c.observer.channel_absmax,
                "abssum": c.observer.channel_abssum,
                "sum": c.observer.channel_sum,
                "tokens": c.observer.tokens,
                "batches": c.observer.batches,
            }
            for c in caps
        ]
        self.cache.store("captures", key, {"groups": groups, "generator": generator.get_state()})
        return caps


def _stat(p: Path) -> os.stat_result | None:
    try:  # another process may remove it meanwhile
        return p.stat()
    except FileNotFoundError:
        return None


def _sub_key(base: str, **parts) -> str:
    return hashlib.sha256(json.dumps({"base": base, **parts}, sort_keys=True).encode()).hexdigest()[:24]


def _capture_from(layer, arch, i: int, g: dict) -> GroupCapture:
    from ..algorithms.observers import ActObserver

    names = arch.groups(layer)[i]
    obs = ActObserver(g["absmax"].shape[0])
    obs.channel_absmax, obs.channel_abssum, obs.channel_sum = g["absmax"], g["abssum"], g["sum"]
    obs.tokens, obs.batches = g["tokens"], g["batches"]
    return GroupCapture(
        index=i,
        names=tuple(names),
        observer=obs,
        hessian=g["hessian"],
        sample=g["sample"],
        weights={n: layer.get_submodule(n).weight.detach().float().clone() for n in names},
        foldable=foldable(layer, arch, i),
        tie=gqa_tie(layer, arch, i),
    )
