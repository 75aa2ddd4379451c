"""QuaRot's rotations, folded into the float model before any method sees it (``--rotate``).

With ``h`` the residual stream and ``Q`` (R1) an orthogonal ``[d, d]``: ``RMSNorm(h Q) = RMSNorm(h) Q``
once the norm has no scale of its own, so

1. every pre-norm's scale ``g`` (Gemma: ``1 + w``) is folded into the columns of the linears reading
   it (``W diag(g)``) and the norm becomes scale-free (weight 1; Gemma: 0), the final norm's into the
   head;
2. the residual stream is rotated: embeddings ``E Q``; linears reading it ``W Q``; linears writing it
   ``Qᵀ W`` (bias ``b Q``); the head ``W Q``.  A head tied to the embeddings is untied (the final
   norm's scale is in the head only), and the model's config says so;
3. each attention head's value/output pair gets R2 (``[head_dim, head_dim]``): ``v_proj``'s rows of
   each key/value head ``R2ᵀ W_v``, ``o_proj``'s columns of each head ``W_o R2`` (a fused q|k|v
   projection, Phi-3's ``qkv_proj``: its value rows only, ``RotationMap.value_tail``);
4. ``down_proj`` gets an online rotation of its input (:mod:`bitmosaic.modules.rotation`: a fast
   Walsh-Hadamard transform) and its transpose folded into its weight ``W R``.

The float model computes the same function (tested on every architecture with a rotation map, to
float32 rounding); its linears' inputs are free of the channel outliers a few residual dimensions
carry, which is what lets 4-bit activations work (Ashkboos et al., "QuaRot", 2024).  The surgery runs
in float64 and writes back in each weight's dtype.  Nothing here names a method.

``--rotate block[:N]`` (issue 75) does the same surgery with block-diagonal Hadamards ``I ⊗ H_N / sqrt(N)``
(R1 with random signs, R2 per head, the online one before ``down_proj``), ``N`` the weights' scale block by
default (32 for MXFP4/MXFP8 and INT g32, 16 for NVFP4): each rotation mixes values only inside one scale
block, so a block's outlier is spread over its own block and no block's power-of-two scale is set by
another block's values (BRQ, "block rotation is all you need for MXFP4", and micro-rotated GPTQ).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..algorithms.rotation import NoHadamardError, hadamard_factor, orthogonal_matrix
from ..errors import OptionError
from ..models.arch import ArchSpec
from ..modules.base import QuantModule
from ..modules.experts import unfuse_experts
from ..modules.rotation import attach_input_rotation, input_rotation_spec, online_spec
from .spin import learn_rotation, on_device

__all__ = ["ROTATIONS", "RotationSpec", "check_rotatable", "parse_rotation", "prepare_rotation",
           "rotate_model", "rotated_state"]  # fmt: skip

ROTATIONS = ("none", "hadamard", "random", "spinquant", "block")


@dataclass(frozen=True)
class RotationSpec:
    """A ``--rotate`` value: ``kind``, and for ``spinquant`` the Cayley SGD steps, learning rate and
    calibration samples per step (``batch``; the paper's is 8 sequences of 2048 tokens)."""

    kind: str = "none"
    steps: int = 100
    lr: float = 1.5
    batch: int = 1
    block: int | None = None  # --rotate block: the Hadamard's order (None: the weights' scale block)

    @property
    def label(self) -> str:
        if self.kind == "block":
            return "block" if self.block is None else f"block:{self.block}"
        default = (RotationSpec.steps, RotationSpec.lr, RotationSpec.batch)
        if self.kind != "spinquant" or (self.steps, self.lr, self.batch) == default:
            return self.kind
        batch = "" if self.batch == RotationSpec.batch else f",batch={self.batch}"
        return f"spinquant:steps={self.steps},lr={self.lr:g}{batch}"


def parse_rotation(text: str | None) -> RotationSpec:
    """``none`` | ``hadamard`` | ``random`` | ``spinquant[:steps=N,lr=X,batch=B]`` | ``block[:N]`` ->
    :class:`RotationSpec` (one-line :class:`OptionError` otherwise)."""
    text = "none" if text in (None, False) else str(text)
    kind, _, rest = text.partition(":")
    if kind not in ROTATIONS or (rest and kind not in ("spinquant", "block")):
        raise OptionError(
            f"--rotate {text!r} is not a rotation; use one of none, hadamard, random, "
            "spinquant[:steps=N,lr=X,batch=B], block[:N]"
        )
    if kind == "block":
        if rest and not (rest.isdigit() and int(rest) >= 2):
            raise OptionError(
                f"--rotate {text}: the block is a size >= 2 (e.g. block:32, or --rotate-block 32)"
            )
        return RotationSpec("block", block=int(rest) if rest else None)
    opts: dict = {}
    for item in filter(None, rest.split(",")):
        key, _, val = item.partition("=")
        try:
            opts[key] = {"steps": int, "lr": float, "batch": int}[key](val)
        except (KeyError, ValueError):
            raise OptionError(
                f"--rotate {text}: {item!r} is not steps=N, lr=X or batch=B "
                "(e.g. spinquant:steps=100,lr=1.5,batch=8)"
            ) from None
    spec = RotationSpec(kind, **opts)
    if spec.steps < 1 or spec.batch < 1 or not spec.lr > 0:
        raise OptionError(f"--rotate {text}: steps and batch must be >= 1 and lr > 0")
    return spec


def _head_dim(cfg) -> int:
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else int(cfg.hidden_size // cfg.num_attention_heads)


def _kv_heads(cfg) -> int:
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


def _refusal(model: nn.Module, arch: ArchSpec, kind: str) -> str | None:
    """Why ``model`` cannot be rotated at all (its map refuses, or its config sets what a map refuses)."""
    rmap = arch.rotation
    if rmap is None:
        return "it has no rotation map"
    if rmap.refuse:
        return rmap.refuse
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    set_ = [why for attr, why in rmap.refuse_when if getattr(cfg, attr, None) not in (None, False)]
    return set_[0] if set_ else None


def _float_weight(m: nn.Module) -> bool:
    """A float linear, or a router-like module computing ``x Wᵀ (+ b)`` from a float 2-D ``weight``."""
    if isinstance(m, nn.Linear):
        return True
    w = m._parameters.get("weight")
    return w is not None and w.is_floating_point() and w.ndim == 2 and not isinstance(m, QuantModule)


def check_rotatable(model: nn.Module, arch: ArchSpec, kind: str) -> None:  # noqa: C901
    """One-line :class:`OptionError` when ``model`` cannot be rotated with ``kind``, before any change but
    one: a mixture of experts' fused experts are unfused (:func:`~bitmosaic.modules.experts.unfuse_experts`,
    the same function; what every run does first) so that the map's expert wildcards expand."""
    rspec = parse_rotation(kind)
    kind = rspec.kind
    if kind == "none":
        return
    mtype = getattr(getattr(model, "config", None), "model_type", "?")
    why = _refusal(model, arch, kind)
    if why:
        raise OptionError(f"--rotate {kind} cannot rotate {mtype} exactly: {why}; use --rotate none")
    rmap = arch.rotation
    if any(input_rotation_spec(m) is not None for m in model.modules()):
        raise OptionError(
            "the model is already rotated (it has online rotations); rotate the float model once"
        )
    unfuse_experts(model)
    sizes = {"hidden size": model.get_submodule(rmap.embed).weight.shape[1]}
    if rmap.value and rmap.attn_out:
        sizes["head_dim"] = _head_dim(model.config)
    for layer in arch.layers(model):
        readers = (x for _, g in rmap.layer_norms(layer) for x in g)
        for n in (*rmap.layer_writers(layer), *rmap.layer_online(layer), *readers):
            if not _float_weight(layer.get_submodule(n)):
                what = type(layer.get_submodule(n)).__name__
                raise OptionError(f"--rotate needs float linears, but {n} is {what}; rotate the float model")
        for n in rmap.layer_online(layer):
            sizes.setdefault(f"{n} input", layer.get_submodule(n).in_features)
    if kind == "block":
        _check_block(rspec.block, sizes, mtype)
    elif kind in ("hadamard", "spinquant"):  # SpinQuant starts from the Hadamard rotations
        for what, n in sizes.items():
            if hadamard_factor(n) is None:
                raise OptionError(
                    f"--rotate hadamard: no Hadamard matrix of order {n} ({what} of {mtype}) is known here "
                    "(known: m·2^k with m = 1, 2 or a Paley order such as 12, 20, 28, 36); "
                    "use --rotate random"
                )


def _r2_block(block: int | None, head_dim: int) -> int | None:
    """The order of the per-head block rotation: the block, or the whole head where a head fits in one
    block (heads are block-aligned, so it still mixes only inside one scale block)."""
    return None if block is None else min(block, head_dim)


def _check_block(block: int | None, sizes: dict, mtype: str) -> None:
    """One line when a block rotation of order ``block`` cannot rotate every width in ``sizes``."""
    if block is None:
        raise OptionError("--rotate block needs a block size: give --rotate-block N (or block:N)")
    if hadamard_factor(block) is None:
        raise OptionError(
            f"--rotate block: no Hadamard matrix of order {block} is known here; use a power of two"
        )
    for what, n in sizes.items():
        if n % block and not (what == "head_dim" and block % n == 0):  # R2: a whole head inside a block
            raise OptionError(
                f"--rotate block:{block} needs every rotated width divisible by {block}, but the {what} of "
                f"{mtype} is {n}; give --rotate-block N with N dividing it"
            )


@torch.no_grad()
def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    param.copy_(value.to(param.dtype))


@torch.no_grad()
def _fold_norm(norm: nn.Module, linears: list[nn.Linear], offset: float) -> None:
    g = norm.weight.double() + offset
    for lin in linears:
        _set(lin.weight, lin.weight.double() * g[None, :])
    norm.weight.fill_(1.0 - offset)  # scale-free: 1 (Gemma: 1 + 0)
    if getattr(norm, "bias", None) is not None:
        raise OptionError(
            f"--rotate: {type(norm).__name__} has a bias, which a rotation cannot pass; use --rotate none"
        )


@torch.no_grad()
def prepare_rotation(
    model: nn.Module, arch: ArchSpec, kind: str, seed: int, block: int | None = None
) -> tuple[bool, dict]:
    """Steps 1 and 4's attachment: untie the head, fold every norm's scale into the linears reading it,
    attach the online rotations (not yet folded into the weights).  Returns (untied, online specs)."""
    rmap = arch.rotation
    embed, head = model.get_submodule(rmap.embed), model.get_submodule(rmap.head)
    tied = head.weight is embed.weight
    if tied:  # the final norm's scale goes into the head only
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
        model.config.tie_word_embeddings = False
        if hasattr(model.config, "get_text_config"):
            model.config.get_text_config().tie_word_embeddings = False
    _fold_norm(model.get_submodule(rmap.final_norm), [head], arch.norm_offset)
    online: dict[str, dict] = {}
    for li, layer in enumerate(arch.layers(model)):
        for norm, readers in rmap.layer_norms(layer):
            _fold_norm(layer.get_submodule(norm), [layer.get_submodule(n) for n in readers], arch.norm_offset)
        for n in rmap.layer_online(layer):
            lin = layer.get_submodule(n)
            spec = online_spec(kind, lin.in_features, seed + 2, block)
            attach_input_rotation(lin, spec)
            online[f"{arch.layers_path}.{li}.{n}"] = spec
    return tied, online


def rotated_state(
    model: nn.Module, arch: ArchSpec, Q1: torch.Tensor, R2: list[torch.Tensor], base: dict | None = None
) -> dict[str, torch.Tensor]:
    """The rotated values of every parameter the rotation changes, ``{name: tensor}``, of a model that
    :func:`prepare_rotation` prepared: embeddings ``E Q1``; readers ``W Q1``; writers ``Q1ᵀ W`` (bias
    ``b Q1``); the head ``W Q1``; per layer ``li`` the value rows ``R2[li]ᵀ W_v`` and output columns
    ``W_o R2[li]`` of each head; then each online rotation ``R`` folded as ``W R``.  Pure tensor
    arithmetic in the dtype of ``Q1``, differentiable in ``Q1`` and ``R2`` (the SpinQuant learner
    calls it every step); ``base``: the parameters to rotate (default: the model's own)."""
    rmap = arch.rotation
    dt = Q1.dtype
    params = base if base is not None else dict(model.named_parameters())
    get = lambda name: params[name].to(device=Q1.device, dtype=dt)  # noqa: E731
    out = {
        f"{rmap.embed}.weight": get(f"{rmap.embed}.weight") @ Q1,
        f"{rmap.head}.weight": get(f"{rmap.head}.weight") @ Q1,
    }
    for li, layer in enumerate(arch.layers(model)):
        pre = f"{arch.layers_path}.{li}."
        for _, readers in rmap.layer_norms(layer):
            for n in readers:
                out[pre + n + ".weight"] = get(pre + n + ".weight") @ Q1
        for n in rmap.layer_writers(layer):
            out[pre + n + ".weight"] = Q1.T @ get(pre + n + ".weight")
            if layer.get_submodule(n).bias is not None:
                out[pre + n + ".bias"] = get(pre + n + ".bias") @ Q1
        if rmap.value and rmap.attn_out:
            R, hd = R2[li], R2[li].shape[0]
            v, o = layer.get_submodule(rmap.value), layer.get_submodule(rmap.attn_out)
            kv, ok = pre + rmap.value, pre + rmap.attn_out
            W = out.get(kv + ".weight", get(kv + ".weight"))
            keep = W.shape[0] - _kv_heads(model.config) * hd if rmap.value_tail else 0  # fused q|k rows
            Wv = W[keep:].reshape(-1, hd, v.in_features)
            out[kv + ".weight"] = torch.cat(
                [W[:keep], torch.einsum("ji,hjd->hid", R, Wv).reshape(-1, v.in_features)]
            )
            if v.bias is not None:
                b = get(kv + ".bias")
                out[kv + ".bias"] = torch.cat([b[:keep], (b[keep:].reshape(-1, hd) @ R).reshape(-1)])
            Wo = out.get(ok + ".weight", get(ok + ".weight")).reshape(o.out_features, -1, hd)
            out[ok + ".weight"] = (Wo @ R).reshape(o.weight.shape)
        for n in rmap.layer_online(layer):
            r = layer.get_submodule(n).input_rotation
            W = out.get(pre + n + ".weight", get(pre + n + ".weight"))
            out[pre + n + ".weight"] = r(W)  # W R: the online rotation applied to W's rows
    return out


@torch.no_grad()
def rotate_model(
    model: nn.Module, arch: ArchSpec, kind: str, seed: int = 0, calib: torch.Tensor | None = None,
    act=None, progress: bool = False, device: torch.device | None = None,
) -> dict:  # fmt: skip
    """Rotate ``model`` (float, in place) as the module docstring says; returns what a saved model
    records: ``{"kind", "seed", "online": {module name: spec}, "untied": bool}`` (``{}`` for ``"none"``).
    ``kind="hadamard"``: R1 = randomised Hadamard (random signs from ``seed``), R2 and the online
    rotation plain Hadamards (refused in one line where no Hadamard of that order is known);
    ``"random"``: R1, R2 random orthogonal from ``seed``, the online one a Hadamard when known, else
    a random orthogonal matrix from ``seed``; ``"block:N"``: the Hadamard ones block-diagonal of order
    ``N`` (resolved by the caller: the weights' block); ``"spinquant[:steps=N,lr=X,batch=B]"``: R1 and each
    layer's R2 learned from the Hadamard ones on ``calib`` against the activation quantizer ``act``
    (:mod:`bitmosaic.pipeline.spin`), on ``device`` (default: where the model is)."""
    spec = parse_rotation(kind)
    if spec.kind == "none":
        return {}
    if spec.kind == "spinquant" and (calib is None or act is None):
        raise OptionError(
            "--rotate spinquant learns its rotations against the run's activation quantizer on the "
            "calibration data; this run has none (no --abits/--scheme activations): use --rotate hadamard"
        )
    check_rotatable(model, arch, spec.label)
    base = spec.kind if spec.kind in ("random", "block") else "hadamard"
    hd = _head_dim(model.config)
    d = model.get_submodule(arch.rotation.embed).weight.shape[1]
    per_head = bool(arch.rotation.value and arch.rotation.attn_out)  # no R2 where the map has none (MLA)
    try:
        Q1 = orthogonal_matrix(base, d, seed, block=spec.block)
        R2 = (
            orthogonal_matrix(base, hd, seed + 1, signs=False, block=_r2_block(spec.block, hd))
            if per_head
            else None
        )
    except NoHadamardError as e:  # check_rotatable refuses these first
        raise OptionError(str(e)) from None
    tied, online = prepare_rotation(model, arch, base, seed, spec.block)
    R2s = [R2] * len(arch.layers(model)) if per_head else []
    out = {"kind": spec.label, "seed": int(seed), "online": online, "untied": bool(tied)}
    if spec.kind == "spinquant":
        with torch.enable_grad(), on_device(model, arch, device):
            Q1, R2s, out["learned"] = learn_rotation(
                model, arch, (Q1, R2s), calib, act, spec, rotated_state, progress
            )
    for name, value in rotated_state(model, arch, Q1, R2s).items():
        _set(model.get_parameter(name), value)
    return out
