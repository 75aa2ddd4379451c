"""Faster decode: a static KV cache and a ``torch.compile``-d decode step behind plain ``model.generate``.

Eager decoding of a small model on the CPU spends most of each token in Python: transformers' forward
issues thousands of tiny aten calls per token.  :func:`enable_compiled_decode` sets the model's
``generation_config`` so that transformers' own ``generate`` (5.x, ``GenerationMixin``) does the rest:

* ``cache_implementation="static"``: a preallocated KV cache (``StaticCache``) of the prompt plus the new
  tokens, so every decode step has the same shapes;
* ``compile_config=CompileConfig(fullgraph=True, dynamic=False, options={"size_asserts": False})`` with
  ``_compile_all_devices=True`` (without it ``_valid_auto_compile_criteria`` compiles on accelerators
  only): ``generate`` then runs the prefill eagerly and every later step through
  ``model.get_compiled_call`` -- one inductor graph, compiled on the first ``generate`` and reused.

The graph is whole (``fullgraph=True``: a graph break is an error, not a silent slowdown) because every
bitmosaic kernel is a ``torch.library`` operator with a fake implementation
(:mod:`bitmosaic.kernels.ops`); the kernel weights are built first (:func:`prepare_kernels`, and the
integer-activation kernels of layers that have an activation quantizer), so the trace never builds one.

Guards (``guards="model"``, the default): before each call of a compiled graph dynamo checks its guards,
and on a quantized model most of them are on the modules (every parameter and buffer, every attribute
the forward reads, every hook dictionary: about 12,000 on SmolLM2, 3.5 ms of a 17.5 ms token measured
with ``torch.profiler``, "TorchDynamo Cache Lookup").  The default skips those
(``torch.compiler``'s ``guard_filter_fn``) and keeps what they protected another way: the step is a
function with a code object of its own per call of :func:`enable_compiled_decode` (dynamo keeps its
compiled graphs on the code object, so a graph is only ever looked up for this model -- with the module
guards skipped, a second model of the same class would otherwise run the first one's graph; tested),
and it compiles again when bitmosaic changes how a module computes (:mod:`bitmosaic.modules.changes`:
``set_runtime_head``, ``set_runtime_activations``, ``set_weight_cache``).  Parameters and buffers are
still read at every call, so weights changed in place are seen.  Not seen: modules replaced or their
attributes changed by hand after the call -- call :func:`enable_compiled_decode` again, or pass
``guards="full"`` (dynamo's own guards, transformers' compiled ``self.__call__``).

By default (issue 74) every bitmosaic load path turns this on (:func:`default_compiled_decode`:
``bitmosaic.load``, ``from_pretrained`` of a bitmosaic folder, ``bitmosaic generate``), except for a
mixture of experts, a model not on the CPU, or ``compile=False`` / ``$BITMOSAIC_NO_COMPILE=1``; a step
that fails to compile decodes eagerly after one line on stderr.  The first call of a step says on stderr
that it compiles, and the compiled code is cached across processes (:func:`inductor_cache_dir`, inductor's
FX-graph and AOT-autograd caches: a later process traces the step again but compiles nothing).

Cost and scope: the first ``generate`` compiles (inductor's C++ codegen; about a minute for SmolLM2-135M
on this CPU, ``benchmarks/decode/decode.py`` reports it apart from the decode rate); later calls with the same
``max_new_tokens``, prompt length bucket and batch size reuse the graph, and another cache length
compiles again.  It helps where Python overhead dominates a token (small models, batch 1); it changes no
number beyond float32 reassociation by inductor's fused element-wise kernels (tested against eager:
``tests/io/test_compiled_decode.py``).  Call it after
:func:`~bitmosaic.modules.intact.set_runtime_activations` (a later change of the activation path needs
:func:`disable_compiled_decode` and a new call).
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch import nn

from .base import QuantModule, prepare_kernels
from .changes import changes

__all__ = [
    "enable_compiled_decode",
    "disable_compiled_decode",
    "default_compiled_decode",
    "compile_config",
    "default_inductor_options",
    "inductor_cache_dir",
    "compile_opted_out",
    "NO_COMPILE_ENV",
    "GUARDS",
]

NO_COMPILE_ENV = "BITMOSAIC_NO_COMPILE"


def compile_config(options: dict | None = None):
    """The ``transformers.CompileConfig`` :func:`enable_compiled_decode` installs (``options``: inductor
    options, e.g. ``{"cpp_wrapper": True}``)."""
    from transformers import CompileConfig

    # no size/stride assertion on every graph input per step (the packed weights are ~1500 inputs in
    # SmolLM2: about 1 ms a token measured, cProfile); torch.compile takes options or a mode, not both
    opts = {"size_asserts": False, **(options or {})}
    cfg = CompileConfig(fullgraph=True, dynamic=False, mode=None, options=opts)
    cfg._compile_all_devices = True  # not a dataclass field: set on the instance (compile on the CPU too)
    return cfg


GUARDS = ("model", "full")


def default_inductor_options() -> dict:
    """The inductor options of the default compiled step (:func:`default_compiled_decode`): the step's
    entry as C++ (``cpp_wrapper``: no Python between the kernels of a token) built apart from the kernels
    at -O1 (``cpp_wrapper_build_separate``: the first compile about as long as the Python wrapper's, where
    one build of both at -O3 ran over 11 minutes on a 2-core VM).  Measured on SmolLM2 with 16-bit
    run-time activations: +2-14% tokens/s over the Python wrapper (``benchmarks/results/decode_a16_r3.md``,
    ``decode_a16_r2.md``).  Empty where this torch lacks ``cpp_wrapper_build_separate``."""
    from torch._inductor import config

    if not hasattr(config, "cpp_wrapper_build_separate"):
        return {}
    return {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}


def _skip_module_guards(entries) -> list[bool]:
    """``guard_filter_fn``: keep every guard but those on the modules (``guards="model"``, module doc)."""
    return [not e.orig_guard.source.is_unspecialized_nn_module() for e in entries]


def inductor_cache_dir() -> str:
    """Where the compiled decode steps are cached across processes: ``$TORCHINDUCTOR_CACHE_DIR`` when the
    user set it, else ``inductor/`` under bitmosaic's cache root (``$BITMOSAIC_CACHE``, else
    ``~/.cache/bitmosaic``)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from ..paths import default_cache_root

    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env and os.path.abspath(env) != os.path.abspath(default_cache_dir()):  # torch writes its default
        return env
    return str(default_cache_root() / "inductor")


