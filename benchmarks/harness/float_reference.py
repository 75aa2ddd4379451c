"""The float reference of a verdict run's KL and top-1, its final hidden states kept per window.

A verdict row scores every WikiText-2 test window twice: once through the quantized model, once
through the float reference (KL and top-1 from the same pass).  The reference never changes inside a
run, so :class:`CachedReference` keeps its decoder's last hidden states per window and from then on
re-applies only the output head.  With ``store`` it also keeps them on disk, so the next run of any
benchmark on the same weights, windows, threads and device skips the reference's forward from its
first row on.

Exact, never approximate:

* used only where ``head(decoder(x))`` gives the whole forward's logits bit for bit, decided on the
  first window (a Gemma-2 style logit softcap is not: there every window runs the whole model);
* the in-memory cache is dropped whenever the reference's tensors change in place (their version
  counters); the on-disk one is keyed by a SHA-256 of every parameter and buffer (names, dtypes,
  shapes, bytes), the torch and transformers versions, the model's class, config and attention
  implementation, the thread count and the device, since a CPU's reduction order -- and so the last
  bits -- can follow the thread count;
* each window's file is written to a temporary path and renamed, so an interrupted run leaves no
  partial file behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from bitmosaic.io.saved.outdir import atomic_write_text

__all__ = ["CachedReference", "default_store"]


def default_store() -> Path:
    """Where verdict runs keep reference hidden states unless ``--reference-cache`` says otherwise:
    ``$XDG_CACHE_HOME/bitmosaic/reference`` (``~/.cache/...``); about 0.7 GB per model and thread
    count for SmolLM2-135M on the whole WikiText-2 test set."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "bitmosaic" / "reference"


def _weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    named = dict(model.named_parameters())
    named.update(dict(model.named_buffers()))
    for name in sorted(named):
        t = named[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _code_of(model: torch.nn.Module) -> str:
    """What besides the weights decides the logits: the torch and transformers versions, the model's
    class, its config and attention implementation."""
    import transformers

    cfg = getattr(model, "config", None)
    parts = [torch.__version__, transformers.__version__, type(model).__qualname__]
    if cfg is not None:
        parts += [cfg.to_json_string(use_diff=False), str(getattr(cfg, "_attn_implementation", None))]
    return "|".join(parts)


class CachedReference(torch.nn.Module):
    """``model`` (a Hugging Face causal LM, the float reference) whose calls answer with the same
    logits, from kept decoder hidden states where it has seen the window before (see the module doc);
    ``store``: a folder to keep them across runs (None: in memory only)."""

    def __init__(self, model: torch.nn.Module, store: str | os.PathLike | None = None) -> None:
        super().__init__()
        self.inner = model
        self.hidden: dict[bytes, torch.Tensor] = {}
        self.exact: bool | None = None  # head(base(x)) == model(x), decided on the first window
        self.store = Path(store) if store is not None else None
        self.loaded = 0  # windows read back from the store (the tests and the run's log read it)
        self._state = self._fingerprint()
        self._folder: Path | None = None

    def _fingerprint(self) -> tuple:
        return tuple((id(t), t._version) for t in (*self.inner.parameters(), *self.inner.buffers()))

    def _disk(self) -> Path | None:
        """This reference's folder in the store (its weights' digest; computed once per weights)."""
        if self.store is None:
            return None
        if self._folder is None:
            dev = next(self.inner.parameters()).device.type
            threads = str(torch.get_num_threads())
            key = "|".join([_weights_digest(self.inner), _code_of(self.inner), threads, dev])
            self._folder = self.store / hashlib.sha256(key.encode()).hexdigest()[:32]
            meta = self._folder / "exact.json"
            if self.exact is None and meta.is_file():
                self.exact = bool(json.loads(meta.read_text())["exact"])
        return self._folder

    def _read(self, key: bytes) -> torch.Tensor | None:
        folder = self._disk()
        if folder is None or self.exact is not True:
            return None
        path = folder / f"{hashlib.sha256(key).hexdigest()[:32]}.pt"
        if not path.is_file():
            return None
        h = torch.load(path, map_location=next(self.inner.parameters()).device, weights_only=True)
        self.loaded += 1
        return h

    def _write(self, key: bytes, h: torch.Tensor) -> None:
        folder = self._disk()
        if folder is None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        meta = folder / "exact.json"
        if not meta.is_file():
            atomic_write_text(meta, json.dumps({"exact": bool(self.exact)}))
        if self.exact:
            path = folder / f"{hashlib.sha256(key).hexdigest()[:32]}.pt"
            _atomic(path, lambda f: torch.save(h.detach().to("cpu").clone(), f))

    def forward(self, batch: torch.Tensor, use_cache: bool = False):
        m = self.inner
        if not (hasattr(m, "get_decoder") and hasattr(m, "get_output_embeddings")):
            return m(batch, use_cache=False)
        state = self._fingerprint()
        if state != self._state:  # the weights changed in place: nothing kept is theirs
            self.hidden.clear()
            self._state, self._folder, self.exact = state, None, None
        self._disk()  # a stored verdict on exactness counts as this run's
        if self.exact is False:
            return m(batch, use_cache=False)
        key = batch.cpu().numpy().tobytes() + str(tuple(batch.shape)).encode()
        h = self.hidden.get(key)
        if h is None:
            h = self._read(key)
        if h is None:
            h = m.get_decoder()(batch, use_cache=False).last_hidden_state
            if self.exact is None:
                full = m(batch, use_cache=False).logits
                self.exact = torch.equal(m.get_output_embeddings()(h), full)
                if not self.exact:
                    self._write(key, h)  # records that this model needs the whole forward
                    return SimpleNamespace(logits=full)
            self._write(key, h)
        self.hidden[key] = h
        return SimpleNamespace(logits=m.get_output_embeddings()(h))


def _atomic(path: Path, write) -> None:
    """``write(binary file)`` into a temporary file beside ``path``, then renamed onto it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
