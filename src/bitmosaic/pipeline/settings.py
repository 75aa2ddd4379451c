"""The settings of a run, declared once: :class:`RunSettings` (how the pipeline runs) and
:class:`Calibration` (what it calibrates on).

Each :class:`RunSettings` field carries its help text, its command-line flag (if the CLI exposes it)
and whether it enters the provenance record, so the three readers of the settings --
``bitmosaic quantize``'s flags (:mod:`bitmosaic.cli.settings_flags`), the keywords of
:func:`bitmosaic.quantize_` and the ``provenance.pipeline`` block of a saved model
(:func:`bitmosaic.io.provenance.run_provenance`) -- read one declaration instead of three copies.
None of these settings changes *what* a method computes except through the documented ones (batch
size and Hessian dtype change float reduction orders; the seed changes sampled tokens); the rest
(device, offload, memory, spill, cache, progress) give the same bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from ..errors import OptionError

__all__ = ["RunSettings", "Calibration", "settings_fields", "SETTING_CHOICES"]


def _setting(
    default,
    help: str,
    *,
    flag: str | None = None,
    record: str | None = None,
    factory=None,
    record_default: bool = True,
):
    """A :class:`RunSettings` field: ``help`` (API docs and CLI help), ``flag`` (the CLI flag, ``None``:
    not on the command line) and ``record`` (its key in the provenance's ``pipeline`` block);
    ``record_default=False``: recorded only when it differs from its default (what :meth:`RunSettings.
    from_record` then reads back), so the records of runs that do not use it stay as they were."""
    meta = {"help": help, "flag": flag, "record": record, "record_default": record_default}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_CHOICES = {"moe_calib": ("routed", "all"), "moe_fallback": ("pooled", "rtn")}  # str settings' values


@dataclass(frozen=True)
class RunSettings:
    """How a quantization run runs (module doc).  ``RunSettings(batch_size=8, device="cuda")``;
    :meth:`replace` for a changed copy."""

    batch_size: int = _setting(4, "calibration samples per layer forward", flag="--batch-size",
                               record="batch_size")  # fmt: skip
    hessian_dtype: torch.dtype = _setting(torch.float32, "dtype of the calibration Hessians",
                                          flag="--hessian-dtype", record="hessian_dtype")  # fmt: skip
    seed: int = _setting(0, "seed of the calibration sampling and of every random draw of the run (token "
                            "samples of a transform, random rotations)", flag="--seed")  # fmt: skip
    device: str | torch.device | None = _setting(
        None, "where calibration and the solvers run (None: where the model is; 'auto': CUDA when "
        "available); the model stays in host memory and each decoder layer visits the device in "
        "turn")  # fmt: skip
    compute_dtype: torch.dtype | None = _setting(
        None, "dtype a decoder layer is cast to while it is calibrated (None: float32 on the CPU, else the "
        "model's own dtype); the model keeps its dtype")  # fmt: skip
    offload_inputs: bool | None = _setting(
        None, "keep the calibration activations in host memory (None: when they would not fit comfortably "
        "on the device)")  # fmt: skip
    max_memory: int | str | None = _setting(
        None, "host-memory budget (bytes, or a size such as '8GB'; None: the memory available when the run "
        "starts): past 40% of it one layer's calibration activations spill to files")  # fmt: skip
    spill_dir: object = _setting(
        None, "where the spill folder is made (None: a streamed run's work folder, else the system's "
        "temporary folder)")  # fmt: skip
    cache_outputs: bool | None = _setting(
        None, "keep quantized linears' outputs for the rest of their layer (exact; None: when that takes at "
        "most cache_budget_mb and 40% of max_memory)")  # fmt: skip
    cache_budget_mb: float = _setting(1024.0, "memory the output cache may take (MB)")
    calib_cache: object = _setting(
        None, "a CalibCache sharing the float-model statistics between runs (layer-0 inputs, layer 0's "
        "transform statistics, Fisher); bit-identical results with and without it")  # fmt: skip
    analyze_orders: tuple[str, ...] | None = _setting(
        None, "orders (e.g. natural,act,min-pivot) whose Babai bound and no-clip GPTQ error each layer's "
        "report rows add", flag="--bound-orders", record="bound_orders")  # fmt: skip
    measure_errors: bool = _setting(
        False, "calibrate even methods that need no Hessian (RTN, FP8), for the report's error metrics"
    )
    check_packing: bool = _setting(True, "verify every packed module against the simulated weights")
    progress: bool = _setting(True, "show progress bars (with an ETA)", flag="--no-progress")
    moe_calib: str = _setting(
        "routed",
        "mixture-of-experts statistics: 'routed' (each expert's Hessian from the tokens routed to it, "
        "weighted by the squared routing weight) or 'all' (every calibration token through every expert, "
        "unweighted, for statistics only; outputs stay routed)",
        flag="--moe-calib",
        record="moe_calib",
        record_default=False,
    )
    moe_min_tokens: int | str = _setting(
        "auto",
        "an expert routed fewer calibration rows than this falls back to --moe-fallback; 'auto' (default): "
        "the projection's input width, below which its own Hessian is rank-poor and GPTQ on it did worse "
        "than "
        "on the pooled one (docs/moe.md)",
        flag="--moe-min-tokens",
        record="moe_min_tokens",
        record_default=False,
    )
    moe_fallback: str = _setting(
        "pooled",
        "the rule for an expert below --moe-min-tokens: 'pooled' (the Hessian of all the layer's "
        "experts' routed tokens) or 'rtn' (round-to-nearest with MSE scales on the run's grid: bits, group "
        "size, symmetry)",
        flag="--moe-fallback",
        record="moe_fallback",
        record_default=False,
    )

    def __post_init__(self):
        b = self.batch_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise OptionError(f"batch_size must be an integer >= 1, got {b!r}")
        if isinstance(self.hessian_dtype, str):  # "float64" as the CLI and recipes write it
            if self.hessian_dtype not in _DTYPES:
                raise OptionError(
                    f"hessian_dtype must be one of {sorted(_DTYPES)}, got {self.hessian_dtype!r}"
                )
            object.__setattr__(self, "hessian_dtype", _DTYPES[self.hessian_dtype])
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise OptionError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        m = self.moe_min_tokens
        if isinstance(m, str) and m.strip().isdigit():  # "64" as the CLI writes it
            m = int(m)
            object.__setattr__(self, "moe_min_tokens", m)
        if m != "auto" and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise OptionError(f"moe_min_tokens must be 'auto' or an integer >= 0, got {m!r}")
        if isinstance(self.analyze_orders, str):  # "natural,act" as the CLI writes it
            object.__setattr__(self, "analyze_orders", tuple(o for o in self.analyze_orders.split(",") if o))
        if self.analyze_orders is not None:
            object.__setattr__(self, "analyze_orders", tuple(self.analyze_orders) or None)

    def replace(self, **changes) -> RunSettings:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_record(cls, record: dict, **overrides) -> RunSettings:
        """The settings a provenance ``pipeline`` block recorded (:meth:`record`), ``overrides`` winning."""
        by_key = {f.metadata["record"]: f.name for f in fields(cls) if f.metadata.get("record")}
        given = {by_key[k]: v for k, v in record.items() if k in by_key and v is not None}
        return cls(**{**given, **overrides})

    def record(self) -> dict:
        """The provenance entries of the settings that change the numbers (module doc)."""
        out = {}
        for f in fields(self):
            key = f.metadata.get("record")
            if key and (f.metadata.get("record_default", True) or getattr(self, f.name) != f.default):
                v = getattr(self, f.name)
                if isinstance(v, torch.dtype):
                    v = str(v).removeprefix("torch.")
                elif isinstance(v, tuple):
                    v = ",".join(v)
                out[key] = v
        return out


SETTING_CHOICES = _CHOICES


def settings_fields() -> dict[str, dataclasses.Field]:
    """Name -> field of every :class:`RunSettings` setting (its ``metadata``: help, flag, record)."""
    return {f.name: f for f in fields(RunSettings)}


@dataclass
class Calibration:
    """What a run calibrates on: ``tokens`` (``[nsamples, seqlen]`` token ids); ``source``: the data
    they were drawn from (a dataset name or a file; ``None``: given as ids), ``bos``: whether each
    sample starts with the tokenizer's BOS; ``more(n)``: ``n`` samples drawn like ``tokens``, for a
    prepare step that asks for more samples than ``tokens`` has (e.g. for its Fisher salience)."""

    tokens: torch.Tensor
    source: str | None = None
    bos: bool = False
    more: Callable[[int], torch.Tensor] | None = None

    @classmethod
    def of(cls, calib) -> Calibration:
        return calib if isinstance(calib, Calibration) else cls(calib)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)