@contextlib.contextmanager
def _cache_in(path: str):
    """``$TORCHINDUCTOR_CACHE_DIR`` = ``path`` while a step runs (inductor reads it when it compiles or
    looks a graph up in its FX-graph and AOT caches), the previous value afterwards: other
    ``torch.compile`` calls of the process keep their own cache."""
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


class _CompiledStep:
    """The model's compiled decode step for ``guards="model"`` (module doc): ``model(*args, **kwargs)``
    through ``torch.compile`` with the module guards skipped, from a function whose code object is this
    step's own, compiled again when :func:`~bitmosaic.modules.changes.changes` moves.  Its compiled code
    is cached in :func:`inductor_cache_dir` (inductor's FX-graph and AOT-autograd caches: a later process
    traces the step again but compiles nothing); the first call of each compile says so on stderr.
    ``fallback``: a step that fails to compile says so in one line on stderr and runs eagerly from then
    on (the default path, :func:`default_compiled_decode`), instead of raising."""

    def __init__(self, model: nn.Module, config, fallback: bool = False) -> None:
        self.model = model
        self.kwargs = config.to_dict()
        options = self.kwargs.get("options") or {}
        self.kwargs["options"] = {**options, "guard_filter_fn": _skip_module_guards, "fx_graph_cache": True}
        self.fallback = fallback
        self.eager = False
        self._cache = inductor_cache_dir()
        self._compile()

    def _compile(self) -> None:
        model = self.model

        def step(*args, **kwargs):
            return model(*args, **kwargs)

        step.__code__ = step.__code__.replace()  # a new code object: dynamo's graph cache of this step alone
        self._at = changes(model)
        self._fn = torch.compile(step, **self.kwargs)
        self._announced = False

    def _announce(self) -> None:
        print(
            f"bitmosaic: compiling the decode step of {type(self.model).__name__} (the first time up to a "
            f"minute or two on a CPU for a small model, a few seconds once cached in {self._cache}; "
            f"{NO_COMPILE_ENV}=1 or bitmosaic.load(..., compile=False) decodes eagerly)",
            file=sys.stderr,
            flush=True,
        )
        self._announced = True

    def __call__(self, *args, **kwargs):
        if self.eager:
            return self.model(*args, **kwargs)
        if changes(self.model) != self._at:
            self._compile()
        if not self._announced:
            self._announce()
        with _cache_in(self._cache):
            if not self.fallback:
                return self._fn(*args, **kwargs)
            try:
                return self._fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 -- any compile failure: eager, which raises real errors
                print(
                    f"bitmosaic: the decode step did not compile ({_one_line(e)}); decoding eagerly",
                    file=sys.stderr,
                    flush=True,
                )
                self.eager = True
        return self.model(*args, **kwargs)


