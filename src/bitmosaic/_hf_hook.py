"""Register bitmosaic's quantizer with transformers as soon as transformers' registry exists.

``import bitmosaic`` calls :func:`install`.  When ``transformers.quantizers.auto`` is already
imported the registration happens at once; otherwise a one-shot import hook waits for it and
registers right after that module has run -- before ``from_pretrained`` can consult the registry,
since ``from_pretrained`` imports it.  This keeps ``import bitmosaic`` (and its data-format
subpackages) free of transformers' import time.  Standard library only.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_TARGET = "transformers.quantizers.auto"


def _register() -> None:
    mod = sys.modules.get(f"{__package__}.io.saved.hf_integration")
    if mod is not None and not hasattr(mod, "register"):
        return  # it is importing transformers' registry right now, and registers at its own end
    from .io.saved.hf_integration import register

    register()


class _RegisterAfter(importlib.abc.Loader):
    """Runs the real loader of the registry module, then registers bitmosaic."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _register()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # one shot; find the real spec with the other finders
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfter(spec.loader)
        return spec


def install() -> None:
    if _TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
