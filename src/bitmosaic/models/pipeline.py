"""The sequential layer-by-layer calibration pipeline.

1. Capture the decoder-layer inputs: forward pre-hooks on the decoder layers record the hidden
   states entering layer 0 and the keyword arguments (masks, rotary embeddings) each kind of
   layer receives, then raise :class:`StopForward` -- a dedicated exception, so no other error is
   ever swallowed -- once every layer kind was seen (layer 0 alone for Llama-like models).
2. For each decoder layer and each true-sequential group (q/k/v -> o -> gate/up -> down):
   accumulate ``H = 2/n sum x x^T`` with pre-hooks on the group's linears (modules fed the very
   same tensor share one Hessian), stopping the layer's forward as soon as the group's inputs are
   seen; quantize each linear with the chosen method; put the dequantized weight in place so the
   next group calibrates on quantized outputs.
3. Run the layer once more to produce the next layer's inputs, and swap in packed
   :class:`~bitmosaic.models.qlinear.QuantLinear` modules.

Methods with a ``transform`` (SmoothQuant, AWQ) first see the float layer's group inputs
(:func:`~bitmosaic.models.capture.capture_groups`) and return per-channel factors that are folded
into the preceding ops before step 2.  With activation quantization (``config.act``), each
linear's input statistics are observed with its Hessian (static scales come from them), and once
the linear is quantized an input quantizer is attached to it, so every later group, the next
layer's inputs and the saved model all see quantized activations.

Only one layer's Hessians and the calibration activations are held besides the model.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from ..algorithms.bounds import babai_bound, hessian_error, relative_output_error
from ..algorithms.hessian import HessianAccumulator, damp_hessian
from ..algorithms.lattice import order_bound_table
from ..algorithms.observers import ActObserver
from ..formats.grid import IntGrid
from ..methods.registry import LayerStats, MethodSpec, WeightQuantConfig
from .actquant import attach_input_quant
from .arch import ArchSpec, get_arch
from .capture import capture_groups, run_layer
from .qlinear import QuantLinear
from .smoothing import fold_group_scales

__all__ = ["StopForward", "RunReport", "quantize_model", "peak_rss_mb"]


class StopForward(Exception):
    """Raised by calibration hooks to end a forward pass early (never used for real errors)."""


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclass
class RunReport:
    method: str
    config: dict
    layers: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    bits_per_weight: float = 0.0
    calibration: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "config": self.config,
            "calibration": self.calibration,
            "seconds": self.seconds,
            "peak_rss_mb": self.peak_rss_mb,
            "bits_per_weight": self.bits_per_weight,
            "layers": self.layers,
        }


def _layer_kind(layer: nn.Module) -> str:
    return str(getattr(layer, "attention_type", "default"))


@torch.inference_mode()
def capture_layer_inputs(model: nn.Module, layers: nn.ModuleList, calib: torch.Tensor, batch_size: int):
    """Return (hidden states entering layer 0 per batch, {layer kind: [kwargs per batch]})."""
    kinds_needed = {_layer_kind(layer) for layer in layers}
    inputs: list[torch.Tensor] = []
    kwargs_by_kind: dict[str, list[dict]] = {k: [] for k in kinds_needed}
    seen: set[str] = set()

    def make_hook(idx: int, kind: str):
        def hook(module, args, kwargs):
            if idx == 0:
                hs = args[0] if args else kwargs["hidden_states"]
                inputs.append(hs.detach())
            if kind not in seen:
                seen.add(kind)
                kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                kw["use_cache"] = False
                kw["past_key_values"] = None
                kwargs_by_kind[kind].append(kw)
            if seen == kinds_needed:
                raise StopForward

        return hook

    first_of_kind: dict[str, int] = {}
    for i, layer in enumerate(layers):
        first_of_kind.setdefault(_layer_kind(layer), i)
    handles = [
        layers[i].register_forward_pre_hook(make_hook(i, kind), with_kwargs=True)
        for kind, i in first_of_kind.items()
    ]
    if 0 not in first_of_kind.values():  # pragma: no cover - layer 0 is always first of its kind
        raise RuntimeError("internal: layer 0 must be hooked")
    try:
        for b in range(0, calib.shape[0], batch_size):
            seen.clear()
            try:
                model(input_ids=calib[b : b + batch_size], use_cache=False)
            except StopForward:
                pass
            else:
                raise RuntimeError("calibration forward finished without reaching the decoder layers")
    finally:
        for h in handles:
            h.remove()
    return inputs, kwargs_by_kind


class _OutputCache:
    """Outputs of already-quantized linears, per calibration batch, for the rest of one layer.

    Once a linear is quantized its input can no longer change (it depends only on groups before
    it, which are final), so later partial forwards of the same layer may reuse its output
    exactly instead of recomputing it: the projections -- most of a layer's FLOPs -- then run
    once per layer instead of once per later group.
    """

    def __init__(self) -> None:
        self.batch = 0
        self.modules: list[nn.Module] = []

    def install(self, module: nn.Module) -> None:
        orig = module.forward
        store: dict[int, torch.Tensor] = {}

        def forward(x, *args, **kwargs):
            y = store.get(self.batch)
            if y is None:
                y = store[self.batch] = orig(x, *args, **kwargs)
            return y

        module.forward = forward
        self.modules.append(module)

    def clear(self) -> None:
        for m in self.modules:
            del m.forward  # back to the class's forward
        self.modules.clear()


@torch.inference_mode()
def _group_hessians(
    layer, names, inputs, kwargs, hessian_dtype, cache: _OutputCache | None = None, act_spec=None
) -> tuple[dict[str, HessianAccumulator], dict, dict[str, ActObserver]]:
    mods = {n: layer.get_submodule(n) for n in names}
    accs: dict[str, HessianAccumulator] = {}
    observers: dict[str, ActObserver] = {}
    owner: dict[str, str] = {}
    state: dict = {}

    def make_hook(name):
        def hook(module, args):
            x = args[0]
            prev = state.get("last")
            if prev is not None and x is prev[0]:
                owner.setdefault(name, prev[1])
            else:
                owner.setdefault(name, name)
            if owner[name] == name:
                acc = accs.setdefault(name, HessianAccumulator(x.shape[-1], dtype=hessian_dtype))
                acc.add(x)
                observers.setdefault(name, ActObserver(x.shape[-1], act_spec)).add(x)
                state["last"] = (x, name)
            state["seen"].add(name)
            if len(state["seen"]) == len(mods):
                raise StopForward

        return hook

    handles = [m.register_forward_pre_hook(make_hook(n)) for n, m in mods.items()]
    try:
        for b, (hs, kw) in enumerate(zip(inputs, kwargs, strict=True)):
            if cache is not None:
                cache.batch = b
            state["seen"] = set()
            state["last"] = None
            try:
                run_layer(layer, hs, kw)
            except StopForward:
                pass
            else:
                missing = sorted(set(mods) - state["seen"])
                raise RuntimeError(
                    f"layer forward never called {missing}; check the architecture's layer map"
                )
    finally:
        for h in handles:
            h.remove()
    return accs, owner, observers


def _report_row(name: str, W, Wq, H, res, qlin, percdamp: float) -> dict:
    """One layer's line of the run report (float64 metrics; see the README for definitions)."""
    W64, Wq64, H64 = W.double(), Wq.double(), H.double()
    Hd = res.hessian if res.hessian is not None else damp_hessian(H64, percdamp)[0]
    Hd = Hd.double()
    bound = None
    lattice = res.lattice_scales()
    if res.perm is not None and lattice is not None:  # the no-clip guarantee of the order used
        bound = float(babai_bound(Hd, lattice, res.perm).sum())
    return {
        "name": name,
        "shape": list(W.shape),
        "rel_out_error": relative_output_error(W64, Wq64, H64),
        "hessian_error": float(hessian_error(W64, Wq64, Hd).sum()),
        "babai_bound": bound,
        "bits_per_weight": qlin.bits_per_weight(),
        "storage_bits": getattr(qlin, "storage_bits", None),
        **res.info,
    }