def _prepare(model: nn.Module) -> None:
    """Build every kernel weight now, outside the trace."""
    prepare_kernels(model)
    for m in model.modules():
        if isinstance(m, QuantModule) and m.act_quantizer() is not None:
            with torch.no_grad():
                m.runs_int_act(torch.empty(0, m.in_features))  # builds the integer kernel where it runs


def _refusal(model: nn.Module) -> str | None:
    """Why ``model``'s decode step cannot be one static graph, or ``None``."""
    gc = getattr(model, "generation_config", None)
    if gc is None or not hasattr(model, "generate"):
        return (
            f"{type(model).__name__} has no generation_config/generate: compiled decode needs a "
            "transformers causal LM (load it with bitmosaic.io.load_quantized or load_model)"
        )
    from .experts import RoutedExperts

    if any(isinstance(m, RoutedExperts) for m in model.modules()):
        return (
            "compiled decode needs the step as one static graph, but this mixture of experts picks its "
            "experts per token (data-dependent); decode it without enable_compiled_decode"
        )
    return None


def enable_compiled_decode(
    model: nn.Module, options: dict | None = None, guards: str = "model", *, fallback: bool = False
) -> nn.Module:
    """Make ``model.generate(...)`` decode with a static KV cache and a compiled step (module doc); returns
    ``model``.  ``options``: inductor options for the compile (default none); ``guards``: ``"model"``
    (default: no guards on the modules, a step of this model's own) or ``"full"`` (module doc);
    ``fallback``: a step that fails to compile decodes eagerly (one line on stderr) instead of raising
    (``guards="model"`` only).  Raises ``ValueError`` for a model without a ``generation_config`` (not a
    transformers generative model), a mixture of experts, or an unknown ``guards``."""
    reason = _refusal(model)
    if reason is not None:
        raise ValueError(reason)
    if guards not in GUARDS:
        raise ValueError(f"guards must be one of {', '.join(GUARDS)}, not {guards!r}")
    gc = model.generation_config
    _prepare(model)
    disable_compiled_decode(model)  # a step compiled before (another config or guards) is not reused
    gc.cache_implementation = "static"
    gc.compile_config = compile_config(options)
    gc.disable_compile = False
    if guards == "model":  # transformers' get_compiled_call returns this step while the config is this one
        model._compiled_call = _CompiledStep(model, gc.compile_config, fallback=fallback)
        model._last_compile_config = gc.compile_config
    return model


def compile_opted_out() -> bool:
    """``$BITMOSAIC_NO_COMPILE`` set to anything but empty or ``0``."""
    return os.environ.get(NO_COMPILE_ENV, "").strip() not in ("", "0")


def default_compiled_decode(model: nn.Module, compile: bool = True) -> str | None:
    """What every bitmosaic load path does by default (``bitmosaic.load``, ``from_pretrained`` of a
    bitmosaic folder, ``bitmosaic generate``; issue 74): :func:`enable_compiled_decode` with ``fallback``
    and :func:`default_inductor_options`, so ``model.generate`` decodes through the compiled step without
    being asked.  Returns ``None`` when it did, else why not -- and leaves the model as it was,
    decoding eagerly, without an error:

    * ``compile=False`` or ``$BITMOSAIC_NO_COMPILE=1`` (the opt-outs);
    * a mixture of experts (routing picks experts per token: no static graph holds it), or a model
      without ``generate``;
    * a model not wholly on the CPU (the compiled step is built and measured for the CPU kernels; on
      CUDA call :func:`enable_compiled_decode` yourself);
    * a step that fails to compile (an operator or module dynamo cannot trace): found on the first
      ``generate``, which says so in one line on stderr and goes on eagerly.
    """
    if not compile or compile_opted_out():
        return f"compile=False or {NO_COMPILE_ENV}=1"
    reason = _refusal(model)
    if reason is not None:
        return reason
    devices = {t.device.type for t in (*model.parameters(), *model.buffers())}
    if devices != {"cpu"}:
        return f"the model is on {', '.join(sorted(devices))}, not the CPU alone"
    enable_compiled_decode(model, default_inductor_options(), fallback=True)
    return None


def disable_compiled_decode(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_compiled_decode`: the dynamic cache and eager decode again."""
    gc = model.generation_config
    gc.cache_implementation = None
    gc.compile_config = None
    for attr in ("_compiled_call", "_last_compile_config"):
        if hasattr(model, attr):
            delattr(model, attr)
    return model
