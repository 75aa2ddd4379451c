"""SFMP (Nie et al., "Search-free mixed precision"), the pure parts: reordering, blocks, the global
bit allocation, the bits budget and the mixed-width quantizers of the blocks.

* Reordering (§4.4, Eqs. 11-13): ``s_row = S·1``, ``s_col = Sᵀ·1``, each sorted descending
  (stable), ``W̃ = P_row W P_col`` i.e. ``W̃ = W[row_perm][:, col_perm]``; ``S`` is permuted the
  same way.  Quantization groups are formed on ``W̃`` (contiguous there), so no ``g_idx`` is kept.
* Blocks (§4.3, Eq. 8): ``W̃`` is cut into ``m_b x n_b`` blocks (the last row / column block may be
  partial); ``n_b`` is a multiple of the group size (the paper: ``n_b`` = group size).
* Allocation (Eqs. 5-10, Alg. 2): with target average *code* bits ``b``, the candidates are
  ``floor(b)`` and ``ceil(b)``; blocks of all linears are ranked in ONE global order and the top
  ones get ``ceil(b)`` until a fraction ``α = b - floor(b)`` of all weights has it.  The ranking
  is a sort, not an interpolated quantile.  ``rank="mean"`` (default) ranks by mean salience and
  fills a weight-count budget ``α·N`` (equal to the paper's sum ranking when all blocks have the
  same size; with partial blocks a sum would favour big blocks); ``rank="sum"`` is the paper's
  literal rule: block sums, top ``round(α·K)`` of the ``K`` blocks.
* Bits budget (§4.2): ``BPW = b + overhead``; the overhead is computed from the real storage of the
  chosen layout (fp16 scale + zero per row and group -- partial groups included --, the int16/int32
  permutation indices and the uint8 bit map), so ``--bpw`` and ``--budget-mb`` give the ``b`` that
  fills the budget exactly up to one block.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..formats.grid import IntGrid, dequantize_codes, quantize_codes
from ..formats.layout import default_g_idx, num_groups
from .awq import awq_clip_search
from .scales import find_scale_zero, range_scale_zero

__all__ = [
    "BlockPlan",
    "OneBitGrid",
    "width_grid",
    "reorder_perms",
    "inverse_perm",
    "index_dtype",
    "block_salience",
    "layout_overhead_bits",
    "bits_from_budget",
    "allocate_bits",
    "group_bits",
    "mixed_scale_zero",
    "mixed_clip_search",
    "mixed_codes",
    "MixedRowQuantizer",
]


@dataclass(frozen=True)
class OneBitGrid:
    """The 1-bit asymmetric grid (codes 0/1, fp16 scale and zero), for blocks when ``b < 2``."""

    bits: int = 1
    symmetric: bool = False
    maxq: int = 1


def width_grid(bits: int) -> IntGrid | OneBitGrid:
    """The asymmetric grid of a block width 1..8."""
    if not 1 <= int(bits) <= 8:
        raise ValueError(f"block widths must be in 1..8, got {bits}")
    return OneBitGrid() if bits == 1 else IntGrid(int(bits), False)


def index_dtype(n: int) -> torch.dtype:
    """int16 indices when they fit, else int32 (what the saved permutations use)."""
    return torch.int16 if n <= 32767 else torch.int32


def inverse_perm(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm, dtype=torch.long)
    inv[perm.long()] = torch.arange(perm.numel(), device=perm.device)
    return inv


def reorder_perms(S: torch.Tensor, rows: bool = True, cols: bool = True):
    """``(row_perm, col_perm)`` sorting row sums and column sums of ``S`` descending (Eqs. 11-12);
    ``None`` for a disabled direction.  Stable sort: equal sums keep their order."""
    S = S.float()
    rp = torch.sort(S.sum(1), descending=True, stable=True).indices if rows else None
    cp = torch.sort(S.sum(0), descending=True, stable=True).indices if cols else None
    return rp, cp


def permute(W: torch.Tensor, row_perm, col_perm) -> torch.Tensor:
    """``W̃ = W[row_perm][:, col_perm]`` (Eq. 13); a ``None`` permutation is the identity."""
    if row_perm is not None:
        W = W.index_select(0, row_perm.to(W.device).long())
    if col_perm is not None:
        W = W.index_select(1, col_perm.to(W.device).long())
    return W


@dataclass
class BlockPlan:
    """One linear's SFMP layout: permutations, block shape and the per-block widths ``bits``
    (``[n_rb, n_cb]`` uint8) of ``W̃``."""

    out_features: int
    in_features: int
    block_rows: int
    block_cols: int
    group_size: int
    row_perm: torch.Tensor | None
    col_perm: torch.Tensor | None
    bits: torch.Tensor | None = None

    @property
    def grid_shape(self) -> tuple[int, int]:
        return -(-self.out_features // self.block_rows), -(-self.in_features // self.block_cols)

    def block_counts(self) -> torch.Tensor:
        """Weights per block ``[n_rb, n_cb]`` (partial last row / column blocks are smaller)."""
        n_rb, n_cb = self.grid_shape
        r = torch.full((n_rb,), self.block_rows, dtype=torch.int64)
        r[-1] = self.out_features - (n_rb - 1) * self.block_rows
        c = torch.full((n_cb,), self.block_cols, dtype=torch.int64)
        c[-1] = self.in_features - (n_cb - 1) * self.block_cols
        return r[:, None] * c[None, :]

    def average_bits(self) -> float:
        return float((self.bits.long() * self.block_counts()).sum()) / (self.out_features * self.in_features)


def block_salience(S_perm: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """Sum of ``S̃`` over every ``block_rows x block_cols`` block (Eq. 9) -> ``[n_rb, n_cb]`` (float64)."""
    N, K = S_perm.shape
    n_rb, n_cb = -(-N // block_rows), -(-K // block_cols)
    pad = torch.nn.functional.pad(S_perm.double(), (0, n_cb * block_cols - K, 0, n_rb * block_rows - N))
    return pad.reshape(n_rb, block_rows, n_cb, block_cols).sum(dim=(1, 3))


def layout_overhead_bits(plan: BlockPlan) -> dict[str, int]:
    """Stored bits besides the codes: fp16 scale + zero per row and group, the permutations, the
    uint8 bit map (exactly the buffers :class:`~bitmosaic.modules.sfmp.SFMPLinear` stores)."""
    N, K = plan.out_features, plan.in_features
    G = num_groups(K, plan.group_size)
    perms = 0
    if plan.row_perm is not None:
        perms += N * torch.tensor([], dtype=index_dtype(N)).element_size() * 8
    if plan.col_perm is not None:
        perms += K * torch.tensor([], dtype=index_dtype(K)).element_size() * 8
    n_rb, n_cb = plan.grid_shape
    return {"scales_zeros": 2 * 16 * N * G, "permutations": perms, "bit_map": 8 * n_rb * n_cb}


def bits_from_budget(plans: Mapping[str, BlockPlan], *, avg_bits=None, bpw=None, budget_mb=None) -> dict:
    """The target average code width ``b`` from exactly one of ``avg_bits``, ``bpw`` (total stored
    bits per weight) or ``budget_mb`` (MiB of stored quantized linears), with the overhead measured
    on ``plans``.  Returns ``{"b", "overhead_bpw", "weights"}``."""
    given = [v is not None for v in (avg_bits, bpw, budget_mb)]
    if sum(given) != 1:
        raise ValueError("give exactly one of avg_bits (--avg-bits), bpw (--bpw) or budget_mb (--budget-mb)")
    n = sum(p.out_features * p.in_features for p in plans.values())
    over = sum(sum(layout_overhead_bits(p).values()) for p in plans.values())
    if avg_bits is not None:
        b = float(avg_bits)
    else:
        total = float(bpw) * n if bpw is not None else float(budget_mb) * 2**20 * 8
        b = (total - over) / n
    if not 1.0 <= b <= 8.0:
        raise ValueError(
            f"the budget leaves {b:.3f} code bits per weight after {over / n:.3f} bits of scales, "
            "permutations and bit map; SFMP needs 1..8: raise/lower the budget or use a larger group"
        )
    return {"b": b, "overhead_bpw": over / n, "weights": n}


def allocate_bits(
    saliences: Mapping[str, torch.Tensor], plans: Mapping[str, BlockPlan], b: float, rank: str = "mean"
) -> dict:
    """ONE global allocation over the blocks of every plan (Eq. 10): sets ``plan.bits`` in place.

    ``saliences[name]`` is the block sums ``[n_rb, n_cb]`` of that linear (:func:`block_salience`).
    ``rank="mean"``: blocks sorted by mean salience (descending; ties by position) take ``ceil(b)``
    while the count of high weights stays ``<= α·N``, stopping at the first block that would exceed
    it.  ``rank="sum"``: the paper's literal rule, top ``round(α·K)`` blocks by sum.
    Returns ``{"low", "high", "alpha", "high_weights", "b_reached"}``.
    """
    if rank not in ("mean", "sum"):
        raise ValueError(f"rank must be 'mean' or 'sum', got {rank!r}")
    lo = max(1, math.floor(b + 1e-12))
    alpha = b - lo
    hi = min(8, lo + 1) if alpha > 1e-12 else lo
    names = list(plans)
    counts = [plans[n].block_counts().reshape(-1) for n in names]
    sums = [saliences[n].double().reshape(-1) for n in names]
    cnt = torch.cat(counts).double()
    score = torch.cat(sums) if rank == "sum" else torch.cat(sums) / cnt
    order = torch.sort(score, descending=True, stable=True).indices
    total = float(cnt.sum())
    high = torch.zeros(cnt.numel(), dtype=torch.bool)
    if hi > lo:
        if rank == "sum":
            high[order[: int(round(alpha * cnt.numel()))]] = True
        else:
            csum = torch.cumsum(cnt[order], 0)
            k = int((csum <= alpha * total + 1e-6).sum())
            high[order[:k]] = True
    bits = torch.where(high, hi, lo).to(torch.uint8)
    start = 0
    for n, c in zip(names, counts, strict=True):
        plans[n].bits = bits[start : start + c.numel()].reshape(plans[n].grid_shape).clone()
        start += c.numel()
    n_high = float(cnt[high].sum())
    return {
        "low": lo,
        "high": hi,
        "alpha": alpha,
        "high_weights": int(n_high),
        "b_reached": (lo * total + (hi - lo) * n_high) / total,
    }


def group_bits(plan: BlockPlan) -> torch.Tensor:
    """Width of every (row, group) of ``W̃`` -> ``[out, G]`` int64 (blocks expanded)."""
    G = num_groups(plan.in_features, plan.group_size)
    gpb = plan.block_cols // plan.group_size
    per_rb = plan.bits.long().repeat_interleave(gpb, dim=1)[:, :G]
    return per_rb.repeat_interleave(plan.block_rows, dim=0)[: plan.out_features]


def _group_minmax(W: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    N, K = W.shape
    G = num_groups(K, group_size)
    idx = default_g_idx(K, group_size, device=W.device).expand(N, K)
    mn = W.new_zeros(N, G).scatter_reduce(1, idx, W, "amin", include_self=False)
    mx = W.new_zeros(N, G).scatter_reduce(1, idx, W, "amax", include_self=False)
    return mn, mx


def mixed_scale_zero(W: torch.Tensor, gbits: torch.Tensor, group_size: int):
    """Min-max fp16 scale/zero of every (row, group) of ``W`` (``[out, in]``, contiguous groups) on
    the grid of its width ``gbits`` (``[out, G]``) -> ``(scales, zeros)``, each ``[out, G]``."""
    mn, mx = _group_minmax(W, group_size)
    scales, zeros = torch.empty_like(mn), torch.empty_like(mn)
    for b in gbits.unique().tolist():
        s, z = range_scale_zero(mn, mx, width_grid(int(b)))
        sel = gbits == b
        scales[sel], zeros[sel] = s[sel], z[sel]
    return scales, zeros


def mixed_clip_search(W, H, gbits, group_size, n_grid=20, max_shrink=0.5):
    """AWQ's output-aware clip search (:func:`~bitmosaic.algorithms.awq.awq_clip_search`) with each
    (row, group) on its own width: the search is independent per (row, group), so running it once
    per width present and keeping each entry's own width is exact."""
    scales = W.new_empty(gbits.shape, dtype=torch.float64)
    zeros = torch.empty_like(scales)
    for b in gbits.unique().tolist():
        sel = gbits == b
        rows = sel.any(1).nonzero().flatten()
        s, z = awq_clip_search(W[rows], H, width_grid(int(b)), group_size, n_grid, max_shrink)
        sub = sel[rows]
        ss, zz = scales[rows], zeros[rows]
        ss[sub], zz[sub] = s.double()[sub], z.double()[sub]
        scales[rows], zeros[rows] = ss, zz
    return scales, zeros


