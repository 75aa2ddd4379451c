"""``SFMPLinear`` (kind ``"sfmp"``): SFMP's block-wise mixed-precision layer (Nie et al. §4.3-4.5).

Saved buffers: ``qweight`` (uint8, the codes of ``W̃ = P_row W P_col`` in the block-major layout
of :mod:`bitmosaic.formats.blocks`), ``scales``/``zeros`` (fp16 ``[out, G]``, groups contiguous on
``W̃``: no ``g_idx``), ``row_perm``/``col_perm`` (int16/int32, absent when that reordering is
off) and ``bit_map`` (uint8 ``[n_rb, n_cb]``, the width of each block), plus the bias.  Bits per
weight count all of them; :meth:`SFMPLinear.bits_breakdown` lists them separately.

Inference (Eq. 14): ``x̃ = x[..., col_perm]``, ``ỹ = x̃ W̃ᵀ`` with the low-bit kernel, ``y`` = ``ỹ``
un-permuted (``ỹ[..., inv(row_perm)]``).  ``sfmp_model.fold_permutations`` removes a gather where that is
exact: gate/up emit their outputs directly in down_proj's column order, and down_proj then skips
its input gather (q/k/v are always un-permuted: RoPE and the heads need the original order).  The
folded indices are derived from the saved permutations at load, never saved.

The kernel is made by :func:`_make_kernel`: the bit-plane LUT GEMV of §4.5 / App. G
(:class:`~bitmosaic.kernels.lut.BitPlaneWeight`, any mix of 1..8 bits per block, blocks of
``block_rows`` x ``group_size``) at batch 1, its tiled dequantize + matmul for more rows; on CUDA the
same planes in the Triton bit-plane GEMV (``kernels/triton/bitplane.py``, issue 76; dequantize +
``torch.mm`` above 16 rows), which ``bitmosaic.load(path, device="cuda")`` builds.  Once it
is built, ``qweight``/``scales``/``zeros`` are released and rebuilt from it, bit for bit, whenever
something reads them (the one mechanism of :mod:`bitmosaic.modules.base`, resident weights), so a
loaded model holds one copy of its weights, not two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..algorithms.sfmp import BlockPlan, group_bits, index_dtype, inverse_perm
from ..algorithms.types import QuantResult
from ..formats.accounting import storage_bits
from ..formats.bitplane import BitPlanes
from ..formats.bitplane import unpack as unpack_planes
from ..formats.blocks import pack_blocks, unpack_blocks
from ..formats.intform import IntForm, embed, widest_fit
from ..formats.layout import default_g_idx, dequantize, num_groups
from .base import NoIntForm, QuantModule

__all__ = ["SFMPLinear", "SFMPResult"]


@dataclass
class SFMPResult(QuantResult):
    """A :class:`QuantResult` in the original row/column order (``g_idx`` = each column's group on
    ``W̃``) that also carries the SFMP plan the codes were quantized under."""

    plan: BlockPlan | None = None


def _make_kernel(codes, gbits_rb, scales, zeros, group_size: int, row_block: int, kernels=("lut",),
                 device="cpu"):  # fmt: skip
    """The kernel of ``W̃`` (codes ``[N, K]``, widths ``[n_rb, G]``) that
    :func:`~bitmosaic.kernels.select.select_kernel` picks among ``kernels`` for ``device`` (built on the
    CPU, then moved there): for SFMP on CUDA the Triton bit-plane GEMV (kernels/triton/bitplane.py, issue
    76); on the CPU the bit-plane LUT GEMV at batch 1 (SFMP §4.5; faster than the unpack+FMA
    ``LowBitWeight`` at 1-3 bits, ``benchmarks/kernels/lut_gemv.py``), tiled dequantize + matmul above."""
    from ..kernels.select import offers_device, select_kernel

    dev = torch.device(device)
    on = dev.type if offers_device(kernels, dev.type) else "cpu"
    kind = select_kernel(kernels, gbits_rb, group_size=group_size, device=on)
    w = kind.from_codes(codes, gbits_rb, scales, zeros, group_size, row_block)
    return w.to(dev) if dev.type != "cpu" and hasattr(w, "to") else w


class SFMPLinear(QuantModule):
    kind = "sfmp"
    # its column gather / row un-permutation run in the kernel call; on CUDA the Triton bit-plane GEMV
    KERNELS: ClassVar[tuple[str, ...]] = ("triton_bitplane", "lut")
    GPU_KERNELS: ClassVar[tuple[str, ...]] = ("triton_bitplane",)
    CONFIG_KEYS: ClassVar[tuple[str, ...]] = (
        "group_size", "block_rows", "block_cols", "row_reorder", "col_reorder", "nbytes",
    )  # fmt: skip

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group_size: int,
        block_rows: int,
        block_cols: int,
        row_reorder: bool,
        col_reorder: bool,
        nbytes: int,
        bias: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        if block_cols % group_size:
            raise ValueError(f"block columns ({block_cols}) must be a multiple of the group ({group_size})")
        self.group_size, self.block_rows, self.block_cols = group_size, block_rows, block_cols
        self.row_reorder, self.col_reorder, self.nbytes = row_reorder, col_reorder, nbytes
        G = num_groups(in_features, group_size)
        n_rb, n_cb = -(-out_features // block_rows), -(-in_features // block_cols)
        self.register_buffer("qweight", torch.zeros(nbytes, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(out_features, G, dtype=torch.float16))
        self.register_buffer("zeros", torch.zeros(out_features, G, dtype=torch.float16))
        self.register_buffer("bit_map", torch.ones(n_rb, n_cb, dtype=torch.uint8))
        rp = torch.zeros(out_features, dtype=index_dtype(out_features)) if row_reorder else None
        cp = torch.zeros(in_features, dtype=index_dtype(in_features)) if col_reorder else None
        self.register_buffer("row_perm", rp)
        self.register_buffer("col_perm", cp)
        self._reset_runtime()  # runtime only (fold_permutations), derived from the saved buffers

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_result(cls, res: SFMPResult, bias=None) -> SFMPLinear:
        plan = res.plan
        N, K = res.codes.shape
        rp = plan.row_perm.long() if plan.row_perm is not None else torch.arange(N)
        cp = plan.col_perm.long() if plan.col_perm is not None else torch.arange(K)
        codes_t = res.codes.cpu()[rp][:, cp]
        data = pack_blocks(codes_t, plan.bits, plan.block_rows, plan.block_cols)
        m = cls(
            K,
            N,
            group_size=plan.group_size,
            block_rows=plan.block_rows,
            block_cols=plan.block_cols,
            row_reorder=plan.row_perm is not None,
            col_reorder=plan.col_perm is not None,
            nbytes=data.numel(),
            bias=bias is not None,
        )
        m.qweight.copy_(data)
        m.scales.copy_(res.scales.cpu()[rp].to(torch.float16))
        m.zeros.copy_(res.zeros.cpu()[rp].to(torch.float16))
        m.bit_map.copy_(plan.bits)
        if m.row_perm is not None:
            m.row_perm.copy_(plan.row_perm)
        if m.col_perm is not None:
            m.col_perm.copy_(plan.col_perm)
        m._set_bias(bias)
        return m

    # -- weights ------------------------------------------------------------------------------
    def _plan(self) -> BlockPlan:
        return BlockPlan(
            self.out_features, self.in_features, self.block_rows, self.block_cols, self.group_size,
            self.row_perm, self.col_perm, self.bit_map,
        )  # fmt: skip

    def codes_permuted(self) -> torch.Tensor:
        """Codes of ``W̃`` (int32 ``[out, in]``)."""
        shape = (self.out_features, self.in_features)
        return unpack_blocks(self.qweight, shape, self.bit_map, self.block_rows, self.block_cols)

    def _unpermute(self, Wt: torch.Tensor) -> torch.Tensor:
        W = Wt
        if self.col_perm is not None:
            W = torch.empty_like(Wt)
            W[:, self.col_perm.long().to(W.device)] = Wt
        if self.row_perm is not None:
            W2 = torch.empty_like(W)
            W2[self.row_perm.long().to(W.device)] = W
            W = W2
        return W

    def dequantize_reference(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = default_g_idx(self.in_features, self.group_size)
        Wt = dequantize(self.codes_permuted(), self.scales.cpu(), self.zeros.cpu(), g, dtype=dtype)
        return self._unpermute(Wt).to(self.scales.device)

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The *inference* weight: the original-order weight, its rows in the emitted order and its
        columns in the expected input order when :func:`fold_permutations` changed them."""
        W = self.dequantize_reference(dtype)
        if self._emit is not None:
            W = W.index_select(0, self._emit.to(W.device))
        if not self._gather_input:
            W = W.index_select(1, self.col_perm.long().to(W.device))
        return W

    def _build_kernel(self):
        plan = self._plan()
        gb = group_bits(plan)[:: self.block_rows].to(torch.uint8)  # [n_rb, G]
        w = _make_kernel(
            self.codes_permuted(), gb, self.scales.float().cpu(), self.zeros.float().cpu(),
            self.group_size, self.block_rows, self.KERNELS, self.bit_map.device,
        )  # fmt: skip
        return _PermutedKernel(w, self)

    def _saved_from_kernel(self, k):
        """Rebuilds of the codes and fp16 scales/zeros from the bit-plane kernel ``k`` (resident
        weights, ``modules/base.py``): ``qweight`` is re-packed row block by row block from the planes
        (the saved layout is row-block-major, so the pieces concatenate), ``scales``/``zeros`` are the
        kernel's float32 copies back in fp16.  The bit map and permutations stay (small, and the
        gathers read them)."""
        w = k.weight

        def qweight() -> torch.Tensor:
            p, parts = w.planes, []
            if p.data.device.type != "cpu":  # the format's unpacking runs on the CPU
                p = BitPlanes(p.data.cpu(), p.offsets.cpu(), p.bits.cpu(), p.N, p.K, p.group_size,
                              p.row_block)  # fmt: skip
            bmap = self.bit_map.cpu()
            for rb in range(bmap.shape[0]):
                rows = slice(rb * self.block_rows, min(self.out_features, (rb + 1) * self.block_rows))
                codes = unpack_planes(p, rows)
                parts.append(pack_blocks(codes, bmap[rb : rb + 1], self.block_rows, self.block_cols))
            q = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
            return q.to(w.planes.data.device)

        return {
            "qweight": qweight,
            "scales": lambda: w.scales_t.T.to(torch.float16).contiguous(),
            "zeros": lambda: w.zeros_t.T.to(torch.float16).contiguous(),
        }

    def _input_index(self, device: torch.device) -> torch.Tensor | None:
        """``col_perm`` as int64 on ``device``: the kernel reads ``x[..., col_perm]`` (``None``: the
        natural order, or folded into the producers)."""
        if self.col_perm is None or not self._gather_input:
            return None
        idx = self._in_index
        if idx is None or idx.device != device:
            idx = self._in_index = self.col_perm.to(device=device, dtype=torch.long)
        return idx

    def _output_index(self, device: torch.device) -> torch.Tensor | None:
        """``ỹ`` (rows of ``W̃``) -> the emitted order: original, or ``_emit`` when folded; ``None``
        when ``ỹ`` is already in it."""
        idx = self._out_index
        if idx is None:
            if self.row_perm is None and self._emit is None:
                return None
            inv = inverse_perm(self.row_perm.long()) if self.row_perm is not None else None
            if self._emit is None:
                idx = inv
            else:
                idx = self._emit if inv is None else inv[self._emit]
            self._out_index = idx
        if idx.device != device:
            idx = self._out_index = idx.to(device)
        return idx

    def _reset_runtime(self) -> None:
        self._emit: torch.Tensor | None = None  # folded: emit outputs in this order (original indices)
        self._out_index: torch.Tensor | None = None  # ỹ -> emitted order (derived, cached)
        self._in_index: torch.Tensor | None = None  # col_perm as int64 on the input's device
        self._gather_input = True
        self._wcache = None

    # -- what the kind means at load, save and inspect (see modules/sfmp_model.py) ---------------
    @classmethod
    def finish_model(cls, model, modules, arch) -> None:
        """The exact runtime folds of the saved permutations (gate/up -> down_proj)."""
        from .sfmp_model import fold_model_permutations

        fold_model_permutations(model, arch)

    @classmethod
    def saved_summary(cls, model, modules, run) -> dict:
        """``bits`` is ``None`` (no single width); ``sfmp``: what SFMP used (``run["sfmp"]``) and reached."""
        from .sfmp_model import saved_summary

        return saved_summary(model, run.get("sfmp"))

    @classmethod
    def describe_saved(cls, path, layer_cfgs, qc) -> tuple[list[str], dict]:
        """The budget and target the run had (when saved), the ``b`` reached and the bits per weight of
        the SFMP linears by part, measured from the stored tensors; per layer its average code bits."""
        from .sfmp_model import stored_summary

        s = stored_summary(path, layer_cfgs)
        if s is None:
            return [], {}
        saved = qc.get("sfmp") or {}
        widths = "/".join(str(w) for w in saved.get("candidate_widths") or s["widths_used"])
        target = ", ".join(f"{k} {v:g}" for k, v in (saved.get("budget") or {}).items())
        if "b_target" in saved:
            target += f"{', ' if target else ''}b target {saved['b_target']:.4f}"
        p = s["bits_per_weight_parts"]
        lines = [
            f"sfmp             b reached {s['b_reached']:.4f} ({target or 'target not saved'}), "
            f"widths {widths}, "
            f"group {'/'.join(map(str, s['group_sizes']))}, block {'/'.join(s['block_shapes'])}",
            f"sfmp bits/weight {s['bits_per_weight']:.4f} = weights {p['weights']:.4f} + scales/zeros "
            f"{p['scales_zeros']:.4f} + permutations {p['permutations']:.4f} + bit map {p['bit_map']:.4f}",
        ]
        return lines, {n: f"{b:.2f}" for n, b in s["per_linear_b"].items()}

    # -- export -------------------------------------------------------------------------------
    def int_form(self, allowed_bits, lossy, changes):
        """The weight in the original row and column order: rows un-permuted (exact), the column order
        kept as each column's group on ``W̃`` (``g_idx``, like act-order).  One width per layer: a layer
        whose blocks all share an allowed width is exact; mixed widths are refused, and with ``lossy``
        put on the widest needed grid (the same values: a wider grid holds a narrower one)."""
        zf = self.zeros.float()
        if not torch.equal(zf, zf.round()):
            raise NoIntForm("fractional zero-points (GPTQ and compressed-tensors store integer zeros)")
        K = self.in_features
        scales, zeros = self.scales.clone(), zf.to(torch.int64)
        if self.row_perm is not None:  # stored in W̃'s row order
            rp = self.row_perm.long()
            scales, zeros = torch.empty_like(scales), torch.empty_like(zeros)
            scales[rp], zeros[rp] = self.scales, zf.to(torch.int64)
        pos = inverse_perm(self.col_perm.long()) if self.col_perm is not None else torch.arange(K)
        g_idx = (pos // self.group_size).to(torch.int32)  # column j sits at W̃ column pos[j]
        codes = self._unpermute(self.codes_permuted()).to(torch.int64)
        values = codes - zeros.gather(1, g_idx.long().expand_as(codes))
        widths = sorted({int(b) for b in self.bit_map.unique()})
        bits = widest_fit(max(widths), allowed_bits)
        if len(widths) > 1 or widths[0] != bits:
            self._refuse_or_note(
                f"SFMP's block-wise bit widths {'/'.join(map(str, widths))}: the format stores one width "
                f"per layer of {'/'.join(map(str, allowed_bits))} bits (widened to {bits} bits, same values)",
                lossy,
                changes,
            )
            return embed(values, scales, g_idx, self.group_size, bits, False)
        codes, zeros = codes.to(torch.int32), zeros.to(torch.int32)
        return IntForm(codes, scales, zeros, g_idx, bits, self.group_size, False)

    # -- accounting ---------------------------------------------------------------------------
    def storage_tensors(self) -> list[torch.Tensor]:
        ts = (self.qweight, self.scales, self.zeros, self.bit_map, self.row_perm, self.col_perm)
        return [t for t in ts if t is not None]

    def part_bits(self) -> dict[str, int]:
        """Stored bits of each part: weights (codes), scales/zeros, permutations, bit map.  Read from
        the buffers' shapes and dtypes, so a released buffer is not rebuilt for it."""
        b = self._buffers
        return {
            "weights": storage_bits([b["qweight"]]),
            "scales_zeros": storage_bits([b["scales"], b["zeros"]]),
            "permutations": storage_bits([b["row_perm"], b["col_perm"]]),
            "bit_map": storage_bits([b["bit_map"]]),
        }

    def bits_breakdown(self) -> dict[str, float]:
        """Bits per weight of each stored part: weights, scales/zeros, permutations, bit map."""
        n = self.in_features * self.out_features
        return {k: v / n for k, v in self.part_bits().items()}

    def code_bits(self) -> float:
        """Average code width (the paper's ``b``) of this layer."""
        return self._plan().average_bits()

    def layer_config(self) -> dict:
        return self._config(
            group_size=self.group_size, block_rows=self.block_rows, block_cols=self.block_cols,
            row_reorder=self.row_reorder, col_reorder=self.col_reorder, nbytes=self.nbytes,
        )  # fmt: skip

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._reset_runtime()

    def extra_repr(self) -> str:
        blk = f"{self.block_rows}x{self.block_cols}"
        return f"{super().extra_repr()}, b={self.code_bits():.3f}, group={self.group_size}, block={blk}"


class _PermutedKernel:
    """The low-bit kernel on ``W̃`` with the input gathered by the column order and the output
    un-permuted (both inside the kernel call)."""

    def __init__(self, weight, module: SFMPLinear) -> None:
        self.weight, self.module = weight, module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module  # the gather and un-permutation run inside the kernel call
        return self.weight.matmul(x, in_index=m._input_index(x.device), out_index=m._output_index(x.device))

    def nbytes(self) -> int:
        return self.weight.nbytes()
