"""``MosaicQuantLinear`` (kind ``"mosaic"``): MosaicQuant's dense 4-bit base plus block-sparse 4-bit
residual (MosaicQuant §3 Eq. 4, §4.1).

Stored buffers (all saved, all counted in bits per weight):

* the dense base as a packed symmetric per-channel 4-bit :class:`QuantLinear` (``qweight`` uint8,
  ``scales`` fp16 ``[out, 1]``; zero-point 8 implied);
* ``res_index`` int32 ``[n_sel]``: selected blocks as ``row_block * n_col_blocks + col_block``,
  ascending;
* ``res_qweight`` uint8 ``[n_sel * bm, bk / 2]``: the residual codes ``+ 8`` packed at 4 bits (edge
  blocks are padded to the full ``bm x bk`` and the padding is counted);
* ``res_scales`` fp16 ``[n_sel, bm]``: one scale per output row within each block;
* ``res_columns`` int32 ``[k]`` (only for a channel selection, MosaicQuant §3 Observation 1's
  baseline): the residual is then stored as dense columns -- the blocks above tile the gathered
  ``[out, k]`` matrix ``W[:, res_columns]`` (all of them stored), so the column indices are the
  only extra bits.

Bits per weight = all those bits / (``in_features * out_features``), the weights of the
matrix; :meth:`MosaicQuantLinear.residual_overhead` is the residual's bits over the dense
base's bits (the paper's memory overhead, Fig. 6).

Forward with INT activations (the default on the CPU): the integers of ``Q(X)`` are multiplied by the
dense base and by the residual blocks in int32 (:class:`bitmosaic.kernels.mosaic.MosaicIntActWeight`).
Otherwise (FP
activations, ``$BITMOSAIC_ACT_COMPUTE=sim``, off the CPU) the input quantizer produces ``Q(X)`` in float
once, and the kernel multiplies it by the dense base and the residual blocks -- in one tiling pass for
prefill, and for decode (at most 8 rows) in two compiled passes (dense GEMV, then the residual
blocks accumulated into the same output) -- so the sparse branch uses the same quantized activations
(:mod:`bitmosaic.kernels.mosaic`).  On a CUDA device (``GPU_KERNELS``) both run in one Triton kernel,
ZipperEngine's fusion (§4.2): each output tile accumulates the dense base and the residual blocks of its
rows (:mod:`bitmosaic.kernels.triton.blockres`; issue 76).
"""

from __future__ import annotations

import torch

from ..algorithms.mosaic import MosaicResult, block_grid
from ..formats.packing import pack_codes, unpack_codes
from .qlinear import QuantLinear

__all__ = ["MosaicQuantLinear"]


