"""One base for every quantized module kind: features, optional bias, the dequantized-weight cache,
forward, bits-per-weight accounting, the common saved-config keys and dtype-safe moves.

A kind implements ``_dequantize(dtype)`` (its fast path), ``dequantize_reference(dtype)`` (the
reference path, tested equal), ``storage_tensors()`` and ``layer_config()`` (built on
:meth:`QuantModule._config`).  The cache logic lives here alone, so a kind can never bypass or
duplicate it (five copies of it once drifted apart).

Nothing here assumes a device: every weight is computed from the buffers, on their device.

Resident weights: once a kind's kernel weight is built (:meth:`QuantModule.kernel`), the
saved buffers it can rebuild *exactly* (``_saved_from_kernel``: qweight from the kernel's codes,
fp16 scales/zeros from its float32 copies, the Huffman stream by re-encoding...) are released: each
rebuild is checked equal to the buffer (values, dtype, shape) before the buffer's storage is dropped
(a ``meta`` tensor of the same shape and dtype stays in its place), so a loaded model holds about one
copy of its weights.  Reading a released buffer (``m.qweight``, ``state_dict()``, saving,
``dequantize_reference``, ``bits_per_weight``) rebuilds it from the kernel, bit for bit; a device
move, a dtype cast, a ``load_state_dict`` or assigning the attribute first puts every released
buffer back and drops the kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from ..formats.accounting import bits_per_weight

__all__ = ["KINDS", "NoIntForm", "QuantModule", "set_weight_cache", "prepare_kernels", "resident_bytes"]

# every module kind, by its saved name: filled by QuantModule.__init_subclass__ (one place)
KINDS: dict[str, type[QuantModule]] = {}


def _wants_grad(x: torch.Tensor) -> bool:
    """Whether this forward records an autograd graph through ``x``."""
    return x.requires_grad and torch.is_grad_enabled()


class NoIntForm(Exception):
    """Why a module has no exact form in an export target (``fixable``: ``--lossy`` has a nearest form);
    raised by :meth:`QuantModule.int_form` / :meth:`QuantModule.fp8_form`."""

    def __init__(self, reason: str, fixable: bool = True, also: tuple[str, ...] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fixable = fixable
        self.reasons = (*also, reason)  # every reason this layer is refused for

    def adding(self, earlier: str | None) -> NoIntForm:
        """This refusal with an ``earlier`` reason (found before it) listed too."""
        if earlier is None or earlier in self.reasons:
            return self
        return NoIntForm(self.reason, self.fixable, (*self.reasons[:-1], earlier))


class QuantModule(nn.Module):
    """Every kind registers itself under its ``kind`` (the name saved per layer) and declares what it
    means beyond its buffers, through the hooks below (defaults: nothing to do, no export form):

    - :meth:`after_load` (per module) and :meth:`finish_model` (per kind, the whole model) run once a
      saved model's buffers are filled, by every load path (``bitmosaic.io.saved.finish.finish_load``);
    - :meth:`saved_summary` (what a save records beside the per-layer table) and :meth:`describe_saved`
      (the header lines ``bitmosaic inspect`` prints for the kind);
    - :meth:`int_form` / :meth:`fp8_form` / :meth:`exports_as_fp8`: what an export can write.
    """

    kind = "base"
    # kernels that run this kind with integer activations (modules/intact.py); empty: simulated only
    INT_ACT_KERNELS: ClassVar[tuple[str, ...]] = ()
    # the kind quantizes its inputs itself, without an input quantizer (the SQ-format's split): its
    # integer kernel (``_build_int_act``) is called with ``(x, None)``
    QUANTIZES_OWN_INPUTS: ClassVar[bool] = False
    # kernels (kernels/select.py names) that run this kind's kernel weight off the CPU (the Triton kernels,
    # kernels/triton/, issue 76): a forward on such a device runs the kernel when one of them runs there;
    # empty: off the CPU the kind dequantizes and calls F.linear
    GPU_KERNELS: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:  # a kind of its own (a subclass that only tweaks one inherits it)
            other = KINDS.get(cls.kind)
            if other is not None and other.__qualname__ != cls.__qualname__:
                raise TypeError(f"module kind {cls.kind!r} is taken by {other.__name__}")
            KINDS[cls.kind] = cls

    def __init__(self, in_features: int, out_features: int, bias: bool = False, cache_weight: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.cache_weight = cache_weight
        self._wcache: torch.Tensor | None = None
        self._kernel = None  # the kernel weight built from the buffers (see modules/kernel.py)
        self._released: set[str] = set()  # saved buffers held by the kernel only (module doc)
        self._int_act = None  # the integer-activation kernel (None: not built; False: none here)

    # -- what each kind implements -------------------------------------------------------------
    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[out, in]`` in ``dtype`` via the kind's fast path (a new tensor)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _dequantize(dtype)")

    def dequantize_reference(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight via the reference path of the kind's format (tested equal to ``_dequantize``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement dequantize_reference(dtype)")

    def storage_tensors(self) -> list[torch.Tensor]:
        """The buffers that *are* the stored format (counted in bits per weight, never cast)."""
        raise NotImplementedError(f"{type(self).__name__} must implement storage_tensors()")

    def layer_config(self) -> dict:
        """What a loader needs to rebuild this module (saved per layer in quantization_config)."""
        raise NotImplementedError(f"{type(self).__name__} must implement layer_config()")

    def _build_kernel(self):
        """The kind's :class:`~bitmosaic.modules.kernel.KernelWeight` (CPU inference without a
        float weight), or ``None`` when the kind has none (forward then dequantizes per call)."""
        return None

    def _build_int_act(self):
        """The kind's :class:`~bitmosaic.modules.intact.IntActKernel` for its activation quantizer, or
        ``None`` when this layer runs simulated (``intact.int_act_blocker`` says why).  Default: none."""
        return None

    def _saved_from_kernel(self, kernel) -> dict[str, Callable[[], torch.Tensor]]:
        """The saved buffers this kind rebuilds exactly from its ``kernel``: name -> rebuild function.
        The base releases a buffer only after checking its rebuild equal to it (module doc)."""
        return {}

    def _saved_from_int_act(self, int_act) -> dict[str, Callable[[], torch.Tensor]]:
        """The same from the integer-activation kernel ``int_act``, for a layer whose every CPU forward
        runs it: that kernel is then the layer's only resident weight.  Default: none (the kind keeps its
        saved buffers beside it)."""
        return {}

    # -- shared --------------------------------------------------------------------------------
    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The inference weight ``[out, in]`` in ``dtype``; with ``cache_weight`` the last one computed
        is kept and served again for the same dtype (never converted from another dtype)."""
        w = self._wcache
        if w is None or w.dtype != dtype:
            w = self._dequantize(dtype)
            if self.cache_weight:
                self._wcache = w
        return w

    def set_weight_cache(self, enabled: bool) -> None:
        self.cache_weight = enabled
        if not enabled:
            self._wcache = None

    def kernel(self):
        """The kernel weight, built once from the buffers (``None``: this kind has none); the saved
        buffers it rebuilds exactly are then released (module doc)."""
        if self._kernel is None:
            k = self._build_kernel()
            self._kernel = k if k is not None else False
            if k is not None:
                self._release_saved(k)
        return self._kernel or None

    @classmethod
    def act_compute(cls, cfg: dict) -> str:
        """How a layer of this kind with the saved per-layer ``cfg`` computes with its activation quantizer
        on this machine (``bitmosaic inspect``): ``int8 (avx512-vnni)``, ``simulated (<why>)`` or
        ``weight-only`` (modules/intact.py)."""
        from ..formats.act import ActQuantSpec
        from .intact import act_path_label, int_act_blocker

        spec = ActQuantSpec.from_dict(cfg.get("act"))
        bits = cfg.get("storage_bits") or cfg.get("bits") or 8
        n_in = int(cfg["in_features"])
        gs = cfg.get("group_size") or -1
        blocker = int_act_blocker(cls.INT_ACT_KERNELS, spec, bits, gs, n_in, bool(cfg.get("has_g_idx")))
        return act_path_label(blocker, spec)

    def act_quantizer(self):
        """The layer's activation quantizer: its own (``input_quant``, saved with it), else the run-time
        one of :func:`~bitmosaic.modules.intact.set_runtime_activations` (not saved), else ``None``."""
        q = self._modules.get("input_quant")
        return q if q is not None else self.__dict__.get("_runtime_act")

    def int_act_blocker(self) -> str | None:
        """Why this layer runs its activation quantizer simulated (``None``: integer).  Default: the kind
        has no integer path."""
        return "no integer path for this kind"

    def runs_int_act(self, x: torch.Tensor) -> bool:
        """Whether this forward quantizes ``x`` inside the integer kernel (the input pre-hook then leaves
        ``x`` alone): an integer path is built for this layer, ``x`` is on the CPU, needs no gradient, and
        ``$BITMOSAIC_ACT_COMPUTE`` is not ``sim`` (modules/intact.py).  A newly built integer kernel that
        rebuilds the saved buffers exactly (:meth:`_saved_from_int_act`) holds them instead of the float
        kernel, which is dropped: one resident copy of the weight (the float kernel is built again, from
        it, only for a forward that does not run the integer path)."""
        if not self.INT_ACT_KERNELS or x.device.type != "cpu" or _wants_grad(x):
            return False
        from .intact import act_compute_mode

        if act_compute_mode() == "sim":
            return False
        if self._int_act is None:
            self._int_act = self._build_int_act() or False
            if self._int_act:
                self._hold_in_int_act()
        return self._int_act is not False

    def _hold_in_int_act(self) -> None:
        """Release the saved buffers the integer kernel rebuilds exactly (checked, as for the kernel) and
        drop the float kernel when every buffer it held is then held by the integer kernel."""
        saved = self._saved_from_int_act(self._int_act)
        if not saved:
            return
        if self._kernel:
            if not self._released <= set(saved):
                return  # the kernel holds a buffer the integer kernel cannot give back: keep both
            int_act = self._int_act
            self._restore_saved()  # the buffers back from the float kernel, both kernels dropped
            self._int_act = int_act
        self._release_saved(self._int_act, saved)

    def _holder(self):
        """What the released saved buffers are rebuilt from: the float kernel, else the integer one."""
        return self._kernel or self._int_act

    def _drop_int_act(self) -> None:
        """Forget the integer kernel (its quantizer changed), first putting back the buffers it holds."""
        if self._released and not self._kernel:
            self._restore_saved()
        self.__dict__["_int_act"] = None

    # -- resident weights: the kernel holds the weight, released buffers are rebuilt on demand --
    def _release_saved(self, k, saved: dict | None = None) -> None:
        for name, rebuild in (self._saved_from_kernel(k) if saved is None else saved).items():
            buf = self._buffers.get(name)
            if buf is None or name in self._released:
                continue
            t = rebuild()
            same = t.dtype == buf.dtype and t.shape == buf.shape and t.device == buf.device
            if same and torch.equal(t, buf):
                self._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device="meta")
                self._released.add(name)

    def _rebuilt(self, names) -> dict[str, torch.Tensor]:
        h = self._holder()
        rebuild = self._saved_from_kernel(h) if h is self._kernel else self._saved_from_int_act(h)
        return {n: rebuild[n]() for n in names}

    def _restore_saved(self) -> None:
        """Put every released buffer back (rebuilt from the kernel that holds them) and drop the kernels."""
        if self._released:
            for name, t in self._rebuilt(sorted(self._released)).items():
                self._buffers[name] = t
            self._released = set()
        self._kernel = None
        self._int_act = None

    def __getattr__(self, name: str):
        released = self.__dict__.get("_released")
        if released and name in released:
            return self._rebuilt([name])[name]
        return super().__getattr__(name)

    def __setattr__(self, name: str, value) -> None:
        released = self.__dict__.get("_released")
        if released and name in released:
            self._restore_saved()  # the kernel was built from the old value
            self._wcache = None
        if name in self.__dict__.get("_buffers", ()):
            self._drop_int_act()  # built from the old buffer
        super().__setattr__(name, value)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._released:
            for name, t in self._rebuilt(sorted(self._released)).items():
                destination[prefix + name] = t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.to(x.dtype)
        q = self.act_quantizer()
        if (q is not None or self.QUANTIZES_OWN_INPUTS) and self.runs_int_act(x):  # x left unquantized
            y = self._int_act(x, q)
            return y if b is None else y + b
        # the CPU kernels write into preallocated outputs (no autograd): a forward that records a graph
        # (a plain ``model(ids)`` outside ``torch.no_grad()``) takes the differentiable path below
        if self._wcache is None and not self.cache_weight and self._kernel_runs_on(x) and not _wants_grad(x):
            k = self.kernel()
            if k is not None:
                y = k(x)
                return y if b is None else y + b
        w = self.dequantize_weight(torch.float32).to(x.dtype)
        return self._linear(x, w, b)

    def _kernel_runs_on(self, x: torch.Tensor) -> bool:
        """Whether a forward on ``x``'s device runs the kernel weight: always on the CPU; elsewhere when one
        of the kind's ``GPU_KERNELS`` runs there (Triton importable, a CUDA device)."""
        if x.device.type == "cpu":
            return True
        if not self.GPU_KERNELS:
            return False
        from ..kernels.select import offers_device

        return offers_device(self.GPU_KERNELS, x.device.type)

    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """``x`` times the dequantized weight ``w`` ``[out, in]`` (plus ``b``); a kind whose inputs take a
        structured path (the SQ-format activation split) overrides this, never ``forward``."""
        return nn.functional.linear(x, w, b)

    def bits_per_weight(self) -> float:
        return bits_per_weight(self.storage_tensors(), self.in_features * self.out_features)

    # constructor keywords a kind stores in its saved per-layer config, besides the shared ones
    CONFIG_KEYS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def _shared_kwargs(cls, cfg: dict) -> dict:
        return {"bias": cfg.get("bias", False)}

    @classmethod
    def from_layer_config(cls, cfg: dict):
        """Rebuild an empty module of this kind from its saved per-layer config."""
        own = {k: cfg[k] for k in cls.CONFIG_KEYS}
        return cls(cfg["in_features"], cfg["out_features"], **own, **cls._shared_kwargs(cfg))

    def _config(self, **fields) -> dict:
        """The saved keys every kind has, followed by the kind's own ``fields``."""
        return {
            "kind": self.kind,
            "in_features": self.in_features,
            "out_features": self.out_features,
            "bias": self.bias is not None,
            **fields,
        }

    def _set_bias(self, bias: torch.Tensor | None) -> None:
        if bias is not None:
            self.bias.data.copy_(bias.detach().float())

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}"

    # -- what the kind means at load, save, inspect and export (defaults) -----------------------
    def after_load(self, dtype: torch.dtype | None = None) -> None:
        """Called on each module once a saved model's buffers are filled (``dtype``: the float dtype the
        model was loaded in; the stored format never follows it).  Default: nothing."""

    @classmethod
    def finish_model(cls, model: nn.Module, modules: dict[str, QuantModule], arch) -> None:
        """Called once per kind present after loading (``modules``: this kind's modules by name,
        ``arch``: the model's architecture map or ``None``), e.g. exact runtime folds.  Default: nothing."""

    @classmethod
    def saved_summary(cls, model: nn.Module, modules: dict[str, QuantModule], run: dict) -> dict:
        """Fields this kind adds to a saved ``quantization_config`` (``run``: what the run recorded so far).
        Default: none."""
        return {}

    @classmethod
    def describe_saved(cls, path, layer_cfgs: dict[str, dict], qc: dict) -> tuple[list[str], dict]:
        """``(header lines, per-layer "bits" cells)`` that ``bitmosaic inspect`` prints for this kind's
        layers of the saved folder ``path`` (``layer_cfgs``: their per-layer table).  Default: none."""
        return [], {}

    def int_form(self, allowed_bits: tuple[int, ...], lossy: bool, changes: list[str]):
        """The weight as an affine INT grid (:class:`~bitmosaic.formats.intform.IntForm`) whose width is
        in ``allowed_bits``; with ``lossy`` the nearest such grid, each change appended to ``changes``.
        Raises :class:`NoIntForm` naming why there is none (the default: a kind with no INT form)."""
        raise NoIntForm(f"module kind {self.kind!r} has no INT form", fixable=False)

    def exports_as_fp8(self, lossy: bool) -> bool:
        """Whether a format with FP8 weights should take this module as FP8 rather than INT."""
        return False

    def fp8_form(self, lossy: bool, changes: list[str]):
        """The weight as E4M3 values times a float32 scale (:class:`~bitmosaic.formats.intform.FP8Form`);
        raises :class:`NoIntForm` when there is none (the default)."""
        raise NoIntForm(f"a {self.kind} layer is not FP8 (use an INT format for it)", fixable=False)

    def _refuse_or_note(self, reason: str, lossy: bool, changes: list[str]) -> None:
        """Refuse (:class:`NoIntForm`, fixable) unless ``lossy``; then record ``reason`` as a change."""
        if not lossy:
            raise NoIntForm(reason)
        changes.append(reason)

    def _load_from_state_dict(self, *args, **kwargs):
        self._wcache = None  # new buffers: a weight (or kernel) built from the old ones is stale
        self._restore_saved()
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        """``model.to(dtype)`` / ``.half()`` must not cast the stored format (fp16 scales, FP8 bytes,
        float32 FP8 scales): storage buffers only follow device moves; the bias follows ``fn``."""
        self._wcache = None
        self._restore_saved()
        ids = {id(t) for t in self.storage_tensors()}
        keep = {k: b for k, b in self._buffers.items() if b is not None and id(b) in ids}
        for k in keep:
            self._buffers[k] = None
        try:
            super()._apply(fn, recurse)
        finally:
            for k, b in keep.items():
                device = fn(torch.empty(0, dtype=b.dtype, device=b.device)).device
                self._buffers[k] = b.to(device)
        return self


