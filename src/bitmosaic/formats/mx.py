"""Microscaling formats as exact formats: MXFP4, NVFP4, MXFP8 (E4M3/E5M2) and FP8 with 128x128 blocks.

A weight ``W`` (``[out, in]``) is stored as element values on a minifloat grid (:mod:`.fp`) times one
scale per block of ``block`` consecutive inputs of one row (``block_rows`` rows for FP8 block):

============  ========  =====  ======================  =============================================
scheme        element   block  block scale             notes
============  ========  =====  ======================  =============================================
``mxfp4``     E2M1      32     E8M0 (a power of two)   OCP Microscaling Formats (MX) spec v1.0
``nvfp4``     E2M1      16     FP8 E4M3                plus one FP32 tensor scale (``global_scale``)
``mxfp8``     E4M3      32     E8M0                    OCP MX v1.0 (``mxfp8-e5m2``: E5M2 elements)
``fp8-block`` E4M3      128    FP32, 128x128 blocks    DeepSeek-V3 (arXiv:2412.19437, §3.3)
============  ========  =====  ======================  =============================================

Scale rules (what each producer computes; :func:`block_scales`):

* E8M0, ``rule="floor"``: the OCP MX v1.0 rule (§6.3): ``X = 2^(floor(log2(amax)) - emax_elem)``,
  ``emax_elem`` the exponent of the element format's largest normal (E2M1: 2, E4M3: 8, E5M2: 15);
  values above the grid after the division saturate to ``±max``.
* E8M0, ``rule="round"``: compressed-tensors / vLLM's reference (``generate_mx_scales``): ``amax`` is
  first rounded to one mantissa bit (half up: the E2M1 width, which compressed-tensors 0.20 also uses
  for MXFP8), then the same floor -- so an FP4 block never saturates by more than half a step.  Both
  store the biased exponent ``e + 127`` in a byte (255 is NaN, unused).
* NVFP4 (compressed-tensors ``generate_gparam`` / ``calculate_qparams``): ``global = 448·6 / amax(W)``
  (FP32), block scale ``E4M3(global · amax_block / 6)`` (a zero becomes 0.125, as there), and the
  element divisor is ``scale / global``.
* FP8 block: ``amax_block / 448`` in FP32 (DeepSeek-V3's ``weight_scale_inv``).

Elements are rounded to nearest, ties to even, saturating (:func:`.fp.fp_round`; for E2M1 this is the
rounding of compressed-tensors' ``_round_to_fp4``).  E2M1 codes are ``sign<<3 | index`` of the value in
``0, .5, 1, 1.5, 2, 3, 4, 6``; two codes a byte, the even column in the low nibble
(compressed-tensors' ``pack_fp4_to_uint8``).  FP8 elements are their ``float8`` bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .fp import FloatFormat, fp_round, get_float_format

__all__ = [
    "MXFormat",
    "MX_FORMATS",
    "get_mx_format",
    "E2M1_VALUES",
    "e8m0_encode",
    "e8m0_decode",
    "e8m0_exponent",
    "block_amax",
    "expand_blocks",
    "nvfp4_global_scale",
    "block_scales",
    "encode_scales",
    "decode_scales",
    "quantize_elements",
    "encode_elements",
    "decode_elements",
    "pack_fp4",
    "unpack_fp4",
    "MXTensor",
    "MX_SCHEMES",
    "scheme_weight_format",
    "mx_quantize",
    "mx_dequantize",
    "mx_matmul",
]

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E8M0_BIAS = 127


@dataclass(frozen=True)
class MXFormat:
    """Element grid ``elem``, ``block`` inputs (x ``block_rows`` rows) per scale, scale encoding
    ``scale`` (``"e8m0"``, ``"e4m3"`` or ``"fp32"``), and whether a FP32 tensor scale is stored."""

    name: str
    elem: str
    block: int
    scale: str
    global_scale: bool = False
    block_rows: int = 1

    @property
    def elem_format(self) -> FloatFormat:
        return get_float_format(self.elem)

    @property
    def elem_bits(self) -> int:
        return self.elem_format.bits

    @property
    def emax_elem(self) -> int:
        """Exponent of the element format's largest value (OCP MX v1.0, Table 1)."""
        return math.floor(math.log2(self.elem_format.max_value))

    @property
    def scale_bits(self) -> int:
        return 32 if self.scale == "fp32" else 8

    @property
    def scale_dtype(self) -> torch.dtype:
        return {"e8m0": torch.uint8, "e4m3": torch.float8_e4m3fn, "fp32": torch.float32}[self.scale]

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        return (-(-out_features // self.block_rows), -(-in_features // self.block))


MX_FORMATS: dict[str, MXFormat] = {
    "mxfp4": MXFormat("mxfp4", "e2m1", 32, "e8m0"),
    "nvfp4": MXFormat("nvfp4", "e2m1", 16, "e4m3", global_scale=True),
    "mxfp8": MXFormat("mxfp8", "e4m3", 32, "e8m0"),
    "mxfp8-e5m2": MXFormat("mxfp8-e5m2", "e5m2", 32, "e8m0"),
    "fp8-block": MXFormat("fp8-block", "e4m3", 128, "fp32", block_rows=128),
}


# llm-compressor's preset names -> (weight format, activations quantized too)
MX_SCHEMES: dict[str, tuple[str, bool]] = {
    "MXFP4A16": ("mxfp4", False),
    "MXFP4": ("mxfp4", True),
    "NVFP4A16": ("nvfp4", False),
    "NVFP4": ("nvfp4", True),
    "MXFP8A16": ("mxfp8", False),
    "MXFP8": ("mxfp8", True),
    "FP8_BLOCK": ("fp8-block", True),
}


def scheme_weight_format(scheme: str | None) -> str | None:
    """The microscaling weight format of a preset scheme name (``NVFP4A16`` -> ``nvfp4``), else None."""
    hit = MX_SCHEMES.get(scheme.strip().upper().replace("-", "_")) if scheme else None
    return hit[0] if hit else None


def get_mx_format(name: str | MXFormat) -> MXFormat:
    if isinstance(name, MXFormat):
        return name
    try:
        return MX_FORMATS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown microscaling format {name!r}; known: {', '.join(MX_FORMATS)}") from None


# ---- E8M0 ---------------------------------------------------------------------------------------


def e8m0_encode(exponent: torch.Tensor) -> torch.Tensor:
    """Biased byte ``e + 127`` of integer exponents ``e`` (clamped to the finite range -127..127)."""
    return (exponent.to(torch.int32).clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)


def e8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """``2^(code - 127)`` as float32 (exact: 2^-127 is a float32 subnormal); 255 decodes to NaN."""
    e = code.to(torch.int32) - E8M0_BIAS
    v = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)
    return torch.where(code.to(torch.int32) == 255, torch.full_like(v, float("nan")), v)


def e8m0_exponent(amax: torch.Tensor, fmt: MXFormat, rule: str = "floor") -> torch.Tensor:
    """Shared exponent (int32) of blocks with absolute maximum ``amax`` (see the module docstring)."""
    a = amax.float()
    m, e = torch.frexp(a)  # a = m 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    e = e - 1
    if rule == "round":  # amax rounded to one mantissa bit (half up) may carry into the exponent
        sig = m * 2  # in [1, 2)
        e = e + (sig >= 1.75).to(e.dtype)
    elif rule != "floor":
        raise ValueError(f"E8M0 rule must be 'floor' (OCP MX) or 'round' (compressed-tensors), got {rule!r}")
    e = torch.where(a > 0, e - fmt.emax_elem, torch.full_like(e, -E8M0_BIAS))
    return e.clamp(-E8M0_BIAS, E8M0_BIAS)


# ---- blocks -------------------------------------------------------------------------------------


def _pad_to_blocks(W: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    R, C = fmt.scale_shape(*W.shape)
    pr, pc = R * fmt.block_rows - W.shape[0], C * fmt.block - W.shape[1]
    return torch.nn.functional.pad(W, (0, pc, 0, pr)) if pr or pc else W


def block_amax(W: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    """``max|W|`` of each block, ``fmt.scale_shape(*W.shape)`` (float32; partial blocks padded by 0)."""
    R, C = fmt.scale_shape(*W.shape)
    a = _pad_to_blocks(W.detach().float().abs(), fmt)
    return a.reshape(R, fmt.block_rows, C, fmt.block).amax(dim=(1, 3))


def expand_blocks(s: torch.Tensor, fmt: MXFormat, shape: tuple[int, int]) -> torch.Tensor:
    """A per-block tensor ``[R, C]`` repeated onto every element of an ``[out, in]`` matrix."""
    return s.repeat_interleave(fmt.block_rows, 0)[: shape[0]].repeat_interleave(fmt.block, 1)[:, : shape[1]]


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """compressed-tensors' ``generate_gparam``: ``448 · 6 / amax`` (float32 ``[1]``), 1 where not finite."""
    a = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
    a = a.clamp(min=torch.finfo(torch.float32).tiny)
    g = torch.tensor(448.0 * 6.0, dtype=torch.float32) / a
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0)


def encode_scales(scale: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    """The stored form of (already representable) block scales: E8M0 bytes, E4M3 or float32."""
    if fmt.scale == "e8m0":
        m, e = torch.frexp(scale.float())
        if not bool((m == 0.5).all()):
            raise ValueError("E8M0 scales must be powers of two")
        return e8m0_encode(e - 1)
    if fmt.scale == "e4m3":
        s8 = scale.float().to(torch.float8_e4m3fn)
        if not torch.equal(s8.float(), scale.float()):
            raise ValueError("NVFP4 block scales must be FP8 E4M3 values")
        return s8
    return scale.float()


def decode_scales(stored: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    """Float32 values of stored block scales (the inverse of :func:`encode_scales`)."""
    return e8m0_decode(stored) if fmt.scale == "e8m0" else stored.float()


def block_scales(
    amax: torch.Tensor, fmt: MXFormat, *, rule: str = "floor", global_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Representable block scales (float32 values of the stored encoding) from block maxima.

    For NVFP4 these are the E4M3 values ``global · amax / 6`` (``global_scale`` required); the
    element divisor is then ``scale / global`` (:func:`element_divisor`)."""
    if fmt.scale == "e8m0":
        return torch.ldexp(torch.ones_like(amax, dtype=torch.float32), e8m0_exponent(amax, fmt, rule))
    qmax = fmt.elem_format.max_value
    if fmt.scale == "e4m3":
        if global_scale is None:
            raise ValueError("NVFP4 block scales need the tensor's global scale")
        s = global_scale.float() * (amax.float() / qmax)
        s = s.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
        return torch.where(s == 0, torch.full_like(s, 0.125), s)  # compressed-tensors' eps for E4M3
    s = amax.float() / qmax
    return torch.where(s == 0, torch.ones_like(s), s)


def element_divisor(scale: torch.Tensor, fmt: MXFormat, global_scale: torch.Tensor | None) -> torch.Tensor:
    """What the elements are multiplied by: the block scale, over the global scale for NVFP4."""
    return scale.float() / global_scale.float() if fmt.global_scale else scale.float()


# ---- elements -----------------------------------------------------------------------------------


def quantize_elements(x: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    """``x`` (already divided by its scale) rounded to the element grid (float32 values)."""
    return fp_round(x.float(), fmt.elem)


def encode_elements(values: torch.Tensor, fmt: MXFormat, *, check: bool = True) -> torch.Tensor:
    """Element codes: E2M1 nibbles ``sign<<3 | index`` (uint8, one per value) or FP8 bytes.  ``check``:
    refuse values off the grid (``False`` where they come from :func:`quantize_elements`)."""
    v = values.float()
    if fmt.elem == "e2m1":
        idx = torch.searchsorted(E2M1_VALUES.to(v.device), v.abs().contiguous())
        if check and not bool((E2M1_VALUES.to(v.device)[idx.clamp(max=7)] == v.abs()).all()):
            raise ValueError("values are not on the E2M1 grid; round them with quantize_elements first")
        return (idx.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)).to(torch.uint8)
    f8 = v.to(fmt.elem_format.cast_dtype())
    if check and not torch.equal(f8.float(), v):
        raise ValueError(f"values are not on the {fmt.elem} grid; round them with quantize_elements first")
    return f8.view(torch.uint8)


def decode_elements(codes: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    """Float32 values of element codes (the inverse of :func:`encode_elements`)."""
    if fmt.elem == "e2m1":
        c = codes.to(torch.int64)
        v = E2M1_VALUES.to(codes.device)[c & 7]
        return torch.where((c & 8) != 0, -v, v)
    return codes.view(fmt.elem_format.cast_dtype()).float()


def pack_fp4(nibbles: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` E2M1 codes -> ``[out, in/2]`` bytes, column ``2j`` low, ``2j+1`` high."""
    if nibbles.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even number of columns, got {nibbles.shape[-1]}")
    n = nibbles.to(torch.uint8)
    return n[..., 0::2] | (n[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_fp4`."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ---- whole tensors ------------------------------------------------------------------------------


@dataclass
class MXTensor:
    """An exactly stored microscaled matrix: ``elements`` (packed FP4 bytes ``[out, in/2]`` or FP8
    bytes ``[out, in]``), ``scales`` (stored encoding, ``fmt.scale_shape``) and ``global_scale``
    (float32 ``[1]``, NVFP4 only)."""

    fmt: MXFormat
    shape: tuple[int, int]
    elements: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None = None

    @classmethod
    def from_values(cls, values, scale, fmt, global_scale=None) -> MXTensor:
        """From element values ``[out, in]`` (on the grid) and block scale values ``[R, C]``."""
        fmt = get_mx_format(fmt)
        codes = encode_elements(values, fmt)
        elements = pack_fp4(codes) if fmt.elem == "e2m1" else codes
        gs = global_scale.float().reshape(1) if fmt.global_scale else None
        return cls(fmt, tuple(values.shape), elements, encode_scales(scale, fmt), gs)

    def values(self) -> torch.Tensor:
        codes = unpack_fp4(self.elements) if self.fmt.elem == "e2m1" else self.elements
        return decode_elements(codes, self.fmt)

    def scale_values(self) -> torch.Tensor:
        return decode_scales(self.scales, self.fmt)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.elements, self.scales, self.global_scale) if t is not None]


def mx_quantize(W: torch.Tensor, fmt: str | MXFormat, *, rule: str = "floor") -> MXTensor:
    """Min-max RTN of ``W`` (``[out, in]``) onto ``fmt``: the producers' reference quantizer
    (``rule="round"`` with MX scales is compressed-tensors' / vLLM's, ``"floor"`` the OCP spec's)."""
    fmt = get_mx_format(fmt)
    W = W.float()
    gs = nvfp4_global_scale(W.abs().amax()) if fmt.global_scale else None
    scale = block_scales(block_amax(W, fmt), fmt, rule=rule, global_scale=gs)
    div = expand_blocks(element_divisor(scale, fmt, gs), fmt, W.shape)
    return MXTensor.from_values(quantize_elements(W / div, fmt), scale, fmt, gs)


def mx_dequantize(t: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact dequantization: element value times its block's divisor (float32, then ``dtype``).

    For E8M0 scales every product is exact in float32; for NVFP4 the divisor ``scale / global`` is
    rounded once to float32, as compressed-tensors and vLLM's reference compute it."""
    div = element_divisor(t.scale_values(), t.fmt, t.global_scale)
    return (t.values() * expand_blocks(div, t.fmt, t.shape)).to(dtype)


def mx_matmul(x: torch.Tensor, t: MXTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference ``x @ W^T`` (+ bias) with ``W`` the exact dequantization, computed in float32."""
    y = x.float() @ mx_dequantize(t).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
