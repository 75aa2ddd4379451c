"""SQ-format module kinds (Huang et al., §3.2).

- :class:`SQWeightLinear` (``"sq-weight"``): weights in SQ-format (Algorithm 1), stored as in
  §3.2.1 / Fig. 1 (:func:`bitmosaic.formats.sq.pack_sq`): the full-shape low tensor with the
  reserved ``v_mask`` code, the compact high values, fp16 low/high scales per bank column.  The
  forward is the *reference path*: unpack, dequantize, one float matmul (the paper's GPU results
  are simulated the same way; the split-datapath hardware of Fig. 2(a) does not exist here).
- :class:`SQActLinear` (``"packed+sq-act"``): W4 weights in the repo's packed layout
  (:class:`~bitmosaic.modules.qlinear.QuantLinear`), activations in SQ-format (Algorithm 2), the
  matmul computed as a real split:

  * ``dynamic``: per token and bank the top ``(1 - s)`` by ``|x|`` are high; a dense matmul of
    the low part (zeros at the high places) plus a sparse (CSR, gather-based) matmul of the high
    part, summed.
  * ``static``: one channel mask per linear from calibration
    (:func:`~bitmosaic.algorithms.sq.static_importance`); the weight columns are stored
    reordered high-first (``sq_perm``, saved with the model), the input is gathered by the same
    permutation, and two dense matmuls run on contiguous slices.  :meth:`dequantize_weight`
    still returns the weight in the original column order, so the
    float function is unchanged (tested).

  Quantized values are simulated in float32 (the products of INT8/INT4 codes and scales are
  exact; the accumulation is float32, not int32).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..algorithms.sq import SQWeightResult, dynamic_split, high_first_permutation, static_split
from ..algorithms.types import QuantResult
from ..formats.packing import packed_cols
from ..formats.sq import _compact_index, _pos_bits, pack_sq, parse_sq, unpack_sq
from ..formats.sq_act import ACT_SCALES, act_scale_group
from .base import NoIntForm, QuantModule
from .qlinear import QuantLinear

__all__ = ["SQWeightLinear", "SQActLinear", "STRATEGIES"]

STRATEGIES = ("dynamic", "static")


class SQWeightLinear(QuantModule):
    kind = "sq-weight"
    CONFIG_KEYS = ("sq",)

    def __init__(self, in_features: int, out_features: int, *, sq: str, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.fmt = parse_sq(sq)
        f = self.fmt
        nb = len(f.banks(in_features))
        nh = f.high_count(in_features)
        self.register_buffer("high", torch.zeros(out_features, packed_cols(nh, f.h_high), dtype=torch.uint8))
        if f.h_low:
            self.register_buffer(
                "low", torch.zeros(out_features, packed_cols(in_features, f.h_low), dtype=torch.uint8)
            )
            self.pos = None
        else:
            self.low = None
            self.register_buffer(
                "pos", torch.zeros(out_features, packed_cols(nh, _pos_bits(f)), dtype=torch.uint8)
            )
        self.register_buffer("low_scale", torch.zeros(out_features, nb, dtype=torch.float16))
        self.register_buffer("high_scale", torch.zeros(out_features, nb, dtype=torch.float16))

    @classmethod
    def from_result(cls, res: SQWeightResult, bias: torch.Tensor | None = None) -> SQWeightLinear:
        out, n = res.sq.shape
        m = cls(n, out, sq=res.sq.fmt.notation, bias=bias is not None)
        for k, v in pack_sq(res.sq).items():
            getattr(m, k).copy_(v)
        m._set_bias(bias)
        return m

    def _buffers_dict(self) -> dict[str, torch.Tensor]:
        names = ("high", "low", "pos", "low_scale", "high_scale")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    def sq_tensor(self):
        return unpack_sq(self._buffers_dict(), self.fmt, self.out_features, self.in_features)

    def dequantize_reference(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.sq_tensor().dequantize(dtype)

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize_reference(dtype)  # the reference path is the only one (module doc)

    def storage_tensors(self) -> list[torch.Tensor]:
        return list(self._buffers_dict().values())

    def layer_config(self) -> dict:
        return self._config(sq=self.fmt.notation)

    def int_form(self, allowed_bits, lossy, changes):
        raise NoIntForm(
            f"SQ-format weights ({self.fmt.notation}: high and low parts with their own scales per bank) "
            "are not one INT grid",
            fixable=False,
        )

    def mac_split(self) -> tuple[int, int]:
        """(low, high) multiply-accumulates per token: the high ones are the mask's places."""
        nh = self.fmt.high_count(self.in_features) * self.out_features
        return self.in_features * self.out_features - nh, nh

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sq={self.fmt.notation}"


