"""``QuantLinear``: a linear layer that stores packed integer codes and dequantizes on forward.

Buffers (all saved): ``qweight`` (uint8, codes packed row-wise at ``storage_bits``), ``scales``
(fp16 ``[out, G]``), ``zeros`` (fp16 ``[out, G]``, asymmetric grids only), ``g_idx`` (int32
``[in]``, only when an act-order quantizer made groups non-contiguous), ``bias`` (optional).

``storage_bits`` equals ``bits`` unless a no-clip quantizer produced integers outside the
``bits`` grid: then the codes are stored exactly, shifted by ``code_offset`` and packed at the
smallest packing width (2-8 bits) that holds them, and the bits-per-weight accounting says so.
The forward dequantizes with :func:`bitmosaic.kernels.cpu.dequantize_packed` (offset included),
which is tested bitwise-equal to the reference :func:`bitmosaic.formats.layout.dequantize`.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from ..algorithms.types import QuantResult
from ..formats.intform import IntForm, bit_len, embed, widest_fit
from ..formats.layout import dequantize, is_trivial_g_idx, normalize_group_size, num_groups
from ..formats.packing import SUPPORTED_BITS, pack_codes, packed_cols, unpack_codes
from ..kernels.cpu import dequantize_packed
from ..kernels.intmm import IntActWeight
from .base import NoIntForm, QuantModule, set_weight_cache

__all__ = ["QuantLinear", "UnpackableCodesError", "set_weight_cache"]


class UnpackableCodesError(ValueError):
    """Integer codes span a range that no supported packing width can store."""


class QuantLinear(QuantModule):
    kind = "packed"
    # the kernels that run this kind, preferred first (kernels/select.py picks one from their declared
    # capabilities: on CUDA the Triton GEMM/GEMV; on the CPU the bit-plane LUT at 1-3 storage bits,
    # LowBitWeight from 4)
    KERNELS: ClassVar[tuple[str, ...]] = ("triton_int", "lut", "lowbit")
    # off the CPU (modules/base.py); a subclass that changes the kernel or the product runs F.linear on
    # a GPU unless it declares its own
    GPU_KERNELS: ClassVar[tuple[str, ...]] = ("triton_int",)
    # integer activations (modules/intact.py); a subclass that changes the kernel or the product
    # (its own _build_kernel / _linear) runs simulated unless it declares its own
    INT_ACT_KERNELS: ClassVar[tuple[str, ...]] = ("int8act",)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        changes_product = any(k in own for k in ("_build_kernel", "_linear", "forward"))
        if "INT_ACT_KERNELS" not in own and changes_product:
            cls.INT_ACT_KERNELS = ()
        if "GPU_KERNELS" not in own and changes_product:
            cls.GPU_KERNELS = ()
            if "KERNELS" not in own:  # nor is it offered them on the CPU (the interpreter stand-in)
                cls.KERNELS = tuple(k for k in cls.KERNELS if k not in QuantLinear.GPU_KERNELS)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bits: int,
        group_size: int | None,
        symmetric: bool,
        bias: bool = False,
        has_g_idx: bool = False,
        storage_bits: int | None = None,
        code_offset: int = 0,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= max(SUPPORTED_BITS):
            raise ValueError(
                f"bits {bits!r} is not a weight width bitmosaic stores (1 to {max(SUPPORTED_BITS)})"
            )
        if storage_bits is not None and storage_bits < bits:
            raise ValueError(f"storage width {storage_bits!r} is narrower than bits {bits}")
        self.bits = bits
        self.group_size = normalize_group_size(group_size, in_features)
        self.symmetric = symmetric
        self.storage_bits = storage_bits or bits
        if self.storage_bits not in SUPPORTED_BITS:
            raise ValueError(
                f"storage width {self.storage_bits!r} is not a packing width; use one of {SUPPORTED_BITS}"
            )
        self.code_offset = int(code_offset)
        G = num_groups(in_features, self.group_size)
        nbytes = packed_cols(in_features, self.storage_bits)
        self.register_buffer("qweight", torch.zeros(out_features, nbytes, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(out_features, G, dtype=torch.float16))
        if not symmetric:
            self.register_buffer("zeros", torch.zeros(out_features, G, dtype=torch.float16))
        else:
            self.zeros = None
        if has_g_idx:
            self.register_buffer("g_idx", torch.zeros(in_features, dtype=torch.int32))
        else:
            self.g_idx = None

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_result(
        cls, res: QuantResult, *, bits: int, group_size: int | None, symmetric: bool, bias=None,
        clip: bool | None = None,
    ) -> QuantLinear:  # fmt: skip
        """The packed module of ``res``.  ``clip``: whether the codes were clipped to the grid (the
        method's ``--no-clip``; ``None``: unknown), which only changes what an error blames."""
        out, n = res.codes.shape
        lo, hi = int(res.codes.min()), int(res.codes.max())
        maxq = (1 << bits) - 1
        offset, storage = 0, bits
        if lo < 0 or hi > maxq:
            offset = min(lo, 0)
            need = max(1, math.ceil(math.log2(hi - offset + 1)))
            fits = [b for b in SUPPORTED_BITS if b >= max(need, bits)]
            if not fits:
                what = (
                    f"quantization produced integers in [{lo}, {hi}], which need {need} bits; the widest "
                    f"packing is {max(SUPPORTED_BITS)} bits"
                )
                if clip is False:
                    why = ". Quantize with clipping, use a larger scale, or do not save this model."
                    raise UnpackableCodesError(f"no-clip {what}{why}")
                why = (
                    f", although its codes are clipped to [0, {maxq}]: the layer's weights, scales or "
                    "rounding errors are not finite or too large for its grid; check the checkpoint's weights"
                    if clip
                    else ": with --no-clip, quantize with clipping or a larger scale; else the layer's "
                    "weights or scales are not finite or too large for its grid"
                )
                raise UnpackableCodesError(what + why)
            storage = fits[0]
        g_idx = res.g_idx.to(torch.int32)
        trivial = is_trivial_g_idx(g_idx, group_size)
        m = cls(
            n,
            out,
            bits=bits,
            group_size=group_size,
            symmetric=symmetric,
            bias=bias is not None,
            has_g_idx=not trivial,
            storage_bits=storage,
            code_offset=offset,
        )
        m.qweight.copy_(pack_codes((res.codes - offset).to(torch.int32), storage))
        m.scales.copy_(res.scales.to(torch.float16))
        if not symmetric:
            m.zeros.copy_(res.zeros.to(torch.float16))
        if not trivial:
            m.g_idx.copy_(g_idx)
        m._set_bias(bias)
        return m

    @classmethod
    def _from_packed(cls, dense: QuantLinear, **kind_kwargs) -> QuantLinear:
        """A ``cls`` (a packed kind with extra buffers) holding ``dense``'s packed buffers and bias."""
        kw = packed_kwargs(dense.layer_config())
        m = cls(dense.in_features, dense.out_features, **kind_kwargs, **kw)
        m.load_state_dict(dense.state_dict(), strict=False)
        return m

    # -- weights ------------------------------------------------------------------------------
    def _zeros_arg(self):
        return float(1 << (self.bits - 1)) if self.symmetric else self.zeros

    def _g_idx_arg(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.in_features, device=self.scales.device) // self.group_size

    def codes(self) -> torch.Tensor:
        """The integer codes (with ``code_offset`` undone), ``[out, in]`` int32."""
        return unpack_codes(self.qweight, self.storage_bits, self.in_features) + self.code_offset

    def dequantize_reference(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Weight via the reference path: unpack, then :func:`formats.layout.dequantize`."""
        return dequantize(self.codes(), self.scales, self._zeros_arg(), self._g_idx_arg(), dtype=dtype)

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Weight via the fast kernel (bitwise equal to the reference, no-clip offset included)."""
        return dequantize_packed(
            self.qweight,
            self.storage_bits,
            self.in_features,
            self.scales,
            self._zeros_arg(),
            self._g_idx_arg(),
            dtype=dtype,
            group_size=self.group_size,
            contiguous=self.g_idx is None,
            code_offset=self.code_offset,
        )

    def _build_kernel(self):
        """The low-bit kernel: codes at their storage width, the ``code_offset`` folded into the
        zero-point, act-order columns made contiguous (``modules/kernel.py``)."""
        from .kernel import lowbit_from_codes

        codes = unpack_codes(self.qweight, self.storage_bits, self.in_features)
        z = self._zeros_arg()
        z = z - self.code_offset if not torch.is_tensor(z) else z.float() - self.code_offset
        return lowbit_from_codes(
            codes, self.storage_bits, self.scales, z, self.group_size, self.g_idx, kernels=self.KERNELS
        )

    def int_act_blocker(self) -> str | None:
        """Why this layer runs its activation quantizer simulated (``None``: integer; modules/intact.py)."""
        from .intact import int_act_blocker

        q = self.act_quantizer()
        spec, permuted = (None if q is None else q.spec), self.g_idx is not None and not self._runtime_blocks
        return int_act_blocker(
            self.INT_ACT_KERNELS, spec, self.storage_bits, self.group_size, self.in_features, permuted
        )

    def _build_int_act(self):
        """The integer-activation kernel: the codes at their storage width, ``code_offset`` folded into
        the zero-point, act-order columns made contiguous (as :meth:`_build_kernel`)."""
        from .intact import IntActKernel, act_weight_groups
        from .kernel import contiguous_group_perm

        if self.int_act_blocker() is not None:
            return None
        codes = unpack_codes(self.qweight, self.storage_bits, self.in_features)
        z = self._zeros_arg()
        z = z - self.code_offset if not torch.is_tensor(z) else z.float() - self.code_offset
        perm = None
        if self.g_idx is not None:
            perm = contiguous_group_perm(self.g_idx, self.group_size)
            codes = codes.index_select(1, perm)
        s, z, gs = act_weight_groups(
            self.scales.float(), z, self.group_size, self.in_features, self.act_quantizer().spec
        )
        w = IntActWeight.from_codes(codes, self.storage_bits, s, z, gs)
        return IntActKernel(w, perm, stored_order=self._runtime_blocks)

    @property
    def _runtime_blocks(self) -> bool:
        """Whether the activation quantizer is a run-time one (not saved): its groups (``q8_0``'s blocks
        of 32) are then taken over the kernel's column order, as llama.cpp's blocks are over the file's."""
        return self._modules.get("input_quant") is None and self.act_quantizer() is not None

    def _saved_from_kernel(self, k):
        """Rebuilds of the packed buffers from the :class:`~bitmosaic.modules.kernel.LowBitKernel`
        ``k``: ``qweight`` packs its codes again, ``scales``/``zeros`` are its float32 copies back in
        fp16 (the zero-point with ``code_offset`` added back), ``g_idx`` comes from its permutation."""
        from .kernel import lowbit_codes

        w = k.weight  # (called unbound by PackedExperts, which is no QuantLinear: hence the explicit class)
        return QuantLinear._rebuilds(
            self, lambda rows: lowbit_codes(k, rows), lambda: w.scales, lambda: w.zeros, k.perm
        )

    def _saved_from_int_act(self, k):
        """The same from the integer-activation kernel ``k`` (its codes un-permuted) -- only where the
        weight groups are the layer's own (not split into finer activation groups) and for this class's
        own integer kernel and buffers (a subclass that changes either keeps its buffers)."""
        own = type(self)._build_int_act is QuantLinear._build_int_act
        if not own or type(self)._saved_from_kernel is not QuantLinear._saved_from_kernel:
            return {}
        w = k.weight
        if tuple(w.scales().shape) != tuple(self._buffers["scales"].shape):  # (meta when released)
            return {}

        def codes(rows: slice) -> torch.Tensor:
            c = w.codes(rows)
            if k.perm is None:
                return c
            out = torch.empty_like(c)
            out[:, k.perm] = c  # the kernel's column j is the layer's column perm[j]
            return out

        return self._rebuilds(codes, w.scales, w.zeros, k.perm)

    def _rebuilds(self, codes, scales, zeros, perm) -> dict:
        """name -> rebuild of the packed buffers from a kernel: ``codes(rows)`` the codes ``[rows, in]`` in
        the layer's column order, ``scales()`` / ``zeros()`` float32 ``[out, G]`` (the zero-point without
        ``code_offset``), ``perm`` the kernel's column permutation (act order) or ``None``."""
        from .kernel import row_chunks

        n, cols, bits = self.out_features, self.in_features, self.storage_bits

        def qweight() -> torch.Tensor:
            parts = [pack_codes(codes(rows), bits) for rows in row_chunks(n, cols)]
            return torch.cat(parts) if parts else torch.zeros(0, packed_cols(cols, bits), dtype=torch.uint8)

        def g_idx() -> torch.Tensor:
            g = torch.empty(cols, dtype=torch.int32)
            g[perm] = torch.arange(cols, dtype=torch.int32) // self.group_size
            return g

        out = {"qweight": qweight, "scales": lambda: scales().to(torch.float16)}
        if not self.symmetric:
            out["zeros"] = lambda: (zeros() + self.code_offset).to(torch.float16)
        if perm is not None:
            out["g_idx"] = g_idx
        return out

    # -- export -------------------------------------------------------------------------------
    def int_form(self, allowed_bits, lossy, changes) -> IntForm:
        """The packed buffers as they are: exact when the codes are on the ``bits`` grid and ``bits`` is
        allowed (else re-gridded at a wider width with ``lossy``)."""
        layer, values = self._packed_form()
        return self._fit_grid(layer, values, allowed_bits, lossy, changes)

    def _packed_form(self) -> tuple[IntForm, torch.Tensor]:
        """The packed buffers as an :class:`IntForm` at ``storage_bits`` (plus the signed values)."""
        codes = self.codes().to(torch.int64)
        G = self.scales.shape[1]
        if self.symmetric:
            zeros = torch.full((self.out_features, G), 1 << (self.bits - 1), dtype=torch.int64)
        else:
            zf = self.zeros.float()
            if not torch.equal(zf, zf.round()):
                raise NoIntForm("fractional zero-points (GPTQ and compressed-tensors store integer zeros)")
            zeros = zf.long()
        g_idx = self._g_idx_arg().to(torch.int32)
        values = codes - zeros.gather(1, g_idx.long().expand_as(codes))
        layer = IntForm(
            codes.to(torch.int32),
            self.scales.clone(),
            zeros.to(torch.int32),
            g_idx,
            self.bits,
            self.group_size,
            self.symmetric,
        )
        return layer, values

    def _fit_grid(self, layer: IntForm, values, allowed_bits, lossy, changes) -> IntForm:
        """``layer`` at a width in ``allowed_bits``: no-clip integers and disallowed widths re-gridded."""
        if self.storage_bits != self.bits or self.code_offset:
            lo, hi = int(values.min()), int(values.max())
            self._refuse_or_note(
                "no-clip integers outside the layer's bit grid "
                "(re-gridded at a wider width, clamped at 8 bits)",
                lossy,
                changes,
            )
            bits = widest_fit(bit_len(hi - lo), allowed_bits)
            changes.append(f"integers stored on a {bits}-bit grid")
            return embed(values, layer.scales, layer.g_idx, layer.group_size, bits, False)
        if layer.bits not in allowed_bits:
            bits = widest_fit(layer.bits, allowed_bits)
            self._refuse_or_note(
                f"{layer.bits}-bit codes: the format stores "
                f"{'/'.join(map(str, allowed_bits))} bits (widened)",
                lossy,
                changes,
            )
            return embed(values, layer.scales, layer.g_idx, layer.group_size, bits, layer.symmetric)
        return layer

    # -- accounting ---------------------------------------------------------------------------
    def storage_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qweight, self.scales, self.zeros, self.g_idx) if t is not None]

    def layer_config(self) -> dict:
        return self._config(
            bits=self.bits,
            group_size=self.group_size,
            symmetric=self.symmetric,
            storage_bits=self.storage_bits,
            code_offset=self.code_offset,
            has_g_idx=self.g_idx is not None,
        )

    @classmethod
    def _shared_kwargs(cls, cfg: dict) -> dict:
        return packed_kwargs(cfg)

    def extra_repr(self) -> str:
        s = f"{super().extra_repr()}, bits={self.bits}, group={self.group_size}"
        s += ", sym" if self.symmetric else ", asym"
        if self.storage_bits != self.bits:
            s += f", stored at {self.storage_bits} bits (offset {self.code_offset})"
        return s + (", g_idx" if self.g_idx is not None else "")


def packed_kwargs(cfg: dict) -> dict:
    """Constructor keywords of a packed layout from its saved per-layer config."""
    return {
        "bits": cfg["bits"],
        "group_size": cfg["group_size"],
        "symmetric": cfg["symmetric"],
        "bias": cfg.get("bias", False),
        "has_g_idx": cfg.get("has_g_idx", False),
        "storage_bits": cfg.get("storage_bits"),
        "code_offset": cfg.get("code_offset", 0),
    }