class MosaicQuantLinear(QuantLinear):
    kind = "mosaic"
    KERNELS = ("lowbit",)  # the residual pass adds into LowBitWeight's GEMV and fused tiles
    # off the CPU: dense base and residual blocks in one Triton kernel (kernels/triton/blockres.py, issue 76)
    GPU_KERNELS = ("triton_blockres",)
    INT_ACT_KERNELS = ("int8act",)  # INT activations: dense base and residual blocks in integers
    CONFIG_KEYS = ("block_rows", "block_cols", "n_blocks", "n_columns")

    def __init__(
        self, in_features, out_features, *, block_rows: int, block_cols: int, n_blocks: int,
        n_columns: int = 0, **kw,
    ):  # fmt: skip
        super().__init__(in_features, out_features, **kw)
        if self.bits != 4 or not self.symmetric or self.group_size != in_features:
            raise ValueError("a mosaic layer's dense base is 4-bit symmetric per-channel")
        self.block_rows, self.block_cols = int(block_rows), int(block_cols)
        self.register_buffer("res_index", torch.zeros(n_blocks, dtype=torch.int32))
        cols = -(-self.block_cols // 8) * 4
        self.register_buffer("res_qweight", torch.zeros(n_blocks * self.block_rows, cols, dtype=torch.uint8))
        self.register_buffer("res_scales", torch.zeros(n_blocks, self.block_rows, dtype=torch.float16))
        # dense columns (a channel selection); absent otherwise, so older saved folds load unchanged
        if n_columns:
            self.register_buffer("res_columns", torch.zeros(int(n_columns), dtype=torch.int32))
        else:
            self.res_columns = None

    @classmethod
    def from_layer_config(cls, cfg: dict):
        return super().from_layer_config({"n_columns": 0, **cfg})

    @property
    def residual_width(self) -> int:
        """Input width of the residual's block grid: ``k`` gathered columns, or ``in_features``."""
        return self.in_features if self.res_columns is None else int(self.res_columns.numel())

    @property
    def block(self) -> tuple[int, int]:
        return self.block_rows, self.block_cols

    @classmethod
    def from_result(cls, res: MosaicResult, *, bias=None) -> MosaicQuantLinear:
        if not isinstance(res, MosaicResult):
            raise TypeError(f"expected a MosaicResult, got {type(res).__name__}")
        out = res.codes.shape[0]
        n = res.res_codes.shape[1]  # in_features, or the k gathered columns
        bm, bk = res.block
        dense = QuantLinear.from_result(res, bits=4, group_size=None, symmetric=True, bias=bias)
        nr, nc = block_grid((out, n), (bm, bk))
        idx = torch.nonzero(res.block_mask.reshape(-1).cpu()).reshape(-1)
        k = 0 if res.columns is None else int(res.columns.numel())
        m = cls._from_packed(dense, block_rows=bm, block_cols=bk, n_blocks=idx.numel(), n_columns=k)
        if k:
            m.res_columns.copy_(res.columns.cpu().to(torch.int32))
        codes = torch.nn.functional.pad(res.res_codes.cpu(), (0, nc * bk - n, 0, nr * bm - out))
        blocks = codes.reshape(nr, bm, nc, bk).permute(0, 2, 1, 3).reshape(nr * nc, bm, bk)[idx]
        scales = torch.nn.functional.pad(res.res_scales.cpu().float(), (0, 0, 0, nr * bm - out), value=1.0)
        bscales = scales.reshape(nr, bm, nc).permute(0, 2, 1).reshape(nr * nc, bm)[idx]
        m.res_index.copy_(idx.to(torch.int32))
        m.res_qweight.copy_(pack_codes((blocks + 8).reshape(-1, bk).to(torch.int32), 4))
        m.res_scales.copy_(bscales.to(torch.float16))
        return m

    # -- the residual -------------------------------------------------------------------------
    def residual_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Signed codes ``[n_sel, bm, bk]`` (int32) and float32 scales ``[n_sel, bm]``."""
        bm, bk = self.block
        c = unpack_codes(self.res_qweight, 4, bk) - 8
        return c.reshape(-1, bm, bk), self.res_scales.float()

    def residual_dense(self) -> torch.Tensor:
        """``M ⊙ Q(R)`` as float32 ``[out, in]`` (reference scatter of the stored blocks)."""
        bm, bk = self.block
        out, n = self.out_features, self.residual_width
        nr, nc = block_grid((out, n), self.block)
        c, s = self.residual_blocks()
        full = torch.zeros(nr * nc, bm, bk, device=c.device)
        full[self.res_index.long()] = c.float() * s[:, :, None]
        full = full.reshape(nr, nc, bm, bk).permute(0, 2, 1, 3).reshape(nr * bm, nc * bk)[:out, :n]
        if self.res_columns is None:
            return full.contiguous()
        dense = torch.zeros(out, self.in_features, device=c.device)
        dense[:, self.res_columns.long()] = full
        return dense

    def dequantize_reference(self, dtype=torch.float32):
        return super().dequantize_reference(dtype) + self.residual_dense().to(dtype)

    def _dequantize(self, dtype):
        return super()._dequantize(dtype) + self.residual_dense().to(dtype)

    def _build_kernel(self):
        from ..kernels.mosaic import MosaicColumnsWeight, MosaicWeight
        from ..kernels.select import offers_device, select_kernel

        device = self.scales.device.type
        if offers_device(self.GPU_KERNELS, device):  # the fused Triton kernel (issue 76, §4.2)
            kind = select_kernel(self.GPU_KERNELS, self.storage_bits, device=device, group_size=-1)
            return self._triton_kernel(kind)
        dense = super()._build_kernel()  # a LowBitKernel without permutation (no g_idx)
        c, s = self.residual_blocks()
        shape = (self.out_features, self.residual_width)
        if self.res_columns is not None:
            cols = self.res_columns
            return MosaicColumnsWeight(dense.weight, self.res_index, c, s, shape, self.block, cols)
        return MosaicWeight(dense.weight, self.res_index, c, s, shape, self.block)

    def _triton_kernel(self, kind):
        """The dense base (codes at their storage width, ``code_offset`` folded into the zero-point 8) and
        the residual blocks as ``kind``
        (:class:`~bitmosaic.kernels.triton.blockres.TritonBlockResidualWeight`)."""
        from ..kernels.triton.intmm import TritonIntWeight

        codes = unpack_codes(self.qweight, self.storage_bits, self.in_features)
        dense = TritonIntWeight.from_codes(codes, self.storage_bits, self.scales, 8.0 - self.code_offset, -1)
        c, s = self.residual_blocks()
        shape = (self.out_features, self.residual_width)
        return kind(dense, self.res_index, c, s, shape, self.block, self.res_columns)

    # -- integer activations (kernels/mosaic.py) ------------------------------------------------
    @staticmethod
    def _residual_blocker(spec, block_cols: int, channels: bool) -> str | None:
        """Why the residual blocks cannot run in integers with activation ``spec`` (``None``: they can)."""
        if block_cols % 8:
            return f"residual blocks of {block_cols} columns (the integer path needs a multiple of 8)"
        if spec is None or spec.granularity != "group":
            return None
        if channels:
            return "per-group activation scales on a residual of gathered columns"
        ag = spec.group_size
        if ag % block_cols and (block_cols % ag or ag % 8):
            return f"activation groups of {ag} neither hold nor split residual blocks of {block_cols} columns"
        return None

    def int_act_blocker(self) -> str | None:
        q = self.act_quantizer()
        spec = None if q is None else q.spec
        return super().int_act_blocker() or self._residual_blocker(
            spec, self.block_cols, self.res_columns is not None
        )

    @classmethod
    def act_compute(cls, cfg: dict) -> str:
        from ..formats.act import ActQuantSpec
        from .intact import act_path_label

        spec = ActQuantSpec.from_dict(cfg.get("act"))
        blocker = spec is not None and cls._residual_blocker(
            spec, int(cfg["block_cols"]), bool(cfg.get("n_columns"))
        )
        return act_path_label(blocker, spec) if blocker else super().act_compute(cfg)

    def _build_int_act(self):
        """The dense base's integer kernel with the residual row blocks beside it (kernels/mosaic.py)."""
        from ..kernels.mosaic import MosaicIntActWeight

        k = super()._build_int_act()
        if k is None:
            return None
        spec = self.act_quantizer().spec
        ag = spec.group_size if spec.granularity == "group" else None
        c, s = self.residual_blocks()
        shape = (self.out_features, self.residual_width)
        k.weight = MosaicIntActWeight.build(
            k.weight, self.res_index, c, s, shape, self.block, self.res_columns, ag
        )
        return k

    def _saved_from_kernel(self, k):
        """The dense base's buffers rebuild from the kernel's dense part (resident weights, see
        :mod:`bitmosaic.modules.base`); the residual blocks (about ``budget`` of the blocks) stay."""
        from .kernel import LowBitKernel

        return super()._saved_from_kernel(LowBitKernel(k.dense))

    # -- export -------------------------------------------------------------------------------
    def int_form(self, allowed_bits, lossy, changes):
        """The dense 4-bit base only: no format holds the block-sparse residual (dropped with ``lossy``)."""
        layer, values = self._packed_form()
        if self.res_index.numel():
            self._refuse_or_note(
                "MosaicQuant's block-sparse 4-bit residual: neither format holds a sparse residual (dropped)",
                lossy,
                changes,
            )
        return self._fit_grid(layer, values, allowed_bits, lossy, changes)

    # -- accounting ---------------------------------------------------------------------------
    def residual_tensors(self) -> list[torch.Tensor]:
        cols = [] if self.res_columns is None else [self.res_columns]
        return [self.res_index, self.res_qweight, self.res_scales, *cols]

    def storage_tensors(self):
        return super().storage_tensors() + self.residual_tensors()

    def residual_overhead(self) -> float:
        """Stored bits of the residual (indices, codes, scales) / stored bits of the dense base."""
        from ..formats.accounting import storage_bits

        return storage_bits(self.residual_tensors()) / storage_bits(super().storage_tensors())

    def layer_config(self) -> dict:
        return {
            **super().layer_config(),
            "block_rows": self.block_rows,
            "block_cols": self.block_cols,
            "n_blocks": int(self.res_index.numel()),
            **({} if self.res_columns is None else {"n_columns": int(self.res_columns.numel())}),
        }

    def extra_repr(self) -> str:
        nr, nc = block_grid((self.out_features, self.in_features), self.block)
        if self.res_columns is not None:
            return f"{super().extra_repr()}, residual on {self.res_columns.numel()} dense columns"
        return f"{super().extra_repr()}, residual {self.res_index.numel()}/{nr * nc} blocks of {self.block}"
