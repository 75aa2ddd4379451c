"""SQ-format: the sparse-quantized data format (Huang et al., "SQ-format", §3.1, Eq. 1).

``SQ-format(X) = (X_quant, S_quant, m, h_high, h_low, b, s)``: the operand ``X`` (``[rows, K]``,
``K`` the reduction dimension of the matmul) is split into banks of ``b`` consecutive values along
``K``; in every bank of every row exactly ``(1 - s) b`` values are *high* precision (``h_high``
bits) and the rest *low* precision (``h_low`` bits).  Only one operand of a matmul is in SQ-format;
the other uses an ordinary quantizer.  Integer grids are symmetric (§3.2.1); the FP pair is
FP8 E4M3 / FP4 E2M1 (App. 8).  NVIDIA 2:4 sparsity is the special case ``b=4, s=0.5, h_low=0``.

Weight storage (§3.2.1, Fig. 1) -- :func:`pack_sq` / :func:`unpack_sq`:

- ``low``: the low-precision tensor keeps its full ``[rows, K]`` shape; the high-precision places
  hold the reserved code ``v_mask`` (so the mask is implicit).  Codes are packed densely at
  ``h_low`` bits (:mod:`bitmosaic.formats.packing`).
- ``high``: the high-precision values, compact per bank (bank order, then position order inside
  the bank; no gaps), ``[rows, nbanks * (1 - s) b]`` packed at ``h_high`` bits.
- ``h_low = 0`` (pruning, the 2:4 case) has no low tensor to carry the mask: the position of every
  kept value inside its bank is stored explicitly, ``ceil(log2 b)`` bits each (2 bits for 2:4,
  NVIDIA's metadata).
- scales: fp16, one low and one high scale per (row, scale group); for weights the group is one
  bank ("each column of each bank ... as a group", Fig. 1).  For activations the group is chosen
  (:mod:`bitmosaic.formats.sq_act`): the whole token, one bank, or ``G`` channels with
  ``G`` independent of the bank.  The paper does not print the activation scale granularity, but
  its Table 2 (dynamic perplexity worsens as the bank grows at fixed ``s``) fits per-bank scales.

The reserved code.  The paper's two examples do not fit one encoding: for INT2 it says values
``{-1, 0, 1}`` are normal and ``v_mask = 2`` (2 is not an INT2 two's-complement value; as an
offset code it would leave ``-2`` unused), and for INT4 Fig. 1 uses ``v_mask = 15`` (an *unsigned*
code, which symmetric quantization with levels ``-7..7`` offset by 7 would also leave free, but
INT2 ``+2`` and INT4 ``15`` are not the same rule).  We reserve the one code that symmetric
quantization never uses, ``-2^(h-1)`` (two's complement), so the low levels are
``±(2^(h-1) - 1)``; stored as unsigned ``c + 2^(h-1)``, ``v_mask`` is code 0.  High values use
the same symmetric levels ``±(2^(h-1) - 1)``.  For FP4 the reserved code is ``-0`` (sign bit
alone, ``0b1000``); a low value that rounds to zero is always stored as ``+0``.

Bits.  The paper's equivalent bits leave scales out: weights ``x = (1 - s) h_high + h_low``
(every place has a low code, Fig. 1), activations ``y = (1 - s) h_high + s h_low`` plus, for static
masks, one bit per channel.  :func:`measured_bits` counts the real stored buffers, scales included
(two fp16 scales per bank column add ``32 / b`` bits per weight);
:func:`~bitmosaic.formats.sq_act.act_scale_bits` is the
activation scales' share (``32 / G`` per value for two fp16 scales per token and group of ``G``
channels; amortised over the tokens when the scales are calibrated once per linear).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ..errors import OptionError
from .fp import fp_round, get_float_format
from .packing import pack_codes, unpack_codes

__all__ = [
    "BANKS",
    "SPARSITIES",
    "INT_PAIRS",
    "SQFormat",
    "SQTensor",
    "parse_sq",
    "bank_topk_mask",
    "check_mask",
    "sq_quantize",
    "pack_sq",
    "unpack_sq",
    "measured_bits",
    "quantize_part",
    "weight_name",
    "act_name",
    "MIN_SCALE",
    "fp16_scale",
    "fp4_encode",
    "fp4_decode",
    "fp8_encode",
    "fp8_decode",
    "high_index",
    "pos_bits",
]

BANKS = (4, 8, 16, 32, 64, 128)
SPARSITIES = (0.5, 0.75, 0.875, 0.9375)
INT_PAIRS = ((8, 4), (8, 3), (8, 2), (4, 2))
FP_HIGH, FP_LOW = "e4m3", "e2m1"  # the FP8/FP4 pair (App. 8)
MIN_SCALE = 2.0**-24  # smallest positive fp16 (subnormal): scales stay fp16-exact and nonzero
# E2M1 magnitudes by 3-bit code (exponent, mantissa): 0, 0.5, 1, 1.5, 2, 3, 4, 6
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


@dataclass(frozen=True)
class SQFormat:
    """One SQ-format setting ``b-(h_high/h_low)-s`` (paper §4.1 notation).

    ``fp=True``: the FP8 (E4M3) / FP4 (E2M1) pair, written ``b-(fp8/fp4)-s``.  ``h_low=0`` drops
    the low part (structured pruning; 2:4 is ``4-(8/0)-0.5`` or with 16-bit values ``4-(16/0)-0.5``
    as far as the mask is concerned; the values here are at most 8 bits).
    ``partial_last_bank``: allow a reduction width that is not a multiple of ``b``; the last bank
    of ``r < b`` values keeps ``ceil((1 - s) r)`` high values.
    """

    bank: int
    h_high: int
    h_low: int
    sparsity: float
    fp: bool = False
    partial_last_bank: bool = False

    def __post_init__(self) -> None:
        if self.bank not in BANKS:
            raise OptionError(f"SQ bank size must be one of {BANKS}, got {self.bank}")
        if self.sparsity not in SPARSITIES:
            raise OptionError(f"SQ sparsity must be one of {SPARSITIES}, got {self.sparsity}")
        nh = (1 - self.sparsity) * self.bank
        if nh != int(nh) or nh < 1:
            raise OptionError(
                f"SQ bank {self.bank} at sparsity {self.sparsity} keeps (1-s)*b = {nh} high values per "
                "bank, which is not a positive integer; use a larger bank or a smaller sparsity"
            )
        if self.fp:
            if (self.h_high, self.h_low) not in ((8, 4), (8, 0)):
                raise OptionError(f"the FP SQ pair is (fp8/fp4) (or fp8/0), got ({self.h_high}/{self.h_low})")
        elif (self.h_high, self.h_low) not in INT_PAIRS and not (self.h_low == 0 and self.h_high in (4, 8)):
            raise OptionError(
                f"SQ precision pair ({self.h_high}/{self.h_low}) is not supported; use one of "
                f"{', '.join(f'({a}/{b})' for a, b in INT_PAIRS)} or (8/0), (4/0) for pruning"
            )

    # -- shape ----------------------------------------------------------------------------------
    @property
    def n_high(self) -> int:
        """High-precision values per full bank, ``(1 - s) b``."""
        return int((1 - self.sparsity) * self.bank)

    def banks(self, K: int) -> list[tuple[int, int, int]]:
        """``(start, size, n_high)`` of every bank of a reduction width ``K`` (validated)."""
        if K < 1:
            raise ValueError(f"reduction width must be positive, got {K}")
        full, rest = divmod(K, self.bank)
        if rest and not self.partial_last_bank:
            raise ValueError(
                f"reduction width {K} is not a multiple of the SQ bank size {self.bank}; pick a bank that "
                "divides it, or allow a partial last bank (partial_last_bank=True)"
            )
        out = [(i * self.bank, self.bank, self.n_high) for i in range(full)]
        if rest:
            out.append((full * self.bank, rest, math.ceil((1 - self.sparsity) * rest)))
        return out

    def high_count(self, K: int) -> int:
        return sum(nh for _, _, nh in self.banks(K))

    # -- grids ----------------------------------------------------------------------------------
    @property
    def qmax_high(self) -> float:
        return get_float_format(FP_HIGH).max_value if self.fp else float((1 << (self.h_high - 1)) - 1)

    @property
    def qmax_low(self) -> float:
        if self.h_low == 0:
            return 0.0
        return get_float_format(FP_LOW).max_value if self.fp else float((1 << (self.h_low - 1)) - 1)

    @property
    def v_mask(self) -> int:
        """The reserved low code as stored (unsigned): 0 (= ``-2^(h-1)``) for INT, ``0b1000``
        (``-0``) for FP4."""
        if self.h_low == 0:
            raise ValueError("h_low = 0 has no low tensor and no v_mask (positions are stored explicitly)")
        return 0b1000 if self.fp else 0

    # -- names and bits -------------------------------------------------------------------------
    @property
    def notation(self) -> str:
        pair = f"fp{self.h_high}/fp{self.h_low}" if self.fp else f"{self.h_high}/{self.h_low}"
        return f"{self.bank}-({pair})-{self.sparsity:g}"

    @property
    def paper_weight_bits(self) -> float:
        """``x = (1 - s) h_high + h_low`` (§4.1): the paper's W(SQx) number (scales left out)."""
        return (1 - self.sparsity) * self.h_high + self.h_low

    def paper_act_bits(self, static: bool = False, tokens: int | None = None) -> float:
        """``y = (1 - s) h_high + s h_low`` (§4.1), plus the static mask's one bit per channel
        spread over ``tokens`` rows when given (the paper calls it negligible)."""
        y = (1 - self.sparsity) * self.h_high + self.sparsity * self.h_low
        return y + (1.0 / tokens if static and tokens else 0.0)