def mixed_codes(W, scales, zeros, gbits, group_size) -> torch.Tensor:
    """Codes of ``W`` for per-(row, group) scales/zeros and widths (clipped to each width)."""
    g = default_g_idx(W.shape[1], group_size, device=W.device)
    maxq = ((1 << gbits) - 1).to(W.dtype)[:, g]
    q = torch.round(W / scales[:, g].to(W.dtype)) + zeros[:, g].to(W.dtype)
    return torch.minimum(q.clamp_(min=0), maxq)


def mixed_fake_quant(W: torch.Tensor, gbits: torch.Tensor, group_size: int) -> torch.Tensor:
    """Min-max RTN of ``W`` at the per-(row, group) widths, dequantized (the AWQ search's quantizer)."""
    s, z = mixed_scale_zero(W, gbits, group_size)
    g = default_g_idx(W.shape[1], group_size, device=W.device)
    q = mixed_codes(W, s, z, gbits, group_size)
    return dequantize_codes(q, s[:, g].to(W.dtype), z[:, g].to(W.dtype))


@dataclass(frozen=True)
class MixedRowQuantizer:
    """GPTQ's per-column step with a width per row (our extension: GPTQ on SFMP's bit map).

    ``for_group(k)`` (called by :func:`~bitmosaic.algorithms.gptq.gptq_quantize` once per group)
    returns the step of group ``k``, whose rows have widths ``gbits[:, k]``."""

    gbits: torch.Tensor  # [out, G]
    scale_method: str = "mse"

    def for_group(self, k: int) -> _RowWidths:
        return _RowWidths(self.gbits[:, k], self.scale_method)


@dataclass(frozen=True)
class _RowWidths:
    widths: torch.Tensor  # [out]
    scale_method: str

    def fit(self, cols: torch.Tensor):
        scale = cols.new_empty(cols.shape[0])
        zero = cols.new_empty(cols.shape[0])
        for b in self.widths.unique().tolist():
            sel = (self.widths == b).to(cols.device)
            s, z = find_scale_zero(cols[sel], width_grid(int(b)), self.scale_method)
            scale[sel], zero[sel] = s, z
        return scale, zero

    def quantize(self, w, scale, zero):
        maxq = ((1 << self.widths.to(w.device)) - 1).to(w.dtype)
        q = torch.minimum(quantize_codes(w, scale, zero, 255, clip=False).clamp_(min=0), maxq)
        return q, dequantize_codes(q, scale, zero)
