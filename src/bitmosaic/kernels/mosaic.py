"""CPU execution of MosaicQuant's dense 4-bit base plus its sparse 4-bit residual blocks.

``y = Q(X) (Q(W~) + M ⊙ Q(R))ᵀ`` where ``Q(X)`` is the (already fake-quantized) input.  The dense
base is a :class:`~bitmosaic.kernels.qmatmul.LowBitWeight` (only its public API is used:
``from_codes``, ``matmul``, ``dequantize``, ``nbytes``); the residual is kept as int8 codes
(transposed, ``[n_sel, bk, bm]`` with ``bm`` padded to 16; ``codes`` is a ``[n_sel, bm, bk]`` view)
with float32 scales ``[n_sel, bm]`` (the stored fp16 values) and block coordinates sorted by row
block.

Three paths, tested equal to the reference (within float32 summation order):

* :meth:`MosaicWeight.fused` -- ZipperEngine's idea (§4.2) on the CPU: one tiling pass over the
  output rows; each tile of the dense base is dequantized from its 4-bit codes, the selected
  residual blocks of those rows are dequantized *into the same tile*, and one product with the
  input tile accumulates both, so the quantized activations are read once per tile and there is
  no separate sparse pass or reduce-add.
* :meth:`MosaicWeight.decode` -- for at most ``DECODE_ROWS`` rows: the compiled dense GEMV
  (``LowBitWeight.matmul``), then a compiled residual pass (``csrc/mosaic.cpp``) that accumulates
  ``scale * (codes · x_block)`` of every selected block straight into that output buffer (codes held
  transposed, 16 rows of a column contiguous, so the accumulators stay in registers).  This is
  **two compiled passes over one output buffer, not one fused loop**: the few activation rows are
  read twice, but they stay in cache, and there is no gather, no float copy of the blocks and no
  separate add.  Row blocks are split across threads (the blocks of one row block go to one
  thread, so no write races); edge blocks skip the columns beyond ``K`` and rows beyond ``N``,
  which the torch path zero-pads and drops (same result).  The ISA is chosen per call like the other
  kernels' (:mod:`bitmosaic.kernels.isa`).  Without the extension (no compiler,
  ``BITMOSAIC_NO_EXT=1``) the residual pass is :meth:`sparse_only` added to the dense output.
* :meth:`MosaicWeight.three_step` -- the naive torch path: the dense product (the compiled low-bit
  GEMV/GEMM), then a separate sparse pass (:meth:`sparse_only`: index_select gather of the
  activations of every selected block, ``bmm``, ``index_add``), then an add.

:class:`MosaicColumnsWeight` is the channel baseline's residual stored as dense columns: the
residual blocks tile the gathered ``[N, k]`` matrix, so its one path is the dense product plus
:meth:`MosaicWeight.sparse_only` on the gathered activation columns ``x[:, columns]``.

``__call__`` uses :meth:`decode` for at most ``DECODE_ROWS`` rows, :meth:`three_step` below
``FUSED_MIN_ROWS`` and :meth:`fused` from there: measured on 2 cores (``benchmarks/mosaic/mosaic_kernel.py``,
4096-wide shapes), at 16 rows the three-step path costs +18..35% over the dense product and the
fused tiles +65..100%, at 512 rows three-step +25..59% and fused +3..11%; 128 sits between the two
measured points on a log scale.

:class:`MosaicIntActWeight` runs the same layer with **INT activations in integers** (MosaicQuant §3
Eq. 4 / §4.2 on :mod:`.intmm`'s kernel): the input is quantized once (the dense base's
:meth:`~bitmosaic.kernels.intmm.IntActWeight.quantize`, the simulated path's scales); the dense base is
one :class:`~bitmosaic.kernels.intmm.IntActWeight` product of those integers (zero-point 8, one scale
per row, or per activation group when those are finer, ``modules.intact.act_weight_groups``); the
residual blocks are grouped by row block, and the selected blocks of one row block become one small
integer weight ``[bm, n_blocks * bk]`` over the *gathered* int8 activation columns of those blocks
(codes ``+ 8`` at 4 bits, one weight group per block with its per-row scales; the channel residual
gathers its ``k`` columns the same way).  Every sum ``Σ c q`` is exact in int32 and scaled once, so the
output equals the simulated path up to float32 rounding.  It is not ZipperEngine's single fused pass:
the residual is one more kernel call per row block that holds selected blocks (which costs at decode,
not at prefill: ``benchmarks/mosaic/mosaic_kernel.py``).
"""

