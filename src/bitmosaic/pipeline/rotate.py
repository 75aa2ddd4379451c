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
   each key/value head ``R2ᵀ W_v``, ``o_proj``'s columns of each head ``W_o R2``;
4. ``down_proj`` gets an online rotation of its input (:mod:`bitmosaic.modules.rotation`: a fast
   Walsh-Hadamard transform) and its transpose folded into its weight ``W R``.

The float model computes the same function (tested on every architecture with a rotation map, to
float32 rounding); its linears' inputs are free of the channel outliers a few residual dimensions
carry, which is what lets 4-bit activations work (Ashkboos et al., "QuaRot", 2024).  The surgery runs
in float64 and writes back in each weight's dtype.  Nothing here names a method.
"""

from __future__ import annotations

import torch
from torch import nn

from ..algorithms.rotation import NoHadamardError, hadamard_factor, hadamard_transform, orthogonal_matrix
from ..errors import OptionError
from ..models.arch import ArchSpec
from ..modules.rotation import attach_input_rotation, input_rotation_spec, online_spec

__all__ = ["ROTATIONS", "rotate_model", "check_rotatable"]

ROTATIONS = ("none", "hadamard", "random")


def _head_dim(cfg) -> int:
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else int(cfg.hidden_size // cfg.num_attention_heads)


def check_rotatable(model: nn.Module, arch: ArchSpec, kind: str) -> None:
    """One-line :class:`OptionError` when ``model`` cannot be rotated with ``kind`` (before any change)."""
    if kind not in ROTATIONS:
        raise OptionError(f"--rotate {kind!r} is not a rotation; use one of {', '.join(ROTATIONS)}")
    if kind == "none":
        return
    mtype = getattr(getattr(model, "config", None), "model_type", "?")
    rmap = arch.rotation
    if rmap is None or rmap.refuse:
        why = rmap.refuse if rmap is not None else "it has no rotation map"
        raise OptionError(f"--rotate {kind} cannot rotate {mtype} exactly: {why}; use --rotate none")
    if any(input_rotation_spec(m) is not None for m in model.modules()):
        raise OptionError(
            "the model is already rotated (it has online rotations); rotate the float model once"
        )
    layer = arch.layers(model)[0]
    for n in (*rmap.writers, *rmap.online, *(x for _, g in rmap.norms for x in g)):
        if not isinstance(layer.get_submodule(n), nn.Linear):
            what = type(layer.get_submodule(n)).__name__
            raise OptionError(f"--rotate needs float linears, but {n} is {what}; rotate the float model")
    if kind == "hadamard":
        d = model.get_submodule(rmap.embed).weight.shape[1]
        sizes = {"hidden size": d, "head_dim": _head_dim(model.config)}
        for n in rmap.online:
            sizes[f"{n} input"] = layer.get_submodule(n).in_features
        for what, n in sizes.items():
            if hadamard_factor(n) is None:
                raise OptionError(
                    f"--rotate hadamard: no Hadamard matrix of order {n} ({what} of {mtype}) is known here "
                    "(known: m·2^k with m = 1, 2 or a Paley order such as 12, 20, 28, 36); "
                    "use --rotate random"
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
def _rotate_input(lin: nn.Linear, Q: torch.Tensor) -> None:
    _set(lin.weight, lin.weight.double() @ Q.to(lin.weight.device))


@torch.no_grad()
def _rotate_output(lin: nn.Linear, Q: torch.Tensor) -> None:
    Q = Q.to(lin.weight.device)
    _set(lin.weight, Q.T @ lin.weight.double())
    if lin.bias is not None:
        _set(lin.bias, lin.bias.double() @ Q)


@torch.no_grad()
def _rotate_heads(v: nn.Linear, o: nn.Linear, R: torch.Tensor) -> None:
    hd = R.shape[0]
    R = R.to(v.weight.device)
    Wv = v.weight.double().reshape(-1, hd, v.in_features)  # [kv heads, hd, d]
    _set(v.weight, torch.einsum("ji,hjd->hid", R, Wv).reshape(v.weight.shape))
    if v.bias is not None:
        _set(v.bias, (v.bias.double().reshape(-1, hd) @ R).reshape(-1))
    Wo = o.weight.double().reshape(o.out_features, -1, hd)  # [d, heads, hd]
    _set(o.weight, (Wo @ R).reshape(o.weight.shape))


@torch.no_grad()
def _fold_online(lin: nn.Linear, spec: dict) -> None:
    """``W R`` with ``R`` the online rotation (``x R`` at run time), then attach it."""
    r = attach_input_rotation(lin, spec)
    W = lin.weight.double()
    _set(lin.weight, hadamard_transform(W) if r.type == "hadamard" else W @ r.matrix(W.device, W.dtype))


@torch.no_grad()
def rotate_model(model: nn.Module, arch: ArchSpec, kind: str, seed: int = 0) -> dict:
    """Rotate ``model`` (float, in place) as the module docstring says; returns what a saved model
    records: ``{"kind", "seed", "online": {module name: spec}, "untied": bool}`` (``{}`` for ``"none"``).
    ``kind="hadamard"``: R1 = randomised Hadamard (random signs from ``seed``), R2 and the online
    rotation plain Hadamards (refused in one line where no Hadamard of that order is known);
    ``"random"``: R1, R2 random orthogonal from ``seed``, the online one a Hadamard when known, else
    a random orthogonal matrix from ``seed``."""
    check_rotatable(model, arch, kind)
    if kind == "none":
        return {}
    rmap = arch.rotation
    embed = model.get_submodule(rmap.embed)
    head = model.get_submodule(rmap.head)
    d = embed.weight.shape[1]
    try:
        Q1 = orthogonal_matrix(kind, d, seed)
        R2 = orthogonal_matrix(kind, _head_dim(model.config), seed + 1, signs=False)
    except NoHadamardError as e:  # check_rotatable refuses these first
        raise OptionError(str(e)) from None
    offset = arch.norm_offset
    tied = head.weight is embed.weight
    if tied:  # the final norm's scale goes into the head only
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
        model.config.tie_word_embeddings = False
        if hasattr(model.config, "get_text_config"):
            model.config.get_text_config().tie_word_embeddings = False
    _set(embed.weight, embed.weight.double() @ Q1.to(embed.weight.device))
    _fold_norm(model.get_submodule(rmap.final_norm), [head], offset)
    _rotate_input(head, Q1)
    online: dict[str, dict] = {}
    for li, layer in enumerate(arch.layers(model)):
        for norm, readers in rmap.norms:
            lins = [layer.get_submodule(n) for n in readers]
            _fold_norm(layer.get_submodule(norm), lins, offset)
            for lin in lins:
                _rotate_input(lin, Q1)
        for n in rmap.writers:
            _rotate_output(layer.get_submodule(n), Q1)
        if rmap.value and rmap.attn_out:
            _rotate_heads(layer.get_submodule(rmap.value), layer.get_submodule(rmap.attn_out), R2)
        for n in rmap.online:
            lin = layer.get_submodule(n)
            spec = online_spec(kind, lin.in_features, seed + 2)
            _fold_online(lin, spec)
            online[f"{arch.layers_path}.{li}.{n}"] = spec
    return {"kind": kind, "seed": int(seed), "online": online, "untied": bool(tied)}