_SQ_RE = re.compile(r"\s*(\d+)\s*-\s*\(\s*(fp)?(\d+)\s*/\s*(fp)?(\d+)\s*\)\s*-\s*([0-9.]+)\s*", re.I)


def parse_sq(text: str | SQFormat, partial_last_bank: bool = False) -> SQFormat:
    """``"16-(8/4)-0.5"`` -> bank 16, INT8/INT4, s = 0.5; ``"64-(fp8/fp4)-0.875"`` the FP pair."""
    if isinstance(text, SQFormat):
        return text
    m = _SQ_RE.fullmatch(text)
    if not m:
        raise OptionError(
            f"SQ setting {text!r} is not of the form <bank>-(<high>/<low>)-<sparsity>, e.g. 16-(8/4)-0.5 "
            "or 64-(fp8/fp4)-0.875"
        )
    fp_h, fp_l = bool(m.group(2)), bool(m.group(4))
    if fp_h != fp_l and int(m.group(5)) != 0:
        raise OptionError(f"SQ setting {text!r} mixes FP and INT; write both as fpN or both as N")
    try:
        sparsity = float(m.group(6))
    except ValueError:  # "0.5.5": the pattern admits any run of digits and dots
        raise OptionError(f"SQ setting {text!r}: sparsity {m.group(6)!r} is not a number, e.g. 0.5") from None
    return SQFormat(int(m.group(1)), int(m.group(3)), int(m.group(5)), sparsity, fp_h, partial_last_bank)