from __future__ import annotations

import torch

from . import build, ops, tiles
from .intmm import IntActWeight
from .intmm import extension as extension_int
from .isa import isa_number
from .ops import operator
from .qmatmul import LowBitWeight

__all__ = [
    "MosaicWeight",
    "MosaicColumnsWeight",
    "MosaicIntActWeight",
    "DECODE_ROWS",
    "extension",
    "mosaic_residual",
]

DECODE_ROWS = 8
FUSED_MIN_ROWS = 128


def extension():
    """The compiled residual pass, or ``None`` (no compiler, build failure, or ``BITMOSAIC_NO_EXT=1``)."""
    return build.load("mosaic")


@operator("mosaic_residual")
def mosaic_residual(
    x: torch.Tensor,
    codes_t: torch.Tensor,
    scales: torch.Tensor,
    cb: torch.Tensor,
    starts: torch.Tensor,
    y: torch.Tensor,
    bm: int,
) -> torch.Tensor:
    """The residual pass of :meth:`MosaicWeight.decode` as a ``torch.library`` operator (kernels/ops.py;
    MosaicQuant §4.2): ``y + x (M ⊙ Q(R))ᵀ`` as a new tensor (the extension accumulates in place into a
    copy of ``y``) for ``x [T <= 8, K]`` float32 and the transposed int8 codes ``[n_sel, bk, bmp]``.
    Needs the extension (without it ``decode`` adds :meth:`MosaicWeight.sparse_only`)."""
    ext = extension()
    if ext is None:
        raise RuntimeError("bitmosaic::mosaic_residual needs the compiled mosaic extension")
    out = y.contiguous().clone()
    ext.residual_accumulate(x.contiguous(), codes_t, scales, cb, starts, out, bm, isa_number(ext=ext))
    return out


@mosaic_residual.register_fake
def _(x, codes_t, scales, cb, starts, y, bm):
    return torch.empty_like(y, memory_format=torch.contiguous_format)


