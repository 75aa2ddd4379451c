"""llama.cpp's lattice GGUF types ``IQ3_S``, ``IQ2_S``, ``IQ2_XS``, ``IQ3_XXS`` and ``IQ2_XXS`` as data:
codebooks, byte layouts and the float32 weights llama.cpp (and ``gguf.quants.dequantize``) compute from
them (issue 72).

All split a row into super-blocks of 256 weights with one fp16 ``d``; each run of ``dim`` weights is one
point of a fixed codebook of non-negative vectors (``iq2xs_grid``: 512 x 8 values from {8, 25, 43};
``iq2s_grid``: 1024 x 8 from {8, 25, 43};
``iq3s_grid``: 512 x 4 from {1, 3, .., 15}; ``iq2xxs_grid``: 256 x 8 from {8, 25, 43}; ``iq3xxs_grid``:
256 x 4 from {4, 12, .., 52, 62}; E8-lattice-like shells), times a per-weight sign and a 4-bit sub-block
scale ``s``:

=======  ====  =========  =======================================  ====================================
type     dim   sub-block  weight                                   bytes per 256 weights
=======  ====  =========  =======================================  ====================================
IQ2_XS   8     16         ``((d * (0.5 + s)) * 0.25 * g) * sign``  2 ``d`` + 32 x uint16 (9-bit index,
                                                                   7-bit sign index) + 8 scales: 74
                                                                   (2.3125 bits)
IQ3_S    4     32         ``((d * (1 + 2 s)) * g) * sign``         2 ``d`` + 64 index bytes + 8 (9th
                                                                   bits) + 32 signs + 4 scales: 110
                                                                   (3.4375 bits)
IQ2_S    8     16         ``((d * (0.5 + s)) * 0.25 * g) * sign``  2 ``d`` + 32 index bytes + 32 signs
                                                                   + 8 (10th and 9th bits, 2 a point)
                                                                   + 8 scales: 82 (2.5625 bits)
IQ2_XXS  8     32         ``((d * (0.5 + s)) * 0.25 * g) * sign``  2 ``d`` + per 32 weights 4 index
                                                                   bytes and a uint32 (four 7-bit
                                                                   sign indices, ``s`` in the top 4
                                                                   bits): 66 (2.0625 bits)
IQ3_XXS  4     32         ``((d * (0.5 + s)) * 0.5 * g) * sign``   2 ``d`` + 64 index bytes + per 32
                                                                   weights a uint32 as IQ2_XXS's: 98
                                                                   (3.0625 bits)
=======  ====  =========  =======================================  ====================================

IQ2_XS, IQ2_XXS and IQ3_XXS store 7 of the signs of every 8 weights (IQ3_XXS: two points); the eighth is
their parity (``ksigns``: the number of negative weights of every 8 is even).  IQ3_S and IQ2_S store
every sign (a bit per weight, weight ``j`` of 8 in bit ``j``) and an index's bits above the low byte in
``qh`` (point ``k`` of a byte's ``8 / b`` in bits ``b k``, ``b`` the high bits of an index); they differ
in the order of the sections (``LatticeType.layout``).  IQ2_XS / IQ3_S / IQ2_S pack ``s`` two per byte,
low nibble first (ggml's ``dequantize_row_iq2_s``: ``scales[ib32] & 0xf`` for the first 16 weights).

Here a layer is four tensors: ``idx`` (codebook indices, int16 ``[out, in / dim]``), ``neg``
(1 where a weight is negative, uint8 ``[out, in]``), ``d`` (fp16 ``[out, in / 256]``) and ``s`` (uint8
``[out, in / sub]``).  The codebooks are the ``gguf`` package's (``gguf.quants.IQ2_XS.grid``, ...), the
tables of llama.cpp's ``ggml-common.h``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["QK", "LatticeType", "LATTICE_TYPES", "codebook", "dequantize", "pack", "unpack", "scale_of"]

QK = 256


@dataclass(frozen=True)
class LatticeType:
    name: str
    dim: int  # weights per codebook point
    sub: int  # weights per 4-bit scale
    bytes_per_block: int  # per 256 weights
    sign_group: int  # weights whose signs have even parity (7 of 8 stored); 0: every sign stored
    points: int = 512  # codebook size
    level: tuple = (0.5, 1.0, 0.25)  # the multiplier of d for a 4-bit s: (off + mul * s) * post
    layout: tuple = ()  # every sign stored: the order of the sections after d (module doc)

    @property
    def parity(self) -> bool:
        return self.sign_group > 0

    @property
    def run(self) -> int:
        """Columns solved together: one point, or the points sharing a sign parity."""
        return max(self.dim, self.sign_group)

    @property
    def high_bits(self) -> int:
        """Bits of a codebook index above its low byte (IQ3_S 1, IQ2_S 2)."""
        return max(0, (self.points - 1).bit_length() - 8)

    @property
    def bits(self) -> float:
        return 8 * self.bytes_per_block / QK

    @property
    def qtype(self):
        import gguf

        return gguf.GGMLQuantizationType[self.name]


LATTICE_TYPES = {
    t.name: t
    for t in (
        LatticeType("IQ2_XS", 8, 16, 74, 8),
        LatticeType("IQ3_S", 4, 32, 110, 0, level=(1.0, 2.0, 1.0), layout=("qs", "qh", "signs", "scales")),
        LatticeType("IQ2_S", 8, 16, 82, 0, points=1024, layout=("qs", "signs", "qh", "scales")),
        LatticeType("IQ2_XXS", 8, 32, 66, 8, points=256),
        LatticeType("IQ3_XXS", 4, 32, 98, 8, points=256, level=(0.5, 1.0, 0.5)),
    )
}
_XXS = ("IQ2_XXS", "IQ3_XXS")


@functools.cache
def _codebook_np(name: str) -> np.ndarray:
    from gguf import quants

    cls = getattr(quants, name)
    cls.init_grid()
    return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=np.float32)


def codebook(t: LatticeType, device=None, dtype=torch.float32) -> torch.Tensor:
    """The codebook ``[points, dim]`` (non-negative integers as floats)."""
    return torch.from_numpy(_codebook_np(t.name)).to(device=device, dtype=dtype)


def scale_of(d: torch.Tensor, s: torch.Tensor, t: LatticeType) -> torch.Tensor:
    """float32 per sub-block multiplier ``[out, in / sub]`` from ``d`` fp16 ``[out, in / 256]`` and ``s``
    ``[out, in / sub]``, in ggml's order of operations."""
    df = d.float().repeat_interleave(QK // t.sub, dim=1)
    off, mul, post = t.level
    return (df * (off + mul * s.float())) * post  # post a power of two, mul * s and off + . exact


def dequantize(
    idx: torch.Tensor, neg: torch.Tensor, d: torch.Tensor, s: torch.Tensor, t: LatticeType
) -> torch.Tensor:
    """float32 ``[out, in]``: ``(scale * g) * sign`` as ggml computes it (module doc)."""
    out = idx.shape[0]
    g = codebook(t, idx.device)[idx.long()].reshape(out, -1)  # [out, in]
    db = scale_of(d, s, t).repeat_interleave(t.sub, dim=1)
    sign = 1.0 - 2.0 * neg.float()
    return (db * g) * sign


def _bits(x: np.ndarray, b: int = 1) -> np.ndarray:
    """``[..., k 8 / b]`` of ``b``-bit values -> ``[..., k]`` bytes, element ``j`` of ``8 / b`` in bits
    ``b j``."""
    per = 8 // b
    v = x.reshape(*x.shape[:-1], -1, per).astype(np.uint8)
    return (v << np.arange(0, 8, b, dtype=np.uint8)).sum(-1, dtype=np.uint8)


def _unbits(x: np.ndarray, b: int = 1) -> np.ndarray:
    """The inverse of :func:`_bits`."""
    v = (x[..., None] >> np.arange(0, 8, b, dtype=np.uint8)) & ((1 << b) - 1)
    return v.reshape(*x.shape[:-1], -1)


def _section_sizes(t: LatticeType) -> dict:
    """Bytes per super-block of each section of a type that stores every sign (module doc)."""
    pts = QK // t.dim
    return {"qs": pts, "qh": pts * t.high_bits // 8, "signs": QK // 8, "scales": QK // t.sub // 2}


def _nibbles(s: np.ndarray) -> np.ndarray:
    s = s.astype(np.uint8)
    return s[..., 0::2] | (s[..., 1::2] << 4)


def pack(
    idx: torch.Tensor, neg: torch.Tensor, d: torch.Tensor, s: torch.Tensor, t: LatticeType
) -> np.ndarray:
    """uint8 ``[out, in / 256 * bytes_per_block]``: the GGUF blocks.  IQ2_XS: every point's signs must have
    even parity (ValueError otherwise)."""
    out, n = neg.shape
    nb = n // QK
    idx = idx.cpu().numpy().astype(np.uint16).reshape(out, nb, -1)
    ng = neg.cpu().numpy().astype(np.uint8).reshape(out, nb, -1, t.dim)
    dd = d.cpu().to(torch.float16).numpy().reshape(out, nb, 1).view(np.uint8)
    if t.parity:
        ng = ng.reshape(out, nb, -1, t.sign_group)
        if bool((ng.sum(-1) % 2).any()):
            raise ValueError(
                f"{t.name}: a group of {t.sign_group} weights with an odd number of negative signs (the type "
                "stores even parity)"
            )
        sign7 = (ng[..., :7] << np.arange(7, dtype=np.uint8)).sum(-1, dtype=np.uint32)  # [out, nb, 32]
    if t.name in _XXS:  # per 32 weights a uint32: four 7-bit sign indices, the 4-bit scale on top
        shift = np.arange(0, 28, 7, dtype=np.uint32)
        words = (sign7.reshape(out, nb, 8, 4) << shift).sum(-1, dtype=np.uint32)
        words = (words | (s.cpu().numpy().astype(np.uint32).reshape(out, nb, 8) << 28)).astype("<u4")
        qs = idx.astype(np.uint8).reshape(out, nb, 8, -1)  # the points' indices, per 32 weights
        if t.name == "IQ2_XXS":  # (4 indices, word) per 32 weights
            body = np.concatenate([qs, words[..., None].view(np.uint8)], axis=-1)
        else:  # 64 indices, then the 8 words
            body = np.concatenate([qs.reshape(out, nb, -1), words.view(np.uint8)], axis=-1)
        return np.concatenate([dd, body.reshape(out, nb, -1)], axis=-1).reshape(out, -1)
    sc = _nibbles(s.cpu().numpy().reshape(out, nb, -1))
    if t.name == "IQ2_XS":
        qs = (idx | (sign7.astype(np.uint16) << 9)).astype("<u2").view(np.uint8)
        return np.concatenate([dd, qs, sc], axis=-1).reshape(out, -1)
    parts = {"qs": (idx & 255).astype(np.uint8), "qh": _bits((idx >> 8).astype(np.uint8), t.high_bits),
             "signs": _bits(ng.reshape(out, nb, QK)), "scales": sc}  # fmt: skip
    return np.concatenate([dd, *(parts[k] for k in t.layout)], axis=-1).reshape(out, -1)


def unpack(data: np.ndarray, t: LatticeType, n: int):
    """The inverse of :func:`pack`: ``(idx int16, neg uint8, d fp16, s uint8)`` (module doc)."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    out = data.shape[0]
    nb = n // QK
    b = data.reshape(out, nb, t.bytes_per_block)
    d = torch.from_numpy(b[..., :2].copy().view(np.float16).reshape(out, nb))
    if t.name in _XXS:
        if t.name == "IQ2_XXS":
            body = b[..., 2:].reshape(out, nb, 8, 8)
            qs, words = body[..., :4], body[..., 4:].copy().view("<u4")[..., 0]
        else:
            qs, words = b[..., 2:66], b[..., 66:].copy().view("<u4")
        words = words.astype(np.uint32).reshape(out, nb, 8)
        s = (words >> 28).reshape(out, -1)
        sign7 = ((words[..., None] >> np.arange(0, 28, 7, dtype=np.uint32)) & 127).astype(np.uint8)
        low = _unbits(sign7.reshape(out, nb, 32, 1))[..., :7]
        neg = np.concatenate([low, low.sum(-1, keepdims=True) % 2], axis=-1)
        idx = qs.reshape(out, nb, -1).astype(np.uint16)
    else:
        sc = b[..., -QK // t.sub // 2 :]
        s = np.stack([sc & 15, sc >> 4], axis=-1).reshape(out, -1)
    if t.name == "IQ2_XS":
        qs = b[..., 2:66].copy().view("<u2").astype(np.uint16)  # [out, nb, 32]
        idx = qs & 511
        sign7 = (qs >> 9).astype(np.uint8)
        low = _unbits(sign7[..., None]).reshape(out, nb, 32, 8)[..., :7]
        neg = np.concatenate([low, low.sum(-1, keepdims=True) % 2], axis=-1)
    elif t.layout:
        at, parts = 2, {}
        for k, size in ((k, _section_sizes(t)[k]) for k in t.layout):
            parts[k], at = b[..., at : at + size], at + size
        idx = parts["qs"].astype(np.uint16) | (_unbits(parts["qh"], t.high_bits).astype(np.uint16) << 8)
        neg = _unbits(parts["signs"])
    idx = torch.from_numpy(idx.reshape(out, -1).astype(np.int16))
    return (
        idx,
        torch.from_numpy(neg.reshape(out, n).astype(np.uint8)),
        d,
        torch.from_numpy(s.astype(np.uint8)),
    )