def weight_name(fmt: SQFormat, abits: int | None) -> str:
    """The paper's ``W(SQx)Ay`` name (Algorithm 1), ``A16`` for unquantized activations."""
    return f"W(SQ{fmt.paper_weight_bits:g})A{abits or 16}"


def act_name(wbits: int, fmt: SQFormat) -> str:
    """The paper's ``WxA(SQy)`` name (Algorithm 2)."""
    return f"W{wbits}A(SQ{fmt.paper_act_bits():g})"


# -- masks ------------------------------------------------------------------------------------
def bank_topk_mask(importance: torch.Tensor, fmt: SQFormat) -> torch.Tensor:
    """Boolean ``[rows, K]``: in every bank of every row the ``n_high`` largest ``importance``
    (ties broken towards the lower position, deterministically)."""
    rows, K = importance.shape
    mask = torch.zeros(rows, K, dtype=torch.bool, device=importance.device)
    imp = importance.float()
    full = [bk for bk in fmt.banks(K) if bk[1] == fmt.bank]
    if full:
        nb = len(full)
        x = imp[:, : nb * fmt.bank].reshape(rows, nb, fmt.bank)
        idx = torch.argsort(-x, dim=-1, stable=True)[..., : fmt.n_high]
        m = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, idx, True)
        mask[:, : nb * fmt.bank] = m.reshape(rows, -1)
    for start, size, nh in fmt.banks(K)[len(full) :]:
        idx = torch.argsort(-imp[:, start : start + size], dim=-1, stable=True)[:, :nh]
        mask[:, start : start + size].scatter_(-1, idx, True)
    return mask