def _pack(method: MethodSpec, res, config, bias) -> nn.Module:
    if method.pack is not None:
        return method.pack(res, config, bias)
    return QuantLinear.from_result(
        res, bits=config.bits, group_size=config.group_size, symmetric=config.symmetric, bias=bias
    )


def _apply_transform(method: MethodSpec, config, layer, arch, inputs, kwargs, gen) -> dict[int, dict]:
    """Run the method's per-layer ``transform`` and fold the factors it returns; info per group."""
    if method.transform is None:
        return {}
    caps = capture_groups(
        layer, arch, inputs, kwargs, max_tokens=getattr(config, "max_tokens", 2048), generator=gen
    )
    info: dict[int, dict] = {}
    for cap, (s, row) in zip(caps, method.transform(caps, config), strict=True):
        if s is not None:
            fold_group_scales(layer, arch, cap.index, s)
        info[cap.index] = {**row, "folded": s is not None}
    return info


def quantize_model(
    model: nn.Module,
    calib: torch.Tensor,
    method: MethodSpec,
    config: WeightQuantConfig,
    *,
    arch: ArchSpec | None = None,
    batch_size: int = 8,
    hessian_dtype: torch.dtype = torch.float32,
    progress: bool = True,
    cache_outputs: bool | None = None,
    cache_budget_mb: float = 1024.0,
    analyze_orders: tuple[str, ...] | None = None,
    seed: int = 0,
) -> RunReport:
    """Quantize every linear of ``model``'s decoder layers in place; return the run report.

    ``cache_outputs`` keeps quantized linears' outputs for the rest of their layer (exact; see
    :class:`_OutputCache`); ``None`` turns it on when that takes at most ``cache_budget_mb``.
    ``analyze_orders`` adds, per layer, the Babai bound and the measured no-clip GPTQ error under
    each named order (same static MSE scales; see :func:`algorithms.lattice.order_bound_table`).
    ``seed`` fixes the token samples a ``transform`` draws.
    """
    t0 = time.perf_counter()
    arch = arch or get_arch(model)
    layers = arch.layers(model)
    model.eval()
    report = RunReport(method=method.name, config=config.to_dict())
    report.calibration = {"samples": int(calib.shape[0]), "seqlen": int(calib.shape[1])}
    inputs, kwargs_by_kind = capture_layer_inputs(model, layers, calib, batch_size)
    total_bits = 0.0
    total_weights = 0
    percdamp = getattr(config, "percdamp", 0.01)
    cached_names = [n for group in arch.sequential[:-1] for n in group]
    if cache_outputs is None:
        width = sum(layers[0].get_submodule(n).weight.shape[0] for n in cached_names)
        cache_outputs = calib.numel() * width * 4 / 2**20 <= cache_budget_mb
    cache = _OutputCache() if cache_outputs else None
    report.calibration["output_cache"] = bool(cache_outputs)
    act = getattr(config, "act", None)
    gen = torch.Generator().manual_seed(seed)
    scheme = getattr(config, "scheme", f"w{config.bits}")
    bar = tqdm(range(len(layers)), desc=f"{method.name} {scheme}", unit="layer", disable=not progress)
    for li in bar:
        layer = layers[li]
        kwargs = kwargs_by_kind[_layer_kind(layer)]
        qmods: dict[str, nn.Module] = {}
        act_scales: dict[str, torch.Tensor | None] = {}
        group_info = _apply_transform(method, config, layer, arch, inputs, kwargs, gen)
        for gi, group in enumerate(arch.sequential):
            tl = time.perf_counter()
            # Hessians feed the method and, for every method, the per-layer error report.
            accs, owner, observers = _group_hessians(layer, group, inputs, kwargs, hessian_dtype, cache, act)
            for name in group:
                bar.set_postfix_str(f"{li}.{name}")
                lin = layer.get_submodule(name)
                W = lin.weight.data.float()
                acc = accs[owner[name]]
                H = acc.H
                res = method.fn(W, LayerStats(hessian=H, tokens=acc.n, act=observers[owner[name]]), config)
                Wq = res.dequantize(torch.float32)
                qlin = _pack(method, res, config, lin.bias)
                if not torch.equal(qlin.dequantize_weight(torch.float32), Wq):
                    raise RuntimeError(
                        f"internal: packed weights of {li}.{name} differ from the simulated ones"
                    )
                row = _report_row(f"{arch.layers_path}.{li}.{name}", W, Wq, H, res, qlin, percdamp)
                row["seconds"] = time.perf_counter() - tl
                if act is not None:
                    row["act"] = act.label
                if group_info.get(gi):
                    row["transform"] = group_info[gi]
                report.layers.append(row)
                if analyze_orders:
                    grid = IntGrid(config.bits, config.symmetric)
                    report.layers[-1]["order_bounds"] = order_bound_table(
                        W, H, grid, config.group_size, tuple(analyze_orders), percdamp=percdamp
                    )
                tl = time.perf_counter()
                total_bits += row["bits_per_weight"] * W.numel()
                total_weights += W.numel()
                lin.weight.data.copy_(Wq.to(lin.weight.dtype))
                qmods[name] = qlin
                if act is not None:  # later groups and the next layer see quantized inputs
                    act_scales[name] = observers[owner[name]].static_scale() if act.static else None
                    attach_input_quant(lin, act, W.shape[1], act_scales[name])
                if cache is not None and name in cached_names:
                    cache.install(lin)
            del accs
        with torch.inference_mode():
            outputs = []
            for b, (hs, kw) in enumerate(zip(inputs, kwargs, strict=True)):
                if cache is not None:
                    cache.batch = b
                outputs.append(run_layer(layer, hs, kw))
            inputs = outputs
        if cache is not None:
            cache.clear()
        for name, qlin in qmods.items():
            if act is not None:
                attach_input_quant(qlin, act, qlin.in_features, act_scales[name])
            layer.set_submodule(name, qlin.to(layer.get_submodule(name).weight.device))
    report.seconds = time.perf_counter() - t0
    report.peak_rss_mb = peak_rss_mb()
    report.bits_per_weight = total_bits / max(total_weights, 1)
    return report
