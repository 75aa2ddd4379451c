"""Calibration passes of the layer-by-layer pipeline, device-aware.

- :func:`capture_layer_inputs`: the hidden states entering decoder layer 0 and the keyword
  arguments (masks, rotary embeddings) each kind of layer receives.  Only the modules that run
  *before* the first decoder layer (embeddings, rotary tables; everything outside the decoder
  stack but the output head) are moved to the calibration device for it, and moved back after.
- :class:`LayerInputs`: one layer's calibration activations, per batch, kept on the device,
  offloaded to host memory or spilled to files (then each batch is moved to the device as it is
  used); :func:`first_layer_inputs` captures them for layer 0 and decides where they live.

The statistics of one group on these inputs (Hessians, observers, the output cache) are
:mod:`bitmosaic.pipeline.statistics`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import check_finite
from .spill import SpillStore, spill_decision

if TYPE_CHECKING:
    pass

__all__ = [
    "StopForward",
    "LayerInputs",
    "capture_layer_inputs",
    "first_layer_inputs",
    "layer_kind",
    "move_outside_layers",
]


class StopForward(Exception):
    """Raised by calibration hooks to end a forward pass early (never used for real errors)."""


def layer_kind(layer: nn.Module) -> str:
    return str(getattr(layer, "attention_type", "default"))


def cast_floating(obj, device: torch.device, dtype: torch.dtype | None = None):
    """``obj`` (a tensor, or tuples/lists/dicts of them, or anything else) with its tensors on
    ``device`` and its floating tensors in ``dtype`` (when given)."""
    if torch.is_tensor(obj):
        if dtype is not None and obj.is_floating_point():
            return obj.to(device, dtype)
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(cast_floating(o, device, dtype) for o in obj)
    if isinstance(obj, list):
        return [cast_floating(o, device, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: cast_floating(v, device, dtype) for k, v in obj.items()}
    return obj


def move_outside_layers(model: nn.Module, layers: nn.ModuleList, device: torch.device) -> None:
    """Move every parameter and buffer outside the decoder stack, except the output head's, to
    ``device`` (in place through ``.data``, so tied weights stay tied).  A head tied to the input
    embedding moves with it: it is the same tensor."""
    skip = {id(m) for m in layers.modules()}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        skip.add(id(head))
    for m in model.modules():
        if id(m) in skip:
            continue
        for p in m._parameters.values():
            if p is not None and p.device != device:
                p.data = p.data.to(device)
        for key, buf in m._buffers.items():
            if buf is not None and buf.device != device:
                m._buffers[key] = buf.to(device)


class LayerInputs:
    """Hidden states entering the current layer, one tensor per calibration batch.

    ``offload=True`` keeps them in host memory and yields each on ``device`` when used; otherwise
    they live on ``device``.  ``dtype``: the compute dtype they are yielded in.  ``store_dtype``: the
    dtype they are kept in between layers (default ``dtype``); the pipeline keeps them in the model's
    own dtype -- bfloat16 for a bfloat16 checkpoint, whose hidden states pass between decoder layers
    in bfloat16 at inference too -- so a layer calibrated in float32 on the CPU hands on half the
    bytes, rounded as the model itself would round them.  ``spill``: keep them in files instead
    (:class:`~bitmosaic.pipeline.spill.SpillStore`; ``batches`` is then empty), read back one batch
    at a time as they are iterated.

    The layer's final forward hands on its outputs batch by batch: :meth:`set` ``(b, output)`` once
    batch ``b`` was used for the last time, then :meth:`advance`.  In memory batch ``b`` is replaced at
    once; spilled, the outputs go to the next file.  Either way the outputs are never all held at once
    beside all the inputs.  :meth:`close` removes the spill files (the pipeline calls it however the run
    ends).
    """

    def __init__(
        self,
        batches: list[torch.Tensor],
        device: torch.device,
        offload: bool,
        dtype: torch.dtype | None = None,
        store_dtype: torch.dtype | None = None,
        spill: SpillStore | None = None,
    ) -> None:
        self.device = device
        self.offload = offload
        self.dtype = dtype or batches[0].dtype
        self.store_dtype = store_dtype or self.dtype
        self.spill = spill
        self._place = "cpu" if offload or spill is not None else device
        self.batches: list[torch.Tensor] = []
        for b in batches:
            self.append(b)

    @property
    def spilled(self) -> bool:
        return self.spill is not None

    def append(self, batch: torch.Tensor) -> None:
        """Add a batch (the first layer's inputs, e.g. as they are captured)."""
        t = batch.to(self._place, self.store_dtype)
        if self.spill is not None:
            self.spill.append(t)
        else:
            self.batches.append(t)

    def __len__(self) -> int:
        return len(self.spill) if self.spill is not None else len(self.batches)

    def stored(self, i: int) -> torch.Tensor:
        """Batch ``i`` as it is kept (``store_dtype``; on the host when offloaded or spilled)."""
        return self.spill.read(i) if self.spill is not None else self.batches[i]

    def spec(self, i: int) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of stored batch ``i``, without reading it."""
        if self.spill is not None:
            return self.spill.spec(i)
        return tuple(self.batches[i].shape), self.batches[i].dtype

    def get(self, i: int) -> torch.Tensor:
        """Batch ``i`` on ``device`` in the compute dtype."""
        return self.stored(i).to(self.device, self.dtype, non_blocking=True)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(len(self)):
            yield self.get(i)

    def set(self, b: int, output: torch.Tensor) -> None:
        """Batch ``b`` of the next layer's inputs; this layer's batch ``b`` must not be read again."""
        t = output.to(self._place, self.store_dtype)
        if self.spill is not None:
            self.spill.write(b, t)
        else:
            self.batches[b] = t

    def advance(self) -> None:
        """Every batch was :meth:`set`: from now on the batches are the next layer's inputs."""
        if self.spill is not None:
            self.spill.advance()

    def replace(self, outputs: list[torch.Tensor]) -> None:
        """All of the next layer's inputs at once."""
        if self.spill is None:
            self.batches = [o.to(self._place, self.store_dtype) for o in outputs]
            return
        for b, o in enumerate(outputs):
            self.set(b, o)
        self.advance()

    def nbytes(self) -> int:
        if self.spill is not None:
            return self.spill.nbytes()
        return sum(b.numel() * b.element_size() for b in self.batches)

    def close(self) -> None:
        """Remove the spill files (nothing to do in memory); the batches are gone after it."""
        if self.spill is not None:
            self.spill.close()


_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache")


@torch.inference_mode()
def capture_layer_inputs(
    model: nn.Module,
    layers: nn.ModuleList,
    calib: torch.Tensor,
    batch_size: int,
    device: torch.device | None = None,
    sink=None,
):
    """Return (hidden states entering layer 0 per batch, {layer kind: [kwargs per batch]}).

    With ``device``, the modules before the decoder stack run there (and are moved back after),
    so the captured tensors are on ``device``.  ``sink``: a callable that takes each batch's hidden
    states as they are captured (e.g. :meth:`LayerInputs.append` of spilled inputs); they are then
    not kept, and the first list returned is empty.
    """
    kinds_needed = {layer_kind(layer) for layer in layers}
    inputs: list[torch.Tensor] = []
    taken: list[None] = []  # batches handed to the sink
    kwargs_by_kind: dict[str, list[dict]] = {k: [] for k in kinds_needed}
    seen: set[str] = set()

    def make_hook(idx: int, kind: str):
        def hook(module, args, kwargs):
            if idx == 0:
                hs = args[0] if args else kwargs["hidden_states"]
                if sink is None:
                    inputs.append(hs.detach())
                else:
                    check_finite(hs, f"the inputs of decoder layer 0 (calibration batch {len(taken)})")
                    taken.append(None)
                    sink(hs.detach())
            if kind not in seen:
                seen.add(kind)
                kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                kw["use_cache"] = False
                for k in _CACHE_KWARGS:  # transformers >= 5.2x names it ``cache``; never add a name
                    if k in kw:
                        kw[k] = None
                kwargs_by_kind[kind].append(kw)
            if seen == kinds_needed:
                raise StopForward

        return hook

    first_of_kind: dict[str, int] = {}
    for i, layer in enumerate(layers):
        first_of_kind.setdefault(layer_kind(layer), i)
    handles = [
        layers[i].register_forward_pre_hook(make_hook(i, kind), with_kwargs=True)
        for kind, i in first_of_kind.items()
    ]
    home = calib.device
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is not None and embed.weight.device.type != "meta":
        home = embed.weight.device
    run_on = device or home
    if run_on != home:
        move_outside_layers(model, layers, run_on)
    try:
        for b in range(0, calib.shape[0], batch_size):
            seen.clear()
            try:
                model(input_ids=calib[b : b + batch_size].to(run_on), use_cache=False)
            except StopForward:
                pass
            else:
                raise RuntimeError("calibration forward finished without reaching the decoder layers")
    finally:
        for h in handles:
            h.remove()
        if run_on != home:
            move_outside_layers(model, layers, home)
    for i, hs in enumerate(inputs):
        check_finite(hs, f"the inputs of decoder layer 0 (calibration batch {i})")
    return inputs, kwargs_by_kind


def first_layer_inputs(model, layers, calib, settings, dev, cdtype, runc, budget):
    """The layer-0 inputs (a :class:`LayerInputs` in the model's dtype), their kwargs by layer kind, and
    the report's spill record (:func:`~bitmosaic.pipeline.spill.spill_decision`).  ``settings``: the
    run's :class:`~bitmosaic.pipeline.settings.RunSettings` (batch size, ``offload_inputs``,
    ``spill_dir``); ``runc``: the bound calibration cache; ``budget``: the host-memory budget (bytes).
    Spilled inputs are
    captured straight into their file, batch by batch, not through the calibration cache (whose entry
    is read and written whole); the results are the same bytes either way."""
    batch_size, offload, spill_dir = settings.batch_size, settings.offload_inputs, settings.spill_dir
    store_dtype = model_dtype(layers)
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    first = None
    if not isinstance(hidden, int):  # unknown before the capture: capture, then decide
        first, kwargs = runc.layer_inputs(model, layers, calib, batch_size, dev, capture_layer_inputs)
        hidden = first[0].shape[-1]
    if offload is None:
        offload = _offload_needed(calib, hidden, store_dtype, dev)
    record = spill_decision(calib.numel(), hidden, store_dtype, budget, dev.type == "cpu" or bool(offload))
    spill = SpillStore(spill_dir) if record["spilled"] else None
    record["dir"] = str(spill.dir) if spill is not None else None
    inputs = LayerInputs([], dev, bool(offload), cdtype, store_dtype, spill)
    try:
        if first is None and spill is not None:
            kwargs = capture_layer_inputs(model, layers, calib, batch_size, dev, sink=inputs.append)[1]
        else:
            if first is None:
                first, kwargs = runc.layer_inputs(model, layers, calib, batch_size, dev, capture_layer_inputs)
            while first:
                inputs.append(first.pop(0))  # each captured batch freed as it is stored
    except BaseException:
        inputs.close()
        raise
    return inputs, kwargs, record


def _offload_needed(calib: torch.Tensor, hidden: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Offload activations when inputs + outputs of one layer would take over 40% of free memory."""
    if device.type != "cuda":
        return False
    need = 2 * calib.numel() * hidden * torch.tensor([], dtype=dtype).element_size()
    free, _ = torch.cuda.mem_get_info(device)
    return need > 0.4 * free


def model_dtype(layers) -> torch.dtype:
    """The dtype the decoder layers' weights are stored in: the calibration activations are kept in it."""
    for layer in layers:
        for p in layer.parameters():
            if p.is_floating_point():
                return p.dtype
    return torch.float32