def check_mask(mask: torch.Tensor, fmt: SQFormat) -> None:
    """Raise unless every bank of every row holds exactly its required number of high values."""
    for start, size, nh in fmt.banks(mask.shape[-1]):
        counts = mask[..., start : start + size].sum(-1)
        if not bool((counts == nh).all()):
            raise ValueError(
                f"SQ mask: a bank at column {start} holds {int(counts.min())}..{int(counts.max())} high "
                f"values, the format needs exactly {nh}"
            )


# -- quantization -----------------------------------------------------------------------------
def _expand(scale: torch.Tensor, group: int, K: int) -> torch.Tensor:
    return scale.repeat_interleave(group, dim=-1)[..., :K]


def fp16_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """The fp16-exact scale of a part whose absmax is ``amax`` on the grid ``±qmax``: ``amax / qmax``
    clamped to ``[MIN_SCALE, 65504]`` and rounded to fp16 (float32 values)."""
    s = (amax.float() / qmax).clamp(min=MIN_SCALE, max=65504.0)
    return s.to(torch.float16).float()


def part_scales(X: torch.Tensor, mask: torch.Tensor, fmt: SQFormat, group: int) -> tuple[torch.Tensor, ...]:
    """fp16-exact ``(low_scale, high_scale)`` ``[rows, ceil(K / group)]``: each part's own absmax
    over its own places (the low scale never sees the high values), divided by its grid maximum."""
    rows, K = X.shape
    G = -(-K // group)
    pad = G * group - K
    a = X.detach().abs().float()
    lo = a.masked_fill(mask, 0)
    hi = a.masked_fill(~mask, 0)
    if pad:
        lo, hi = (torch.nn.functional.pad(t, (0, pad)) for t in (lo, hi))
    lo = lo.reshape(rows, G, group).amax(-1)
    hi = hi.reshape(rows, G, group).amax(-1)
    low_scale = fp16_scale(lo, fmt.qmax_low) if fmt.h_low else torch.ones_like(lo)
    return low_scale, fp16_scale(hi, fmt.qmax_high)


def _round_part(x: torch.Tensor, fp_fmt: str, qmax: float, fp: bool) -> torch.Tensor:
    if fp:
        return fp_round(x, fp_fmt)
    return torch.round(x).clamp_(-qmax, qmax)


def round_high(x: torch.Tensor, fmt: SQFormat) -> torch.Tensor:
    """``x / scale`` -> the high grid (symmetric INT levels or E4M3 values)."""
    return _round_part(x, FP_HIGH, fmt.qmax_high, fmt.fp)


def round_low(x: torch.Tensor, fmt: SQFormat) -> torch.Tensor:
    """``x / scale`` -> the low grid (symmetric INT levels ``±(2^(h-1)-1)``, or E2M1), or 0 when pruned."""
    if fmt.h_low == 0:
        return torch.zeros_like(x)
    return _round_part(x, FP_LOW, fmt.qmax_low, fmt.fp)


def quantize_part(x: torch.Tensor, fmt: SQFormat, high: bool) -> torch.Tensor:
    """One precision part on its own (the static strategy after reordering: a dense slice of
    high or low channels), one scale per row (token); returns the dequantized values."""
    if not high and fmt.h_low == 0:
        return torch.zeros_like(x)
    qmax = fmt.qmax_high if high else fmt.qmax_low
    s = fp16_scale(x.detach().abs().float().amax(-1, keepdim=True), qmax)
    v = (round_high if high else round_low)(x.float() / s, fmt)
    return (v * s).to(x.dtype)


@dataclass
class SQTensor:
    """Eq. 1 decoded: ``low``/``high`` are grid values (INT levels or FP grid values, float32)
    at their places (0 elsewhere), ``mask`` the high places, scales ``[rows, G]`` per ``group``."""

    fmt: SQFormat
    mask: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    low_scale: torch.Tensor
    high_scale: torch.Tensor
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.mask.shape)

    def parts(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``(low part, high part)`` dequantized, each ``[rows, K]`` with zeros at the other's places."""
        K = self.mask.shape[-1]
        lo = self.low.float() * _expand(self.low_scale.float(), self.group, K)
        hi = self.high.float() * _expand(self.high_scale.float(), self.group, K)
        return lo.masked_fill(self.mask, 0).to(dtype), hi.masked_fill(~self.mask, 0).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        lo, hi = self.parts(torch.float32)
        return (lo + hi).to(dtype)


def sq_quantize(
    X: torch.Tensor,
    mask: torch.Tensor,
    fmt: SQFormat,
    group: int | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> SQTensor:
    """Quantize ``X`` ``[rows, K]`` to SQ-format with the given high ``mask`` (Algorithm 1 lines
    9-10: the two parts separately, each with its own scale per ``group``; default one bank)."""
    if X.dim() != 2 or mask.shape != X.shape:
        raise ValueError(
            f"X and mask must be the same 2-D shape, got {tuple(X.shape)} and {tuple(mask.shape)}"
        )
    check_mask(mask, fmt)
    group = group or fmt.bank
    ls, hs = scales if scales is not None else part_scales(X, mask, fmt, group)
    K = X.shape[1]
    Xf = X.float()
    low = round_low(Xf / _expand(ls, group, K), fmt).masked_fill(mask, 0)
    high = round_high(Xf / _expand(hs, group, K), fmt).masked_fill(~mask, 0)
    low = low + 0.0  # -0 -> +0: a low zero is never the reserved -0 code
    return SQTensor(fmt, mask, low, high, ls.float(), hs.float(), group)


# -- storage (§3.2.1, Fig. 1) -----------------------------------------------------------------
def fp4_encode(v: torch.Tensor) -> torch.Tensor:
    """The 4-bit FP4 E2M1 codes (sign bit 3, magnitude code bits 0-2) of values already on the grid."""
    mag = torch.searchsorted(_E2M1.to(v.device), v.abs().contiguous())
    sign = ((v < 0) | ((v == 0) & torch.signbit(v))).to(torch.int32) << 3
    return mag.to(torch.int32) | sign


def fp4_decode(c: torch.Tensor) -> torch.Tensor:
    """The values (float32) of FP4 E2M1 codes (inverse of :func:`fp4_encode`)."""
    mag = _E2M1.to(c.device)[(c & 7).long()]
    return torch.where((c & 8) != 0, -mag, mag)


def fp8_encode(v: torch.Tensor) -> torch.Tensor:
    """The 8-bit FP8 E4M3 codes (int32) of ``v`` (its bits as ``float8_e4m3fn``)."""
    return v.float().to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)


def fp8_decode(c: torch.Tensor) -> torch.Tensor:
    """The values (float32) of FP8 E4M3 codes (inverse of :func:`fp8_encode`)."""
    return c.to(torch.uint8).view(torch.float8_e4m3fn).float()


def high_index(mask: torch.Tensor, fmt: SQFormat) -> torch.Tensor:
    """Column of every high value, ``[rows, high_count]`` in bank order then position order."""
    rows, K = mask.shape
    banks = fmt.banks(K)
    nb = sum(1 for _, size, _ in banks if size == fmt.bank)
    # a stable sort of ~mask puts the True places first, in position order, bank by bank
    low = (~mask).to(torch.int8)
    full = torch.argsort(low[:, : nb * fmt.bank].reshape(rows, nb, fmt.bank), dim=-1, stable=True)
    off = torch.arange(nb, device=mask.device).reshape(1, nb, 1) * fmt.bank
    parts = [(full[..., : fmt.n_high] + off).reshape(rows, -1)]
    for start, size, nh in banks[nb:]:
        parts.append(torch.argsort(low[:, start : start + size], dim=-1, stable=True)[:, :nh] + start)
    return torch.cat(parts, dim=1)


def pack_sq(t: SQTensor) -> dict[str, torch.Tensor]:
    """The stored buffers: ``low`` (uint8, ``h_low`` bits, ``v_mask`` at high places; absent when
    ``h_low = 0``), ``high`` (uint8, compact, ``h_high`` bits), ``pos`` (uint8, in-bank position of
    each high value, only when ``h_low = 0``), ``low_scale``/``high_scale`` (fp16)."""
    fmt = t.fmt
    check_mask(t.mask, fmt)
    idx = high_index(t.mask, fmt)
    hv = t.high.float().gather(1, idx)
    if fmt.fp:
        hc = fp8_encode(hv)
    else:
        hc = hv.round().to(torch.int32) + (1 << (fmt.h_high - 1))
    out = {"high": pack_codes(hc, fmt.h_high)}
    if fmt.h_low:
        lv = t.low.float()
        if fmt.fp:
            lc = torch.where(t.mask, fmt.v_mask, fp4_encode(lv))
        else:
            lc = torch.where(t.mask, fmt.v_mask, lv.round().to(torch.int32) + (1 << (fmt.h_low - 1)))
        out["low"] = pack_codes(lc.to(torch.int32), fmt.h_low)
    else:
        starts = torch.tensor(
            [s for s, _, nh in fmt.banks(t.mask.shape[1]) for _ in range(nh)], device=idx.device
        )
        out["pos"] = pack_codes((idx - starts).to(torch.int32), pos_bits(fmt))
    out["low_scale"] = t.low_scale.to(torch.float16)
    out["high_scale"] = t.high_scale.to(torch.float16)
    return out


def pos_bits(fmt: SQFormat) -> int:
    """Bits of each stored in-bank position (``h_low = 0``: ``pos``): ``ceil(log2 bank)``, at least 2."""
    return max(2, math.ceil(math.log2(fmt.bank)))


def unpack_sq(
    buf: dict[str, torch.Tensor], fmt: SQFormat, rows: int, K: int, group: int | None = None
) -> SQTensor:
    """Exact inverse of :func:`pack_sq`."""
    group = group or fmt.bank
    n = fmt.high_count(K)
    hc = unpack_codes(buf["high"], fmt.h_high, n)
    hv = fp8_decode(hc) if fmt.fp else (hc - (1 << (fmt.h_high - 1))).float()
    if fmt.h_low:
        lc = unpack_codes(buf["low"], fmt.h_low, K)
        mask = lc == fmt.v_mask
        if fmt.fp:
            low = fp4_decode(lc)
        else:
            low = (lc - (1 << (fmt.h_low - 1))).float()
        low = low.masked_fill(mask, 0)
        idx = high_index(mask, fmt)
    else:
        pos = unpack_codes(buf["pos"], pos_bits(fmt), n)
        starts = torch.tensor([s for s, _, nh in fmt.banks(K) for _ in range(nh)], device=pos.device)
        idx = (pos + starts).long()
        mask = torch.zeros(rows, K, dtype=torch.bool, device=pos.device).scatter_(1, idx, True)
        low = torch.zeros(rows, K, device=pos.device)
    high = torch.zeros(rows, K, device=hv.device).scatter_(1, idx, hv)
    return SQTensor(fmt, mask, low, high, buf["low_scale"].float(), buf["high_scale"].float(), group)


def measured_bits(buf: dict[str, torch.Tensor], numel: int, extra: list[torch.Tensor] | None = None) -> float:
    """Stored bits per value of the packed buffers (scales included), plus any ``extra`` buffers."""
    ts = list(buf.values()) + list(extra or [])
    return sum(t.numel() * t.element_size() * 8 for t in ts) / numel
