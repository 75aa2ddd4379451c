"""Quantized linear modules beyond the plain packed layout, and the registry that rebuilds any of
them from a saved per-layer config (``"kind"``).

- :class:`SparseOutlierQuantLinear` (``"packed+csr"``): SSQR's dense clamped codes + CSR outliers;
  forward = dense dequantization + sparse add.
- :class:`FP8ComputeQuantLinear` (``"dpq"``): DPQ's INT4 codes with FP8-domain group scale/zero,
  dequantized to the FP8 grid (``nearest_Z((q - z) s)``) and scaled by the FP8 weight scale.
- :class:`HuffmanQuantLinear` (``"huffman"``): HPTQ/HRTN's unbounded integers, Huffman-coded, one
  fp16 scale per matrix or row; the stream is decoded once (at load or first use), so the model
  stays usable; the *storage* is the encoded stream.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import nn

from ..algorithms.rtn import rtn_quantize
from ..algorithms.types import QuantResult
from ..formats import huffman
from ..formats.act import ActQuantSpec
from ..formats.fp import fp_round, get_float_format
from ..formats.grid import IntGrid
from ..formats.intform import FP8Form, IntForm, bit_len, embed, widest_fit
from ..formats.sparse import CSR, csr_from_dense
from .actquant import attach_input_quant, input_quant_spec
from .base import KINDS, QuantModule
from .qlinear import QuantLinear

__all__ = [
    "SparseOutlierQuantLinear",
    "HuffmanQuantLinear",
    "FP8ComputeQuantLinear",
    "FP8Linear",
    "module_from_layer_config",
    "full_layer_config",
    "MODULE_KINDS",
]


class SparseOutlierQuantLinear(QuantLinear):
    kind = "packed+csr"
    CONFIG_KEYS = ("nnz",)
    # on CUDA: the Triton dense kernel plus a Triton CSR pass (kernels/triton/sparse.py, issue 76)
    KERNELS = QuantLinear.KERNELS
    GPU_KERNELS = QuantLinear.GPU_KERNELS

    def __init__(self, in_features, out_features, *, nnz: int = 0, **kw) -> None:
        super().__init__(in_features, out_features, **kw)
        self._idx_dtype = torch.int16 if in_features <= 32767 else torch.int32
        self.register_buffer("outlier_row_ptr", torch.zeros(out_features + 1, dtype=torch.int32))
        self.register_buffer("outlier_cols", torch.zeros(nnz, dtype=self._idx_dtype))
        self.register_buffer("outlier_vals", torch.zeros(nnz, dtype=torch.float16))

    @classmethod
    def from_result(cls, res: QuantResult, *, bits, group_size, symmetric, bias=None):
        dense = QuantLinear.from_result(res, bits=bits, group_size=group_size, symmetric=symmetric, bias=bias)
        sparse = res.sparse if res.sparse is not None else torch.zeros_like(res.codes, dtype=torch.float32)
        csr = csr_from_dense(sparse, sparse != 0)
        m = cls._from_packed(dense, nnz=csr.nnz)
        m.outlier_row_ptr.copy_(csr.row_ptr)
        m.outlier_cols.copy_(csr.col_idx)
        m.outlier_vals.copy_(csr.values)
        return m

    def csr(self) -> CSR:
        shape = (self.out_features, self.in_features)
        return CSR(self.outlier_row_ptr, self.outlier_cols, self.outlier_vals, shape)

    def dequantize_reference(self, dtype=torch.float32):
        return self.csr().add_to(super().dequantize_reference(dtype))

    def _dequantize(self, dtype):
        return self.csr().add_to(super()._dequantize(dtype))

    def _build_kernel(self):
        from .kernel import SparseAddKernel

        with warnings.catch_warnings():  # torch calls its sparse CSR support "beta"
            warnings.simplefilter("ignore", UserWarning)
            sparse = torch.sparse_csr_tensor(
                self.outlier_row_ptr.to(torch.int32),
                self.outlier_cols.to(torch.int32),
                self.outlier_vals.float(),
                (self.out_features, self.in_features),
                check_invariants=True,
            )
        dense = super()._build_kernel()
        if getattr(dense.weight, "KERNEL_NAME", None) == "triton_int":
            from ..kernels.triton.sparse import TritonSparseAddKernel

            return TritonSparseAddKernel(dense, sparse.to(dense.weight.qweight.device))
        return SparseAddKernel(dense, sparse)

    def _saved_from_kernel(self, k):
        """The dense part's rebuilds plus the CSR outliers from the kernel's sparse matrix."""
        sp = k.sparse
        return {
            **super()._saved_from_kernel(k.dense),
            "outlier_row_ptr": lambda: sp.crow_indices().to(torch.int32),
            "outlier_cols": lambda: sp.col_indices().to(self._idx_dtype),
            "outlier_vals": lambda: sp.values().to(torch.float16),
        }

    def int_form(self, allowed_bits, lossy, changes) -> IntForm:
        layer, values = self._packed_form()
        if self.outlier_vals.numel():
            self._refuse_or_note(
                "SSQR's CSR outliers are a sparse residual no format holds (dropped)", lossy, changes
            )
        return self._fit_grid(layer, values, allowed_bits, lossy, changes)

    def storage_tensors(self):
        return super().storage_tensors() + [self.outlier_row_ptr, self.outlier_cols, self.outlier_vals]

    def layer_config(self) -> dict:
        return {**super().layer_config(), "nnz": int(self.outlier_vals.numel())}


class FP8ComputeQuantLinear(QuantLinear):
    """INT codes whose dequantized values are rounded onto an FP8 grid: the W4A8-FP8 weight operand.

    Stored: the packed codes, fp16 FP8-domain ``scales``/``zeros`` and ``fp8_scale`` (float32
    ``[1, 1]`` per tensor or ``[out, 1]`` per channel).  Weight = ``nearest_Z((q - z) s) * s_w``,
    exactly :meth:`bitmosaic.algorithms.dpq.DPQResult.dequantize`.  With FP8 activations the
    float32 matmul is the FP8xFP8 GEMM with float32 accumulation, except that the scale products
    ``ŵ8 * s_w`` and ``x8 * s_x`` are rounded to float32 (exact with power-of-two scales).
    """

    kind = "dpq"
    CONFIG_KEYS = ("fmt", "fp8_rows")
    # on CUDA: the Triton INT kernel with the E4M3 rounding and FP8 scale in its dequantization, FP8
    # operands on tl.dot with a static per-tensor E4M3 input quantizer on capability >= 8.9
    # (kernels/triton/intmm.py, issue 76; E4M3 only, an E5M2 layer runs F.linear there)
    KERNELS = QuantLinear.KERNELS
    GPU_KERNELS = QuantLinear.GPU_KERNELS

    def __init__(self, in_features, out_features, *, fmt: str = "e4m3", fp8_rows: int = 1, **kw) -> None:
        super().__init__(in_features, out_features, **kw)
        self.fmt = fmt
        self.register_buffer("fp8_scale", torch.ones(fp8_rows, 1, dtype=torch.float32))

    @classmethod
    def from_result(cls, res, *, bits, group_size, symmetric, bias=None):
        dense = QuantLinear.from_result(res, bits=bits, group_size=group_size, symmetric=symmetric, bias=bias)
        fp8 = res.fp8_scale.reshape(-1, 1).float()
        m = cls._from_packed(dense, fmt=res.fmt, fp8_rows=fp8.shape[0])
        m.fp8_scale.copy_(fp8)
        return m

    def fp8_weight(self) -> torch.Tensor:
        """The FP8-grid weight operand ``nearest_Z((q - z) s)`` (float32)."""
        return fp_round(QuantLinear._dequantize(self, torch.float32), self.fmt)

    def dequantize_reference(self, dtype=torch.float32):
        return (fp_round(super().dequantize_reference(torch.float32), self.fmt) * self.fp8_scale).to(dtype)

    def _dequantize(self, dtype):
        return (self.fp8_weight() * self.fp8_scale).to(dtype)

    def _build_kernel(self):
        from .kernel import dpq_tiles

        dense = QuantLinear._build_kernel(self)
        if getattr(dense.weight, "KERNEL_NAME", None) == "triton_int" and self.fmt == "e4m3":
            from .kernel import ScaledInputKernel

            k = ScaledInputKernel(dense.weight.with_fp8(self.fp8_scale), dense.perm, self.fp8_act_scale)
            k.dense = dense
            return k
        return dpq_tiles(dense, self.fmt, self.fp8_scale, self.out_features, self.in_features)

    def fp8_act_scale(self) -> torch.Tensor | None:
        """The static per-tensor E4M3 activation scale of this layer's input quantizer (DPQ §4.1), which
        lets the Triton kernel multiply FP8 operands on the tensor cores; ``None`` for any other
        activation quantizer or none (the kernel then multiplies the FP8-grid weight in float32)."""
        q = self.act_quantizer()
        spec = getattr(q, "spec", None)
        if spec is None or spec.fmt not in ("e4m3", "e4m3-240") or spec.granularity != "tensor":
            return None
        return q.scale if spec.static else None

    def _saved_from_kernel(self, k):
        return super()._saved_from_kernel(k.dense)  # fp8_scale is shared with the kernel, kept

    def _kernel_runs_on(self, x: torch.Tensor) -> bool:
        return (x.device.type == "cpu" or self.fmt == "e4m3") and super()._kernel_runs_on(x)

    _NOT_AFFINE = (
        "DPQ's weights are nearest_FP8((q - z) s) * s_w: FP8-domain group scales and an FP8 rounding are "
        "not an affine INT grid"
    )

    def int_form(self, allowed_bits, lossy, changes) -> IntForm:
        layer, values = self._packed_form()
        self._refuse_or_note(self._NOT_AFFINE, lossy, changes)
        changes.append("DPQ exported as its INT codes with scales s * s_w (the FP8 rounding is lost)")
        s = (self.scales.float() * self.fp8_scale.float()).to(torch.float16)
        layer.scales = s.expand(self.out_features, -1).contiguous()
        return self._fit_grid(layer, values, allowed_bits, lossy, changes)

    def exports_as_fp8(self, lossy: bool) -> bool:
        return lossy  # its exact FP8 weight operand (8 bits/weight) is the nearest form

    def fp8_form(self, lossy, changes) -> FP8Form:
        if self.fmt not in ("e4m3", "e4m3-240"):
            return super().fp8_form(lossy, changes)
        self._refuse_or_note(self._NOT_AFFINE, lossy, changes)
        changes[-1:] = [
            "DPQ stored as its FP8 weight operand nearest_FP8((q - z) s) with scale s_w "
            "(values exact, 8 bits/weight)"
        ]
        return FP8Form(self.fp8_weight().to(torch.float8_e4m3fn), self.fp8_scale.float().clone())

    def storage_tensors(self):
        return super().storage_tensors() + [self.fp8_scale]

    def layer_config(self) -> dict:
        return {**super().layer_config(), "fmt": self.fmt, "fp8_rows": self.fp8_scale.shape[0]}


class FP8Linear(QuantModule):
    """FP8 weights stored as FP8 bytes (``float8_e4m3fn`` / ``float8_e5m2`` bit patterns in a uint8
    buffer) with a float32 scale per output channel or tensor: ``W = fp8 * weight_scale``."""

    kind = "fp8"
    CONFIG_KEYS = ("fmt", "scale_rows")

    def __init__(self, in_features, out_features, *, fmt: str = "e4m3", scale_rows: int = 1, bias=False):
        super().__init__(in_features, out_features, bias, cache_weight=False)
        self.fmt = fmt
        self._dtype = get_float_format(fmt).cast_dtype()
        if self._dtype is None:
            raise ValueError(f"{fmt} has no torch storage dtype; FP8Linear stores e4m3, e4m3-240 or e5m2")
        self.register_buffer("weight_fp8", torch.zeros(out_features, in_features, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.ones(scale_rows, 1, dtype=torch.float32))

    @classmethod
    def from_values(cls, values: torch.Tensor, scale: torch.Tensor, fmt: str, bias=None) -> FP8Linear:
        out, n = values.shape
        m = cls(n, out, fmt=fmt, scale_rows=scale.reshape(-1, 1).shape[0], bias=bias is not None)
        fp = values.float().to(m._dtype)
        if not torch.equal(fp.float(), values.float()):
            raise ValueError("values are not on the FP8 grid; round them with formats.fp.fp_round first")
        m.weight_fp8.copy_(fp.view(torch.uint8))
        m.weight_scale.copy_(scale.reshape(-1, 1).float())
        m._set_bias(bias)
        return m

    def _dequantize(self, dtype) -> torch.Tensor:
        return (self.weight_fp8.view(self._dtype).float() * self.weight_scale).to(dtype)

    def dequantize_reference(self, dtype=torch.float32) -> torch.Tensor:
        return self._dequantize(dtype)

    def storage_tensors(self):
        return [self.weight_fp8, self.weight_scale]

    def layer_config(self) -> dict:
        return self._config(fmt=self.fmt, scale_rows=int(self.weight_scale.shape[0]))

    def int_form(self, allowed_bits, lossy, changes) -> IntForm:
        self._refuse_or_note(
            f"{self.fmt} floating-point weights are not an INT grid (re-rounded to INT8 per channel)",
            lossy,
            changes,
        )
        res = rtn_quantize(self.dequantize_reference(torch.float32), IntGrid(8, True), None)
        return IntForm(
            res.codes,
            res.scales.to(torch.float16),
            res.zeros.to(torch.int32),
            res.g_idx.to(torch.int32),
            8,
            self.in_features,
            True,
        )

    def exports_as_fp8(self, lossy: bool) -> bool:
        return True

    def fp8_form(self, lossy, changes) -> FP8Form:
        W8 = self.weight_fp8.view(self._dtype).float()
        scale = self.weight_scale.float()
        if self.fmt in ("e4m3", "e4m3-240"):  # e4m3-240 is e4m3 clamped to +-240: a subset of the E4M3 grid
            return FP8Form(W8.to(torch.float8_e4m3fn), scale)
        self._refuse_or_note(f"{self.fmt} weights (compressed-tensors' FP8 is E4M3)", lossy, changes)
        changes[-1] = f"{self.fmt} weights rounded to E4M3"
        row = W8.abs().amax(dim=1, keepdim=True) if scale.shape[0] > 1 else W8.abs().amax().reshape(1, 1)
        up = (row / 448.0).clamp(min=1.0)
        return FP8Form(fp_round(W8 / up, "e4m3").to(torch.float8_e4m3fn), scale * up)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.fmt}"


class HuffmanQuantLinear(QuantModule):
    """Unbounded integers ``q`` with ``w = q * s`` (``s`` per matrix or row), Huffman-coded."""

    kind = "huffman"
    CONFIG_KEYS = ("n_scales", "n_bytes", "n_symbols")

    def __init__(self, in_features, out_features, *, n_scales: int, n_bytes: int, n_symbols: int, bias=False):
        # the stream is decoded once (kept as integers); the stream stays the stored form
        super().__init__(in_features, out_features, bias)
        self._decoded: torch.Tensor | None = None
        self.register_buffer("scales", torch.zeros(n_scales, 1, dtype=torch.float16))
        self.register_buffer("huff_data", torch.zeros(n_bytes, dtype=torch.uint8))
        self.register_buffer("huff_symbols", torch.zeros(n_symbols, dtype=torch.int16))
        self.register_buffer("huff_lengths", torch.zeros(n_symbols, dtype=torch.uint8))
        self.register_buffer("huff_row_ends", torch.zeros(out_features, dtype=torch.int32))

    @classmethod
    def from_result(cls, res: QuantResult, bias=None) -> HuffmanQuantLinear:
        out, n = res.codes.shape
        stream = huffman.encode(res.codes.cpu().numpy())
        t = huffman.to_tensors(stream)
        scales = res.scales[:, :1]
        n_scales = 1 if bool((scales == scales[0]).all()) else out
        m = cls(
            n,
            out,
            n_scales=n_scales,
            n_bytes=t["data"].numel(),
            n_symbols=t["symbols"].numel(),
            bias=bias is not None,
        )
        m.scales.copy_(scales[:n_scales].to(torch.float16))
        m.huff_data.copy_(t["data"])
        m.huff_symbols.copy_(t["symbols"])
        m.huff_lengths.copy_(t["lengths"])
        m.huff_row_ends.copy_(t["row_ends"])
        m._set_bias(bias)
        return m

    def codes(self) -> torch.Tensor:
        """The integers ``[out, in]`` (int64): read back from the kernel weight once it is built, else
        decoded once and kept as int16/int32."""
        if self._kernel:
            return self._kernel_ints(self._kernel).to(torch.int64)
        if self._decoded is None or self._decoded.device != self.huff_data.device:
            self._decoded = self._narrow(self._decode())
        return self._decoded.to(torch.int64)

    @staticmethod
    def _narrow(q: torch.Tensor) -> torch.Tensor:
        small = bool(q.numel() == 0 or (q.abs().max() < 2**15))
        return q.to(torch.int16 if small else torch.int32)

    @staticmethod
    def _kernel_ints(k) -> torch.Tensor:
        """The integers a kernel from :meth:`_build_kernel` holds (a low-bit one stores ``q - lo``
        with the zero-point ``-lo``)."""
        from .kernel import LowBitKernel, lowbit_codes

        if isinstance(k, LowBitKernel):
            return lowbit_codes(k) + (-k.weight.zeros).to(torch.int32)
        return k.codes

    def _decode(self) -> torch.Tensor:
        tensors = {
            "data": self.huff_data,
            "symbols": self.huff_symbols,
            "lengths": self.huff_lengths,
            "row_ends": self.huff_row_ends,
        }
        stream = huffman.from_tensors(tensors, (self.out_features, self.in_features))  # on the host
        return torch.from_numpy(np.ascontiguousarray(huffman.decode(stream))).to(self.huff_data.device)

    def dequantize_reference(self, dtype=torch.float32) -> torch.Tensor:
        return self.codes().to(dtype) * self.scales.to(dtype).expand(self.out_features, 1)

    def _dequantize(self, dtype) -> torch.Tensor:
        return self.dequantize_reference(dtype)

    def _build_kernel(self):
        """Integers within 8 bits of range: a low-bit weight (one group per row); wider: int16 tiles."""
        from .kernel import int_tiles, lowbit_from_codes

        q = self._decoded if self._decoded is not None else self._narrow(self._decode())
        self._decoded = None  # the kernel holds the integers from now on (codes() reads them back)
        lo, hi = (int(q.min()), int(q.max())) if q.numel() else (0, 0)
        s = self.scales.float().expand(self.out_features, 1)
        if hi - lo < 256:
            bits = max(1, (hi - lo).bit_length())
            return lowbit_from_codes((q.to(torch.int32) - lo).to(torch.uint8), bits, s, float(-lo), -1, None)
        return int_tiles(q, self.scales)

    def _saved_from_kernel(self, k):
        """The stream (``huff_data``, ``huff_row_ends``) re-encoded from the kernel's integers with the
        stored code table (canonical code: the same integers give the same bits)."""
        done: dict[str, torch.Tensor] = {}

        def stream(key: str):
            def rebuild() -> torch.Tensor:
                if not done:
                    code = huffman.HuffmanCode(
                        symbols=self.huff_symbols.cpu().numpy().astype(np.int64),
                        lengths=self.huff_lengths.cpu().numpy().astype(np.uint8),
                    )
                    q = self._kernel_ints(k).cpu().numpy()
                    done.update(huffman.to_tensors(huffman.encode(q, code)))
                return done[key]

            return rebuild

        return {"huff_data": stream("data"), "huff_row_ends": stream("row_ends")}

    def _load_from_state_dict(self, *args, **kwargs):
        self._decoded = None
        super()._load_from_state_dict(*args, **kwargs)

    def storage_tensors(self):
        return [self.scales, self.huff_data, self.huff_symbols, self.huff_lengths, self.huff_row_ends]

    def int_form(self, allowed_bits, lossy, changes) -> IntForm:
        q = self.codes()
        lo, hi = int(q.min()), int(q.max())
        self._refuse_or_note(
            "Huffman-coded integers (HPTQ/HRTN): neither format has entropy coding", lossy, changes
        )
        bits = widest_fit(bit_len(hi - lo), allowed_bits)
        changes.append(f"integers stored on a {bits}-bit grid, one scale per row")
        s = self.scales.expand(self.out_features, 1)
        return embed(q, s, torch.zeros(self.in_features, dtype=torch.int32), self.in_features, bits, False)

    def layer_config(self) -> dict:
        return self._config(
            n_scales=int(self.scales.shape[0]),
            n_bytes=int(self.huff_data.numel()),
            n_symbols=int(self.huff_symbols.numel()),
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, huffman, {self.bits_per_weight():.3f} bpw"


MODULE_KINDS = KINDS  # the one registry (filled by QuantModule.__init_subclass__), by its old name


def full_layer_config(module: nn.Module) -> dict:
    """The module's saved per-layer config, with its activation quantizer (``"act"``) if any."""
    cfg = module.layer_config()
    spec = input_quant_spec(module)
    if spec is not None:
        cfg["act"] = spec.to_dict()
    return cfg


def module_from_layer_config(cfg: dict) -> nn.Module:
    kind = cfg.get("kind", "packed")
    if kind not in KINDS:
        raise ValueError(f"unknown quantized module kind {kind!r}; this bitmosaic knows {sorted(KINDS)}")
    m = KINDS[kind].from_layer_config(cfg)
    if cfg.get("act"):
        attach_input_quant(m, ActQuantSpec(**cfg["act"]), cfg["in_features"])
    return m