class SQActLinear(QuantLinear):
    kind = "packed+sq-act"
    CONFIG_KEYS = ("sq", "strategy", "act_scale")  # + act_group, calibrated_scales when set

    def __init__(
        self,
        in_features,
        out_features,
        *,
        sq: str,
        strategy: str,
        act_scale: str = "token",
        act_group: int | None = None,
        calibrated_scales: bool = False,
        **kw,
    ):
        super().__init__(in_features, out_features, **kw)
        if strategy not in STRATEGIES:
            raise ValueError(f"SQ activation strategy must be one of {STRATEGIES}, got {strategy!r}")
        if act_scale not in ACT_SCALES:
            raise ValueError(f"SQ activation scale must be one of {ACT_SCALES}, got {act_scale!r}")
        if calibrated_scales and (strategy != "static" or act_scale == "token"):
            raise ValueError("calibrated SQ activation scales need a static mask and bank or group scales")
        self.fmt = parse_sq(sq)
        self.fmt.banks(in_features)
        self.strategy = strategy
        self.act_scale = act_scale
        g = act_scale_group(self.fmt, in_features, act_scale, act_group)  # validates act_group
        self.act_group = int(act_group) if act_scale == "group" else None
        self.calibrated_scales = bool(calibrated_scales)
        if strategy == "static":
            dt = torch.int16 if in_features <= 32767 else torch.int32
            self.register_buffer("sq_perm", torch.arange(in_features, dtype=dt))
        else:
            self.sq_perm = None
        if self.calibrated_scales:
            G = -(-in_features // g)
            self.register_buffer("act_low_scale", torch.ones(G, dtype=torch.float16))
            self.register_buffer("act_high_scale", torch.ones(G, dtype=torch.float16))
        else:
            self.act_low_scale = self.act_high_scale = None

    @classmethod
    def _shared_kwargs(cls, cfg: dict) -> dict:
        # absent from models saved before per-bank/per-group activation scales existed
        opt = {"act_group": cfg.get("act_group"), "calibrated_scales": cfg.get("calibrated_scales", False)}
        return {**super()._shared_kwargs(cfg), **opt}

    @classmethod
    def from_packed(
        cls,
        dense: QuantLinear,
        sq: str,
        strategy: str,
        act_scale: str = "token",
        channel_mask: torch.Tensor | None = None,
        act_group: int | None = None,
        act_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SQActLinear:
        """The SQ-activation module of a packed W4 linear; ``channel_mask`` (static) reorders the
        stored columns high-first (Algorithm 2, line 11); ``act_scales`` (static, bank/group): the
        calibrated ``(low, high)`` scales of :func:`~bitmosaic.algorithms.sq.static_act_scales`."""
        kind = {
            "sq": parse_sq(sq).notation,
            "strategy": strategy,
            "act_scale": act_scale,
            "act_group": act_group,
            "calibrated_scales": act_scales is not None,
        }
        if strategy == "dynamic":
            return cls._from_packed(dense, **kind)
        if channel_mask is None:
            raise ValueError("static SQ activations need a channel mask from calibration")
        fmt = parse_sq(sq)
        if int(channel_mask.sum()) != fmt.high_count(dense.in_features):
            raise ValueError("static channel mask does not hold (1-s) of every bank")
        perm = high_first_permutation(channel_mask.cpu())
        codes = dense.codes()[:, perm]
        g_idx = dense._g_idx_arg()[perm]
        zeros = dense.zeros if dense.zeros is not None else torch.zeros_like(dense.scales)
        res = QuantResult(codes=codes, scales=dense.scales.float(), zeros=zeros.float(), g_idx=g_idx)
        re = QuantLinear.from_result(
            res, bits=dense.bits, group_size=dense.group_size, symmetric=dense.symmetric, bias=dense.bias
        )
        m = cls._from_packed(re, **kind)
        m.sq_perm.copy_(perm.to(m.sq_perm.dtype))
        if act_scales is not None:
            m.act_low_scale.copy_(act_scales[0].to(torch.float16))
            m.act_high_scale.copy_(act_scales[1].to(torch.float16))
        return m

    def channel_mask(self) -> torch.Tensor | None:
        """The static high-channel mask ``[in]`` in the original channel order (``None``: dynamic)."""
        if self.sq_perm is None:
            return None
        mask = torch.zeros(self.in_features, dtype=torch.bool, device=self.sq_perm.device)
        mask[self.sq_perm[: self.fmt.high_count(self.in_features)].long()] = True
        return mask

    # -- weights: stored high-first (static), served in the original column order ----------------
    def _unpermute(self, W: torch.Tensor) -> torch.Tensor:
        if self.sq_perm is None:
            return W
        return W[:, torch.argsort(self.sq_perm.long())]

    def dequantize_reference(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._unpermute(super().dequantize_reference(dtype))

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self._unpermute(super()._dequantize(dtype))

    def _build_kernel(self):
        return None  # the split forward below dequantizes the stored weight

    def stored_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight in its stored column order (high channels first when static; a new tensor)."""
        return super()._dequantize(dtype)

    # -- the split matmul (the base's forward calls it with the weight in the original order) -------
    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        W = w.float()
        if self.strategy == "static":
            kh = self.fmt.high_count(self.in_features)
            perm = self.sq_perm.long()
            scales = None if self.act_low_scale is None else (self.act_low_scale, self.act_high_scale)
            t = static_split(x2, self.channel_mask(), self.fmt, self.act_scale, self.act_group, scales)
            low, high = t.parts(torch.float32)
            Wp = W[:, perm]  # high channels first, as stored: two dense matmuls on contiguous slices
            y = low[:, perm[kh:]] @ Wp[:, kh:].T + high[:, perm[:kh]] @ Wp[:, :kh].T
        else:
            t = dynamic_split(x2, self.fmt, self.act_scale, self.act_group)
            low, high = t.parts(torch.float32)
            y = low @ W.T + _sparse_rows(high, t.mask, self.fmt) @ W.T
        if b is not None:
            y = y + b.float()
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def int_form(self, allowed_bits, lossy, changes):
        """The packed W4 weights in the original column order (exact; static results then have
        act-order-like groups); the SQ-format activation split has no equivalent (dropped with ``lossy``)."""
        layer, values = self._packed_form()
        self._refuse_or_note(
            f"SQ-format activations ({self.fmt.notation}, {self.strategy}): neither format splits the "
            "inputs into high and low parts (dropped)",
            lossy,
            changes,
        )
        if self.sq_perm is not None:  # stored high-first: back to the original column order
            inv = torch.argsort(self.sq_perm.long())
            layer.codes, layer.g_idx, values = layer.codes[:, inv], layer.g_idx[inv], values[:, inv]
        return self._fit_grid(layer, values, allowed_bits, lossy, changes)

    def mac_split(self) -> tuple[int, int]:
        """(low, high) multiply-accumulates per token."""
        nh = self.fmt.high_count(self.in_features) * self.out_features
        return self.in_features * self.out_features - nh, nh

    def storage_tensors(self) -> list[torch.Tensor]:
        extra = [t for t in (self.sq_perm, self.act_low_scale, self.act_high_scale) if t is not None]
        return super().storage_tensors() + extra

    def layer_config(self) -> dict:
        cfg = {
            **super().layer_config(),
            "sq": self.fmt.notation,
            "strategy": self.strategy,
            "act_scale": self.act_scale,
        }
        if self.act_group is not None:
            cfg["act_group"] = self.act_group
        if self.calibrated_scales:
            cfg["calibrated_scales"] = True
        return cfg

    @property
    def act_scale_label(self) -> str:
        """``token``, ``bank``, ``group128``, with ``/calibrated`` for calibrated scales."""
        g = f"group{self.act_group}" if self.act_scale == "group" else self.act_scale
        return g + ("/calibrated" if self.calibrated_scales else "")

    @classmethod
    def describe_saved(cls, path, layer_cfgs: dict[str, dict], qc: dict) -> tuple[list[str], dict]:
        """One ``inspect`` line per SQ activation setting: format, strategy and scale granularity."""
        seen: dict[str, int] = {}
        for c in layer_cfgs.values():
            scale = f"group{c['act_group']}" if c.get("act_group") else c.get("act_scale", "token")
            calib = " (calibrated)" if c.get("calibrated_scales") else ""
            key = f"A(SQ) {c['sq']} {c['strategy']}, activation scales per {scale}{calib}"
            seen[key] = seen.get(key, 0) + 1
        return [f"sq activations   {k}: {n} layers" for k, n in seen.items()], {}

    @classmethod
    def act_compute(cls, cfg: dict) -> str:
        """SQ-format activations never run the integer kernels: the split is simulated in float32."""
        return "simulated (SQ-format activation split: float32 reference path, no integer kernel)"

    def int_act_blocker(self) -> str | None:
        return "SQ-format activation split: no integer kernel"

    def extra_repr(self) -> str:
        sq = f"A(SQ) {self.fmt.notation} {self.strategy} scales {self.act_scale_label}"
        return f"{super().extra_repr()}, {sq}"


def _sparse_rows(high: torch.Tensor, mask: torch.Tensor, fmt) -> torch.Tensor:
    """The high part as a CSR matrix with exactly ``high_count`` entries per row (gathered)."""
    rows, K = high.shape
    idx = _compact_index(mask, fmt)
    vals = high.gather(1, idx)
    nnz = idx.shape[1]
    crow = torch.arange(rows + 1, device=high.device, dtype=torch.int64) * nnz
    with warnings.catch_warnings():  # torch calls its sparse CSR support "beta"
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(
            crow, idx.reshape(-1), vals.reshape(-1), (rows, K), check_invariants=False
        )


def sq_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (SQWeightLinear, SQActLinear))]