class MosaicWeight:
    def __init__(
        self,
        dense: LowBitWeight,
        index: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        shape: tuple[int, int],
        block: tuple[int, int],
    ) -> None:
        """``index``: ``[n_sel]`` flat block indices ``rb * n_col_blocks + cb``, ascending;
        ``codes``: ``[n_sel, bm, bk]`` signed integers; ``scales``: ``[n_sel, bm]``."""
        self.dense = dense
        self.N, self.K = shape
        self.bm, self.bk = block
        self.ncb = -(-self.K // self.bk)
        self.nrb = -(-self.N // self.bm)
        idx = index.to(torch.int64)
        if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise ValueError("residual block indices must be strictly ascending")
        self.rb, self.cb = idx // self.ncb, idx % self.ncb
        # stored transposed with rows padded to 16 (``codes_t [n_sel, bk, bmp]``, the compiled pass's
        # layout); ``codes`` is a ``[n_sel, bm, bk]`` view of it for the torch paths
        bmp = -(-self.bm // 16) * 16
        self.codes_t = torch.zeros(codes.shape[0], self.bk, bmp, dtype=torch.int8)
        self.codes_t[:, :, : self.bm] = codes.to(torch.int8).transpose(1, 2)
        self.codes = self.codes_t[:, :, : self.bm].transpose(1, 2)
        self.scales = scales.float().contiguous()
        # first selected block of every row block (blocks are sorted by row block)
        starts = torch.searchsorted(self.rb, torch.arange(self.nrb + 1))
        self.starts, self.starts_t = starts.tolist(), starts.to(torch.int64).contiguous()
        rows_per_tile = max(1, tiles.FUSED_TILE_ELEMS // max(self.K, 1) // self.bm) * self.bm
        self.tile_rows = rows_per_tile

    def nbytes(self) -> int:
        ts = (self.rb, self.cb, self.codes_t, self.scales)
        return self.dense.nbytes() + sum(t.numel() * t.element_size() for t in ts)

    def _values(self, lo: int, hi: int) -> torch.Tensor:
        """Residual blocks ``lo:hi`` dequantized, float32 ``[n, bm, bk]``."""
        return self.codes[lo:hi].float().mul_(self.scales[lo:hi, :, None])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(self.K, 1)
        if rows <= DECODE_ROWS:
            return self.decode(x)
        return self.three_step(x) if rows < FUSED_MIN_ROWS else self.fused(x)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """At most ``DECODE_ROWS`` rows: compiled dense GEMV, then the compiled residual pass
        accumulating into the same output (two passes over one buffer; module doc)."""
        x2 = x.reshape(-1, self.K).float().contiguous()
        if x2.shape[0] > DECODE_ROWS:
            raise ValueError(f"decode takes at most {DECODE_ROWS} rows, got {x2.shape[0]}; use fused")
        y = self.dense.matmul(x2).contiguous()
        ext = extension()
        if ext is None:
            y = y + self.sparse_only(x2)
        else:
            y = mosaic_residual(x2, self.codes_t, self.scales, self.cb, self.starts_t, y, self.bm)
        return y.reshape(*x.shape[:-1], self.N).to(x.dtype)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """One tiling pass: dense tile + residual blocks of its rows, one product per tile."""
        K, bm, bk = self.K, self.bm, self.bk
        x2 = x.reshape(-1, K).float()
        Kp = self.ncb * bk
        xp = x2 if Kp == K else torch.nn.functional.pad(x2, (0, Kp - K))
        y = torch.empty(x2.shape[0], self.N, dtype=torch.float32)
        for r0 in range(0, self.N, self.tile_rows):
            r1 = min(self.N, r0 + self.tile_rows)
            rb0, rb1 = r0 // bm, -(-r1 // bm)
            lo, hi = self.starts[rb0], self.starts[rb1]
            tile = self.dense.dequantize(slice(r0, r1))
            if hi > lo:
                padded = (rb1 - rb0) * bm != r1 - r0 or Kp != K
                if padded:
                    buf = torch.zeros((rb1 - rb0) * bm, Kp)
                    buf[: r1 - r0, :K] = tile
                    tile = buf
                view = tile.view(rb1 - rb0, bm, self.ncb, bk).permute(0, 2, 1, 3)
                view[self.rb[lo:hi] - rb0, self.cb[lo:hi]] += self._values(lo, hi)
                torch.mm(xp, tile[: r1 - r0].T, out=y[:, r0:r1])
            else:
                torch.mm(x2, tile.T, out=y[:, r0:r1])
        return y.reshape(*x.shape[:-1], self.N).to(x.dtype)

    def sparse_only(self, x: torch.Tensor) -> torch.Tensor:
        """The residual branch alone, ``x (M ⊙ Q(R))ᵀ`` (gathers the activations of every block)."""
        x2 = x.reshape(-1, self.K).float()
        T = x2.shape[0]
        Kp = self.ncb * self.bk
        xp = x2 if Kp == self.K else torch.nn.functional.pad(x2, (0, Kp - self.K))
        ys = torch.zeros(T, self.nrb, self.bm)
        if self.codes.shape[0]:
            xb = xp.view(T, self.ncb, self.bk).index_select(1, self.cb)  # [T, n_sel, bk]
            part = torch.bmm(xb.transpose(0, 1), self._values(0, self.codes.shape[0]).transpose(1, 2))
            ys.index_add_(1, self.rb, part.transpose(0, 1))  # [T, n_sel, bm] into row blocks
        return ys.reshape(T, -1)[:, : self.N]

    def three_step(self, x: torch.Tensor) -> torch.Tensor:
        """Dense low-bit product, then a separate sparse pass, then the add."""
        yd = self.dense.matmul(x.reshape(-1, self.K).float())
        y = yd + self.sparse_only(x)
        return y.reshape(*x.shape[:-1], self.N).to(x.dtype)

    def dense_only(self, x: torch.Tensor) -> torch.Tensor:
        """The dense base alone (the baseline the overhead is measured against)."""
        return self.dense.matmul(x)


class MosaicColumnsWeight(MosaicWeight):
    """The residual on ``k`` gathered input columns (a channel selection, stored as dense columns):
    ``y = Q(X) Q(W~)ᵀ + Q(X)[:, columns] (Q(R)[:, columns])ᵀ``.  ``shape`` is the gathered
    ``(N, k)``; every path is the three-step one (a baseline, not a fused kernel)."""

    def __init__(self, dense, index, codes, scales, shape, block, columns: torch.Tensor) -> None:
        super().__init__(dense, index, codes, scales, shape, block)
        self.columns = columns.to(torch.int64)
        self.K_in = int(dense.K)

    def nbytes(self) -> int:
        return super().nbytes() + self.columns.numel() * self.columns.element_size()

    def three_step(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.K_in).float()
        y = self.dense.matmul(x2) + self.sparse_only(x2.index_select(1, self.columns))
        return y.reshape(*x.shape[:-1], self.N).to(x.dtype)

    __call__ = fused = decode = three_step


class MosaicIntActWeight:
    """MosaicQuant with INT activations in integers (module doc): the dense base and the residual row
    blocks as integer weights; :meth:`matmul` has :meth:`IntActWeight.matmul`'s interface (so
    :class:`~bitmosaic.modules.intact.IntActKernel` runs it)."""

    def __init__(self, dense, parts, cb, columns, bk, act_groups) -> None:
        """``parts``: ``(r0, r1, weight, s0, s1)`` per row block: its output rows, its integer weight and
        its blocks ``s0:s1`` of ``cb`` (the column block of every selected block, in row-block order);
        ``columns``: the input column of each residual column (``None``: the natural ones; ``K``: a zero
        column, padding); ``act_groups``: per residual weight group, the activation scale column that
        covers it (``None``: per token or tensor).  The parts' layouts are views of one table each
        (``rdata``/``rsc``/``rzc``), which the compiled call reads with ``parts_table``."""
        self.dense, self.parts, self.cb, self.columns = dense, parts, cb, columns
        self.bk, self.act_groups = bk, act_groups
        self.N, self.K = dense.N, dense.K
        self.ncb = -(-(self.K if columns is None else columns.numel()) // bk)
        self.gs = parts[0][2].group_size if parts else bk
        tables = []
        for name in ("data", "sc", "zc"):
            flat = (
                torch.cat([getattr(w, name).reshape(-1) for _, _, w, _, _ in parts])
                if parts
                else torch.zeros(0)
            )
            off = 0
            for _, _, w, _, _ in parts:  # each part's table becomes a view of the joint one
                t = getattr(w, name)
                setattr(w, name, flat[off : off + t.numel()].view(t.shape))
                off += t.numel()
            tables.append(flat)
        self.rdata, self.rsc, self.rzc = tables
        per = bk // self.gs
        rows = [(r0, r1 - r0, s0 * bk // 8, (s1 - s0) * bk, s0 * per, w.G) for r0, r1, w, s0, s1 in parts]
        self.parts_table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 6)
        # the residual columns each pair of 8 reads (in the [M, ncb * bk] activations), and each residual
        # group's column group there (for its sum of q)
        self.pair_cols = (cb[:, None] * bk + torch.arange(0, bk, 8)).reshape(-1).to(torch.int32)
        self.group_cols = (cb[:, None] * per + torch.arange(per)).reshape(-1)

    @classmethod
    def build(
        cls,
        dense: IntActWeight,
        index: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        shape: tuple[int, int],
        block: tuple[int, int],
        columns: torch.Tensor | None = None,
        act_group: int | None = None,
    ) -> MosaicIntActWeight:
        """From the residual as :class:`MosaicWeight` takes it: flat ascending block ``index``
        (``rb * n_col_blocks + cb``), signed ``codes [n_sel, bm, bk]``, ``scales [n_sel, bm]``, the
        residual grid's ``shape (N, K or k)``, ``block (bm, bk)``, the gathered ``columns`` (channel
        residual), and the activation group width of a per-group quantizer (``None``: per token or
        tensor; finer than ``bk``: each block's weight group splits into groups of that width)."""
        N, Kr = shape
        bm, bk = block
        ncb = -(-Kr // bk)
        idx = index.to(torch.int64)
        rb, cb = idx // ncb, idx % ncb
        gs = bk if act_group is None or act_group >= bk else int(act_group)
        parts = []
        for r in torch.unique(rb).tolist():
            sel = (rb == r).nonzero().reshape(-1)
            r0, r1 = r * bm, min(N, (r + 1) * bm)
            c = codes[sel, : r1 - r0].permute(1, 0, 2).reshape(r1 - r0, -1) + 8  # [rows, nb * bk]
            s = scales[sel, : r1 - r0].T.float().repeat_interleave(bk // gs, dim=1)
            w = IntActWeight.from_codes(c.to(torch.int32), 4, s, 8.0, gs)
            parts.append((r0, r1, w, int(sel[0]), int(sel[-1]) + 1))
        cols = None
        if columns is not None:  # the channel residual: its columns, padded to whole blocks with column K
            cols = torch.nn.functional.pad(columns.to(torch.int64), (0, ncb * bk - Kr), value=dense.K)
        groups = None
        if act_group is not None:  # the scale column of each group's first column (padding: the last)
            first = (cb[:, None] * bk + torch.arange(0, bk, gs)).reshape(-1).clamp(max=dense.K - 1)
            groups = torch.div(first, act_group, rounding_mode="floor")
        return cls(dense, parts, cb, cols, bk, groups)

    def nbytes(self) -> int:
        extra = sum(w.nbytes() for _, _, w, _, _ in self.parts) + 8 * self.cb.numel()
        return self.dense.nbytes() + extra + (0 if self.columns is None else 8 * self.columns.numel())

    def matmul(self, x: torch.Tensor, act_scale, act_group: int, qmax: float) -> torch.Tensor:
        """``x [..., K]`` -> ``[..., N]``: the input quantized once, the dense product, then each row
        block's residual product on its blocks' integers (gathered a block at a time); arguments as
        :meth:`IntActWeight.matmul`."""
        d = self.dense
        q, qsum, sa, ratio = d.quantized(x, act_scale, act_group, qmax)
        if not self.parts:
            return d.product(q, qsum, sa, ratio).reshape(*x.shape[:-1], self.N).to(x.dtype)
        M, width = q.shape[0], self.ncb * self.bk
        if self.columns is not None:  # gather the channel residual's columns once (column K: zero)
            rq = torch.nn.functional.pad(q[:, : self.K], (0, 1)).index_select(1, self.columns)
        else:  # the blocks read q in place (zero columns past K where the last block is wider)
            rq = q if q.shape[1] == width else torch.nn.functional.pad(q[:, : self.K], (0, width - self.K))
        rqs = rq.view(M, -1, self.gs).sum(-1, dtype=torch.int32).index_select(1, self.group_cols)
        rsa = sa
        if self.act_groups is not None and sa.shape[1] > 1:  # per activation group
            rsa = sa.index_select(1, self.act_groups)
        if extension_int() is not None:
            y = ops.int_matmul_parts(
                q, qsum, sa, ratio, d.data, d.sc, d.zc, d.N, d.G, d.group_size,
                rq, rqs, rsa.contiguous(), self.rdata, self.rsc, self.rzc, self.parts_table, self.pair_cols,
                self.gs,
            )  # fmt: skip
        else:  # torch._int_mm per part on its gathered columns (the same integers)
            y = d.product(q, qsum, sa, ratio)
            per = self.bk // self.gs
            for r0, r1, w, s0, s1 in self.parts:
                cols = (
                    self.pair_cols[s0 * self.bk // 8 : s1 * self.bk // 8, None] + torch.arange(8)
                ).reshape(-1)
                groups = slice(s0 * per, s1 * per)
                sg, rg = (rsa, w.G) if rsa.shape[1] == 1 else (rsa[:, groups], 1)
                y[:, r0:r1] += w.product(rq.index_select(1, cols.long()), rqs[:, groups].contiguous(), sg, rg)
        return y.reshape(*x.shape[:-1], self.N).to(x.dtype)
