"""Activation quantizers: INT (symmetric) and minifloat (FP8 E4M3/E5M2, FP4 E2M1) fake quantization.

An :class:`ActQuantSpec` says *what* grid and *which* scale granularity:

- ``granularity="token"``: one scale per token (row of ``x``), computed on the fly (dynamic);
- ``"tensor"``: one scale for the whole input -- static (from calibration) or dynamic;
- ``"group"``: one scale per ``group_size`` contiguous hidden channels, per token when dynamic,
  shared by all tokens when static.

``scale = clip_ratio · amax / qmax`` where ``qmax`` is ``2**(bits-1) - 1`` for INT (codes
``-qmax-1..qmax``) -- at 16 bits :data:`INT16_SPLIT_QMAX` = 127·256 + 127, the largest integer whose two
int8 halves ``q = 256 h + l`` both fit int8 (the integer kernel multiplies 16-bit activations as those
halves, :mod:`bitmosaic.kernels.intmm`) -- and the format's largest value for FP; ``clip_ratio`` < 1
saturates the largest values to refine the grid for the rest (QuaRot's activation clip ratio, 0.9 at A4:
Ashkboos et al. 2024, Sec. 5); ``pow2`` rounds each scale *up* to a power of two (so nothing extra saturates).
Fake quantization returns ``Q(x / scale) * scale``.

Microscaled activations (``mx``: an :data:`.mx.MX_FORMATS` name; issue 75): the input rows are quantized
with the weight codec of :mod:`.mx` -- one block scale per ``group_size`` (the format's block) channels of
each token, in the format's own encoding (E8M0 for MXFP4/MXFP8, E4M3 over a FP32 tensor scale for NVFP4),
elements rounded to nearest-even on the element grid.  The block scales are always dynamic; E8M0
exponents follow ``mx_rule`` (``"round"``: compressed-tensors' ``generate_mx_scales``, what llm-compressor
and vLLM's reference compute for activations too).  NVFP4's tensor scale is *static* (``static=True``,
calibrated as llm-compressor does: the ``static_minmax`` maximum over the calibration set, stored as
``input_global_scale = 448·6 / amax``) or dynamic per input (``static=False``).

Numerics (what is simulated): a linear layer then computes ``Q(x) @ Ŵ^T`` in float32.  For FP8
operands this is exactly an FP8×FP8 GEMM with float32 accumulation (every product of two FP8
values is exact in float32); for INT operands it equals the integer GEMM rescaled by the scales,
up to float32 rounding of the accumulation (an INT kernel accumulates exactly in int32).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from ..errors import OptionError
from .fp import FP_FORMATS, fp_round, get_float_format
from .mx import (
    MX_SCHEMES,
    block_amax,
    block_scales,
    element_divisor,
    get_mx_format,
    nvfp4_global_scale,
    quantize_elements,
)

__all__ = [
    "ActQuantSpec",
    "GRANULARITIES",
    "parse_scheme",
    "act_amax",
    "scale_from_amax",
    "act_scales",
    "fake_quant",
    "normalize_fmt",
    "mx_divisors",
    "INT16_SPLIT_QMAX",
]

GRANULARITIES = ("token", "tensor", "group")
_MIN_SCALE = 1e-12
# 16-bit INT activations: codes -qmax-1..qmax with qmax = 127 * 256 + 127, so that q = 256 h + l with h and l
# both int8 (h = floor((q + 128) / 256), l = q - 256 h; module doc)
INT16_SPLIT_QMAX = 127.0 * 256 + 127


@dataclass(frozen=True)
class ActQuantSpec:
    """How the input of a quantized linear is quantized."""

    fmt: str = "int"  # "int" | "e4m3" | "e4m3-240" | "e5m2" | "e2m1"
    bits: int = 8  # INT width; for FP formats the format's own width
    granularity: str = "token"
    group_size: int = 128
    static: bool = False  # scales from calibration (tensor / group granularity)
    pow2: bool = False
    calib: str = "max"  # static scale statistic: "max" | "percentile"
    percentile: float = 99.99
    clip_ratio: float = 1.0  # scale = clip_ratio * amax / qmax
    mx: str | None = None  # microscaled: a formats.mx format name ("mxfp4", "nvfp4", "mxfp8")
    mx_rule: str = "round"  # E8M0 exponent rule of the mx block scales (formats.mx.e8m0_exponent)

    def __post_init__(self) -> None:
        if self.fmt != "int" and self.fmt not in FP_FORMATS:
            raise ValueError(f"unknown activation format {self.fmt!r}; use int or one of {list(FP_FORMATS)}")
        if self.fmt == "int" and not (2 <= self.bits <= 8 or self.bits == 16):
            raise ValueError(f"INT activation bits must be in 2..8 or 16, got {self.bits}")
        if self.fmt != "int" and self.bits != get_float_format(self.fmt).bits:
            raise ValueError(
                f"{self.fmt} is a {get_float_format(self.fmt).bits}-bit format; got bits={self.bits}"
            )
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.static and self.granularity == "token":
            raise ValueError("per-token scales are dynamic by nature; use granularity 'tensor' or 'group'")
        if self.granularity == "group" and self.group_size < 1:
            raise ValueError(f"activation group_size must be positive, got {self.group_size}")
        if self.calib not in ("max", "percentile"):
            raise ValueError(f"calib must be 'max' or 'percentile', got {self.calib!r}")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {self.percentile}")
        if not 0 < self.clip_ratio <= 1:
            raise ValueError(f"activation clip ratio must be in (0, 1], got {self.clip_ratio}")
        if self.mx is not None:
            self._check_mx()

    def _check_mx(self) -> None:
        f = get_mx_format(self.mx)
        if f.block_rows != 1:
            raise ValueError(f"{f.name} has 2-D weight blocks; its activations are E4M3 per token group")
        want = {"fmt": f.elem, "granularity": "group", "group_size": f.block, "pow2": False,
                "calib": "max", "clip_ratio": 1.0}  # fmt: skip
        bad = [f"{k}={getattr(self, k)!r} (must be {v!r})" for k, v in want.items() if getattr(self, k) != v]
        if self.static and not f.global_scale:
            bad.append(
                f"static=True ({f.name} block scales are dynamic; only NVFP4's tensor scale is static)"
            )
        if bad:
            raise ValueError(f"{f.name} activations: {', '.join(bad)}")
        if self.mx_rule not in ("floor", "round"):
            raise ValueError(
                f"mx_rule must be 'floor' (OCP MX) or 'round' (compressed-tensors), got {self.mx_rule!r}"
            )

    @classmethod
    def microscaled(cls, name: str, static: bool = True, rule: str = "round") -> ActQuantSpec:
        """The activation quantizer of microscaling format ``name`` (``static``: NVFP4's calibrated
        tensor scale; ignored for the E8M0 formats, whose scales are all dynamic)."""
        f = get_mx_format(name)
        return cls(f.elem, f.elem_bits, granularity="group", group_size=f.block,
                   static=static and f.global_scale, mx=f.name, mx_rule=rule)  # fmt: skip

    @property
    def per_tensor_static(self) -> bool:
        """One calibrated scale for the whole input (per-tensor static, or NVFP4's tensor scale)."""
        return self.static and (self.granularity == "tensor" or self.mx is not None)

    @property
    def qmax(self) -> float:
        if self.fmt == "int":
            return INT16_SPLIT_QMAX if self.bits == 16 else float((1 << (self.bits - 1)) - 1)
        return get_float_format(self.fmt).max_value

    @property
    def label(self) -> str:
        if self.mx is not None:
            scale = (
                ("static-global" if self.static else "dynamic-global") if self.mx == "nvfp4" else "dynamic"
            )
            rule = "" if self.mx == "nvfp4" or self.mx_rule == "round" else f"/{self.mx_rule}"
            return f"{self.mx}/{scale}{rule}"
        grid = f"int{self.bits}" if self.fmt == "int" else f"fp{self.bits}-{self.fmt}"
        gran = f"group{self.group_size}" if self.granularity == "group" else self.granularity
        clip = "" if self.clip_ratio == 1 else f"/clip{self.clip_ratio:g}"
        pow2 = "/pow2" if self.pow2 else ""
        return f"{grid}/{gran}/{'static' if self.static else 'dynamic'}{pow2}{clip}"

    def to_dict(self) -> dict:
        """The fields; ``clip_ratio`` only where it clips (< 1), so a saved model without a clip reads
        the same in versions that predate it."""
        d = dataclasses.asdict(self)
        if self.clip_ratio == 1:
            del d["clip_ratio"]
        if self.mx is None:
            del d["mx"], d["mx_rule"]
        return d

    @classmethod
    def from_dict(cls, d: dict | None) -> ActQuantSpec | None:
        return None if d is None else cls(**d)


_FMT_ALIASES = {
    "int": "int",
    "fp8": "e4m3",
    "fp8-e4m3": "e4m3",
    "e4m3": "e4m3",
    "fp8-e4m3-240": "e4m3-240",
    "fp8-240": "e4m3-240",
    "e4m3-240": "e4m3-240",
    "fp8-e5m2": "e5m2",
    "e5m2": "e5m2",
    "fp4": "e2m1",
    "fp4-e2m1": "e2m1",
    "e2m1": "e2m1",
}


def normalize_fmt(name: str) -> str:
    try:
        return _FMT_ALIASES[name.lower()]
    except KeyError:
        raise OptionError(f"unknown activation format {name!r}; choose from {sorted(_FMT_ALIASES)}") from None


def parse_scheme(scheme: str) -> tuple[int, ActQuantSpec | None]:
    """``"W4A8"`` -> (4, INT8 per-token); ``"W4A8-FP8"`` -> (4, E4M3 per-tensor static);
    ``"W4A16"`` -> (4, None).  FP activations default to static per-tensor scales (the DPQ
    setting); INT activations to dynamic per-token scales (the usual W8A8/W4A4 setting)."""
    mx = _mx_scheme(scheme)
    if mx is not None:
        return mx
    m = re.fullmatch(r"W(\d+)A(\d+)(?:-(\w[\w-]*))?", scheme.strip().upper())
    if not m:
        raise OptionError(
            f"scheme {scheme!r} is not of the form W<bits>A<bits>[-FP8|-FP4|-E5M2] nor a microscaling preset "
            "(NVFP4A16, NVFP4, MXFP4A16, MXFP4, MXFP8A16, MXFP8, FP8_BLOCK)"
        )
    wbits, abits, fmt = int(m.group(1)), int(m.group(2)), m.group(3)
    if abits >= 16:
        if fmt:
            raise OptionError(f"scheme {scheme!r}: 16-bit activations take no format suffix")
        return wbits, None
    if fmt is None:
        return wbits, ActQuantSpec("int", abits)
    return wbits, ActQuantSpec(normalize_fmt(fmt), abits, granularity="tensor", static=True)


def _mx_scheme(scheme: str) -> tuple[int, ActQuantSpec | None] | None:
    """llm-compressor's microscaling presets (``NVFP4A16``, ``FP8_BLOCK``...; :data:`.mx.MX_SCHEMES`):
    ``(element bits, activation quantizer)``; the weight format itself is
    :func:`.mx.scheme_weight_format`'s."""
    key = scheme.strip().upper().replace("-", "_")
    if key not in MX_SCHEMES:
        return None
    wfmt, acts = MX_SCHEMES[key]
    bits = get_mx_format(wfmt).elem_bits
    if not acts:
        return bits, None
    if wfmt == "fp8-block":  # llm-compressor's FP8_BLOCK inputs: E4M3, one dynamic scale per token and 128
        return bits, ActQuantSpec("e4m3", 8, granularity="group", group_size=128)
    # NVFP4 / MXFP4 / MXFP8 inputs as llm-compressor's presets: dynamic block scales in the weight's
    # encoding; NVFP4's tensor scale calibrated (static_minmax)
    return bits, ActQuantSpec.microscaled(wfmt, static=True)


def act_amax(x: torch.Tensor, spec: ActQuantSpec) -> torch.Tensor:
    """Dynamic absolute maxima of ``x`` (``[..., n]``) at ``spec.granularity``."""
    a = x.detach().abs().float()
    if spec.granularity == "token":
        return a.amax(dim=-1, keepdim=True)
    if spec.granularity == "tensor":
        return a.amax().reshape(1)
    n = x.shape[-1]
    g = spec.group_size
    G = -(-n // g)
    pad = G * g - n
    if pad:
        a = torch.nn.functional.pad(a, (0, pad))
    return a.reshape(*a.shape[:-1], G, g).amax(dim=-1)


def scale_from_amax(amax: torch.Tensor, spec: ActQuantSpec) -> torch.Tensor:
    """``clip_ratio · amax / qmax`` (float32), optionally rounded up to a power of two; for a microscaled
    spec, NVFP4's tensor scale ``448·6 / amax`` (:func:`.mx.nvfp4_global_scale`)."""
    if spec.mx is not None:
        return nvfp4_global_scale(amax.float().amax())
    a = amax.float() if spec.clip_ratio == 1 else amax.float() * spec.clip_ratio
    s = (a / spec.qmax).clamp(min=_MIN_SCALE)
    if spec.pow2:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    return s


def _expand_group(scale: torch.Tensor, n: int, g: int) -> torch.Tensor:
    return scale.repeat_interleave(g, dim=-1)[..., :n]


def act_scales(x: torch.Tensor, spec: ActQuantSpec, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The scales :func:`fake_quant` divides ``x`` by, one per scale column (float32): the calibrated
    ``scale`` of a static spec (``[1]`` / ``[G]``), else ``[..., 1]`` per token, ``[1]`` per tensor,
    ``[..., G]`` per group.  The integer kernels (:mod:`bitmosaic.kernels.intmm`) take these too, so
    both paths quantize to the same integers."""
    if spec.mx is not None:
        return mx_divisors(x, spec, scale)
    if spec.static:
        if scale is None:
            raise ValueError(f"static activation quantizer {spec.label} has no calibrated scale")
        return scale.float()
    return scale_from_amax(act_amax(x, spec), spec)


def mx_divisors(x: torch.Tensor, spec: ActQuantSpec, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Element divisors ``[..., G]`` of a microscaled spec: the weight codec's block scales
    (:func:`.mx.block_scales`, ``spec.mx_rule``) of every token's blocks, over NVFP4's tensor scale
    (``scale``: the calibrated one when static, else ``448·6 / amax(x)``)."""
    f = get_mx_format(spec.mx)
    X = x.detach().reshape(-1, x.shape[-1]).float()
    gs = None
    if f.global_scale:
        if spec.static and scale is None:
            raise ValueError(f"static activation quantizer {spec.label} has no calibrated tensor scale")
        gs = scale.float().reshape(1).to(X.device) if spec.static else nvfp4_global_scale(X.abs().amax())
    s = block_scales(block_amax(X, f), f, rule=spec.mx_rule, global_scale=gs)
    return element_divisor(s, f, gs).reshape(*x.shape[:-1], s.shape[-1])


def fake_quant(x: torch.Tensor, spec: ActQuantSpec, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``Q(x / scale) * scale`` in ``x``'s dtype (computed in float32).

    ``scale`` is required for static specs (``[1]`` per-tensor, ``[G]`` per-group) and ignored
    otherwise.
    """
    s = act_scales(x, spec, scale)
    if spec.granularity == "group":
        s = _expand_group(s, x.shape[-1], spec.group_size)
    xf = x.float() / s
    if spec.fmt == "int":
        q = torch.round(xf).clamp_(-spec.qmax - 1, spec.qmax)
    elif spec.mx is not None:  # the element grid as the weight codec rounds it (formats.mx)
        q = quantize_elements(xf, get_mx_format(spec.mx))
    else:
        q = fp_round(xf, spec.fmt)
    return (q * s).to(x.dtype)