def prepare_kernels(model: nn.Module) -> None:
    """Build every quantized module's kernel weight now (at load) rather than at its first forward: on
    the CPU, and on a GPU for the kinds whose ``GPU_KERNELS`` run there.  A layer whose forwards run its
    integer-activation kernel gets that one instead (holding its weight, :meth:`QuantModule.runs_int_act`)."""
    for m in model.modules():
        if isinstance(m, QuantModule):
            t = next((b for b in m.storage_tensors() if b.device.type != "meta"), None)
            if t is None or m._kernel_runs_on(t):
                probe = torch.empty(0, m.in_features, device=t.device) if t is not None else None
                if probe is not None and m.act_quantizer() is not None and m.runs_int_act(probe):
                    continue
                m.kernel()


def set_weight_cache(model: nn.Module, enabled: bool = True) -> None:
    """Keep (or drop) every quantized module's dequantized weight between forwards (faster eval,
    more RAM), whatever its kind.  Huffman-coded modules start with theirs on (decoding is slow)."""
    from .changes import mark_changed

    mark_changed(model)
    for m in model.modules():
        if isinstance(m, QuantModule):
            m.set_weight_cache(enabled)


def resident_bytes(model: nn.Module) -> int:
    """Bytes ``model``'s weights occupy in memory now: every parameter and buffer that has storage
    (a shared storage counted once; released saved buffers have none) plus every quantized module's
    kernel weight (:meth:`~bitmosaic.modules.kernel.KernelWeight.nbytes`)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "meta":
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    for m in model.modules():
        if isinstance(m, QuantModule) and m._kernel:
            total += m._kernel.nbytes()
        if isinstance(m, QuantModule) and m._int_act:
            total += m._int_act.nbytes()
    return total
