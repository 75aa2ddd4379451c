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

  On the CPU (no gradient, ``$BITMOSAIC_ACT_COMPUTE`` not ``sim``) INT SQ activations run in
  integers (:class:`~bitmosaic.modules.sq_int.SQIntKernel`): the split above gives each part's INT
  levels and scales, and each part's levels (int8) multiply the stored codes in int32 per run of
  columns that share one weight group and one activation scale
  (:func:`~bitmosaic.modules.intact.segmented_int_weight`; per-bank scales: the kernel's runs mode),
  equal to the float32 split up to float32 rounding.  Where the runs are not a multiple of 8 (a static
  mask whose banks keep 4 high channels, scale groups that cut banks) and for the FP pair, the split above
  runs in float32 (the products of codes and scales are exact; the accumulation is float32).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..algorithms.sq import SQWeightResult, dynamic_split, high_first_permutation, static_split
from ..algorithms.types import QuantResult
from ..formats.act import ActQuantSpec
from ..formats.packing import packed_cols, unpack_codes
from ..formats.sq import high_index, pack_sq, parse_sq, pos_bits, unpack_sq
from ..formats.sq_act import ACT_SCALES, act_scale_group
from ..kernels.intmm import IntActWeight
from .base import NoIntForm, QuantModule
from .intact import segmented_int_weight
from .qlinear import QuantLinear
from .sq_int import SQIntKernel

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
                "pos", torch.zeros(out_features, packed_cols(nh, pos_bits(f)), dtype=torch.uint8)
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
    INT_ACT_KERNELS = ("int8act",)  # INT SQ activations: both parts in integers (sq_int.py SQIntKernel)
    # the static split GEMM off the CPU (kernels/triton/sqsplit.py, issue 76); no CPU kernel weight
    KERNELS = GPU_KERNELS = ("triton_sq",)
    QUANTIZES_OWN_INPUTS = True

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
        """Static strategy on a device the Triton split GEMM runs on (CUDA; issue 76): the stored weight and
        the split in one kernel (kernels/triton/sqsplit.py).  Otherwise none: the split forward below
        dequantizes the stored weight."""
        from ..kernels.select import offers_device, select_kernel

        device = self.scales.device.type
        if self.strategy != "static" or not offers_device(self.GPU_KERNELS, device):
            return None
        kind = select_kernel(self.GPU_KERNELS, self.storage_bits, device=device, group_size=self.group_size)
        z = self._zeros_arg()
        z = z - self.code_offset if not torch.is_tensor(z) else z.float() - self.code_offset
        zeros = z.float() if torch.is_tensor(z) else torch.full_like(self.scales, z, dtype=torch.float32)
        cal = None if self.act_low_scale is None else (self.act_low_scale, self.act_high_scale)
        split = {"fmt": self.fmt, "mask": self.channel_mask(), "perm": self.sq_perm, "scale": self.act_scale,
                 "group": self.act_group, "scales": cal}  # fmt: skip
        return kind(self.qweight, self.storage_bits, self.scales.float(), zeros, self._g_idx_arg(), split)

    def _saved_from_kernel(self, k):
        """The packed buffers the Triton split kernel holds (``qweight`` itself, ``scales``/``zeros`` in
        float32 with ``code_offset`` folded, ``g_idx`` in stored order): rebuilt, checked, released."""
        out = {"qweight": lambda: k.qweight, "scales": lambda: k.scales.to(torch.float16)}
        if not self.symmetric:
            out["zeros"] = lambda: (k.zeros + self.code_offset).to(torch.float16)
        if self._buffers.get("g_idx") is not None:
            out["g_idx"] = lambda: k.g_idx.clone()
        return out

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

    # -- integer compute: each part's INT levels times the codes in int32 (modules/intact.py) --------
    def _int_parts(self, codes=None, scales=None, zeros=None, g_idx=None, merge: bool = True) -> dict | str:
        """``{part: (weight, stored columns, scale column per group or run, scale column per column, run)}``
        (``run``: :func:`~bitmosaic.modules.intact.segmented_int_weight`'s) for the
        integer path (``"both"``: the dynamic strategy's low and high parts over every column;
        ``"high"``/``"low"``: the static strategy's two contiguous slices of the high-first stored
        columns; ``"merged"`` alone: both static parts as one weight, where the extension runs it and
        ``merge``), or why not."""
        f, K = self.fmt, self.in_features
        if f.fp:
            return "FP SQ-format activations (fp8/fp4): no CPU instruction"
        if codes is None:
            codes = unpack_codes(self.qweight, self.storage_bits, K)
            z = self._zeros_arg()
            zeros = z - self.code_offset if not torch.is_tensor(z) else z.float() - self.code_offset
            scales, g_idx = self.scales, self._g_idx_arg()
        g = act_scale_group(f, K, self.act_scale, self.act_group)
        gs = K if self.group_size is None or self.group_size < 1 else self.group_size
        if self.strategy == "static":  # runs that would depend on which channels of a bank are high
            for what, width in (("weight groups", gs), ("activation scale groups", g)):
                if width < K and width % f.bank:
                    return f"static mask with {what} of {width} that cut its banks of {f.bank}"
            natural = torch.arange(K) // gs
            if not torch.equal(g_idx.cpu().long()[torch.argsort(self.sq_perm.long().cpu())], natural):
                return "static mask on act-order weights"
        elif self.g_idx is not None:
            return "act-order weights"
        cols = torch.arange(K)
        orig = cols if self.sq_perm is None else self.sq_perm.long().cpu()  # stored column -> channel
        if self.strategy == "dynamic":
            sel = {"both": cols}
        else:
            kh = f.high_count(K)
            sel = {"high": cols[:kh], **({"low": cols[kh:]} if f.h_low else {})}
        if merge and len(sel) == 2 and kh % 8 == 0 and IntActWeight.compiled():
            # both static parts as one weight, one product (the low part's scales after the high's); it
            # segments only where each part does, so the parts are built only where it cannot be
            ids = torch.cat([orig[:kh] // g, orig[kh:] // g + -(-K // g)])
            r = segmented_int_weight(codes, self.storage_bits, scales, zeros, g_idx.cpu(), cols, ids)
            if not isinstance(r, str):
                return {"merged": (r[0], cols, r[1], ids, r[2])}
        parts = {}
        for name, c in sel.items():
            r = segmented_int_weight(codes, self.storage_bits, scales, zeros, g_idx.cpu(), c, orig[c] // g)
            if isinstance(r, str):
                return f"SQ-format {name} part: {r}"
            parts[name] = (r[0], c, r[1], orig[c] // g, r[2])
        return parts

    @classmethod
    def act_compute(cls, cfg: dict) -> str:
        """The integer path where the parts' runs allow it (decided on natural-order weights with the
        saved bank, scale and group settings: a static mask's runs depend only on its banks), else
        simulated with the reason."""
        from .intact import act_path_label

        K, gs = int(cfg["in_features"]), cfg.get("group_size") or -1
        m = cls(K, 1, **{k: cfg[k] for k in ("sq", "strategy", "act_scale")}, act_group=cfg.get("act_group"),
                bits=cfg.get("bits", 4), group_size=gs, symmetric=True,
                has_g_idx=bool(cfg.get("has_g_idx")) and cfg["strategy"] == "dynamic")  # fmt: skip
        fmt = m.fmt
        if m.sq_perm is not None:  # a mask with the bank's first (1 - s) b channels high
            mask = torch.zeros(K, dtype=torch.bool)
            for start, _size, nh in fmt.banks(K):
                mask[start : start + nh] = True
            m.sq_perm.copy_(high_first_permutation(mask).to(m.sq_perm.dtype))
        g_idx = torch.arange(K) // (K if gs < 1 else gs)
        if m.sq_perm is not None:
            g_idx = g_idx[m.sq_perm.long()]
        parts = m._int_parts(torch.zeros(1, K, dtype=torch.int32), torch.ones(1, K), 0.0, g_idx)
        blocker = parts if isinstance(parts, str) else None
        return act_path_label(blocker, ActQuantSpec("int", fmt.h_high))

    def int_act_blocker(self) -> str | None:
        parts = self._int_parts()
        return parts if isinstance(parts, str) else None

    def _build_int_act(self):
        parts = self._int_parts()
        return None if isinstance(parts, str) else SQIntKernel(self, parts)

    def extra_repr(self) -> str:
        sq = f"A(SQ) {self.fmt.notation} {self.strategy} scales {self.act_scale_label}"
        return f"{super().extra_repr()}, {sq}"


def _sparse_rows(high: torch.Tensor, mask: torch.Tensor, fmt) -> torch.Tensor:
    """The high part as a CSR matrix with exactly ``high_count`` entries per row (gathered)."""
    rows, K = high.shape
    idx = high_index(mask, fmt)
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
