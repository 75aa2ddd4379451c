"""MosaicQuant (inlier-outlier disaggregation) as pure tensor functions.

The (smoothed) weight ``W~`` is represented as a dense 4-bit base plus a sparse 4-bit residual on
a few blocks (MosaicQuant §3 Eq. 4, Alg. 1):

    W^ = Q(W~) + M ⊙ Q(R),    R = W~ - Q(W~).

- Dense base (Eq. 1-2): per-output-channel symmetric absmax 4-bit, ``s = absmax / 7`` (stored
  fp16, rounded up so nothing clips), codes ``round(W~ / s)`` in ``[-8, 7]``.  A clip-search
  variant shrinks each row's range to minimise ``sum_j H_jj (w_j - q_j)^2``; a GPTQ base
  (our extension, not the paper's: ``R`` is then no longer bounded by ``s/2``) is built by the
  method layer from :func:`bitmosaic.algorithms.gptq.gptq_quantize` on the same grid.
- Residual candidate ``Q(R)``: 4-bit symmetric absmax per block with one fp16 scale per output
  row within the block (codes in ``[-7, 7]``).
- Δ-Hessian score (§4.1, App. A): ``Δ_b = max(0, Σ_{(i,j)∈b} H_jj [R_ij² - (R_ij - Q(R)_ij)²])``.
  Top-K blocks per matrix, ``K = ceil(budget · #blocks)``; zero-score blocks are omitted, so
  fewer than K may be chosen.  This is the optimum of the diagonal-Hessian surrogate
  (Theorem 4.1); :func:`global_topk` allocates one budget across several matrices (extension).
- Exact objective (Eq. 5-6): ``ΔD(S) = ||R Xᵀ||² - ||(R - M_S ⊙ Q(R)) Xᵀ||²``, computed as
  ``tr(R H Rᵀ) - tr(E H Eᵀ)`` with ``H = XᵀX`` (any positive multiple of it: fractions and
  rankings do not change).

Blocks are ``bm x bk`` (rows x input columns), default 64x64; partial edge blocks are allowed.
Selection criteria for the ablations (§3, Fig. 2b, §5.4): ``magnitude`` (block ``||W~||_F``),
``residual-norm`` (block ``||R||_F``), ``random`` (seeded), ``oracle`` (the exact greedy
output-distortion oracle of §3, incremental, exact for any layer size), ``none`` (no sparse
branch) and two channel-level baselines (§3 Observation 1, Fig. 5 "w/ Channel Compensation") that
compensate whole input columns at the same element budget (``round(K · bm · bk / out)`` columns):

- ``channel-act``: the paper's naive strategy -- the outlier channels, ranked by the activation
  maximum ``max|X_j|`` of the float (unsmoothed) input (Atom / AWQ's outlier channels, §2);
- ``channel``: ours, stronger -- columns ranked by the column-summed Δ-Hessian score (computed with
  the block quantizer's ``Q(R)``).

A channel residual is stored as **dense columns**: the chosen columns are gathered into an
``[out, k]`` matrix (``columns``, ascending) whose residual is quantized as one block layout over
the gathered matrix (one scale per output row per column block of about ``bk`` gathered columns:
:func:`column_block_width`; every block kept), so its bits per weight count the codes, scales,
block and column indices and nothing else.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from ..formats.block_grid import block_grid, block_reduce, expand_blocks, parse_block
from ..formats.grid import IntGrid, fp16_ceil
from ..formats.layout import default_g_idx
from .gptq import gptq_quantize
from .types import QuantResult

__all__ = [
    "SELECTIONS",
    "COLUMN_SELECTIONS",
    "channel_count",
    "column_block_width",
    "parse_block",
    "block_grid",
    "block_reduce",
    "expand_blocks",
    "dense_base",
    "residual_quant",
    "delta_hessian_scores",
    "topk_blocks",
    "global_topk",
    "greedy_oracle",
    "select",
    "distortion",
    "delta_distortion",
    "MosaicResult",
    "mosaic_decompose",
    "mosaic_decompose_gptq",
]

SELECTIONS = (
    "delta-hessian", "magnitude", "residual-norm", "random", "channel", "channel-act", "oracle", "none"
)  # fmt: skip
COLUMN_SELECTIONS = ("channel", "channel-act")  # whole input columns, stored as dense columns
_MIN_SCALE = 2.0**-24


def _row_block_amax(M: torch.Tensor, bk: int) -> torch.Tensor:
    """Per row and column block ``max |M|`` -> ``[out, nc]``."""
    nc = -(-M.shape[1] // bk)
    P = torch.nn.functional.pad(M.abs(), (0, nc * bk - M.shape[1]))
    return P.reshape(M.shape[0], nc, bk).amax(-1)


def dense_base(
    W: torch.Tensor,
    bits: int = 4,
    *,
    clip_search: bool = False,
    hdiag: torch.Tensor | None = None,
    grid: int = 20,
    max_shrink: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel symmetric absmax quantization (Eq. 1): ``(codes [out, in] int32 in
    [-2^(b-1), 2^(b-1)-1], scales [out] float32, fp16-exact)``.

    ``scale = fp16_ceil(absmax / (2^(b-1)-1))``, so ``|W / scale| <= qmax``: no weight clips.
    ``clip_search`` tries ``p = 1, 1 - 1/grid, ..., 1 - max_shrink`` times the absmax per row and
    keeps the one with the smallest ``Σ_j h_j (w_j - q_j)^2`` (``h = hdiag``, or 1).
    """
    qmax = (1 << (bits - 1)) - 1
    Wf = W.float()
    amax = Wf.abs().amax(1)

    def quant(a: torch.Tensor):
        s = fp16_ceil((a / qmax).clamp(min=_MIN_SCALE))
        c = torch.round(Wf / s[:, None]).clamp_(-qmax - 1, qmax)
        return c, s

    codes, scale = quant(amax)
    if clip_search:
        h = torch.ones(W.shape[1], device=W.device) if hdiag is None else hdiag.float().to(W.device)
        best = ((Wf - codes * scale[:, None]).pow(2) * h).sum(1)
        for i in range(1, int(max_shrink * grid) + 1):
            c, s = quant(amax * (1 - i / grid))
            err = ((Wf - c * s[:, None]).pow(2) * h).sum(1)
            better = err < best
            best = torch.where(better, err, best)
            codes = torch.where(better[:, None], c, codes)
            scale = torch.where(better, s, scale)
    return codes.to(torch.int32), scale


def residual_quant(
    R: torch.Tensor, block: tuple[int, int], bits: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate compensation ``Q(R)``: symmetric absmax, one fp16 scale per output row within each
    block -> ``(codes [out, in] int32 in [-qmax, qmax], scales [out, col blocks] float32)``."""
    qmax = (1 << (bits - 1)) - 1
    bk = block[1]
    t = fp16_ceil((_row_block_amax(R.float(), bk) / qmax).clamp(min=_MIN_SCALE))
    te = t.repeat_interleave(bk, 1)[:, : R.shape[1]]
    codes = torch.round(R.float() / te).clamp_(-qmax, qmax)
    return codes.to(torch.int32), t


def residual_values(codes: torch.Tensor, scales: torch.Tensor, bk: int) -> torch.Tensor:
    """``Q(R)`` as float32 ``[out, in]`` (exact: small integers times fp16 scales)."""
    return codes.float() * scales.repeat_interleave(bk, 1)[:, : codes.shape[1]]


def delta_hessian_scores(
    R: torch.Tensor, QR: torch.Tensor, hdiag: torch.Tensor, block: tuple[int, int], clip: bool = True
) -> torch.Tensor:
    """Δ-Hessian score per block (§4.1): ``Σ_b H_jj [R² - (R - Q(R))²]``, ``max(0, ·)`` when
    ``clip`` -> ``[row blocks, col blocks]`` float64."""
    R64, Q64 = R.double(), QR.double()
    gain = (R64.pow(2) - (R64 - Q64).pow(2)) * hdiag.double().to(R.device)[None, :]
    s = block_reduce(gain, block)
    return s.clamp(min=0) if clip else s


def _budget_count(budget: float, n: int) -> int:
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"budget must be a fraction in [0, 1], got {budget}")
    return min(n, math.ceil(budget * n - 1e-9))


def topk_blocks(scores: torch.Tensor, budget: float, positive_only: bool = True) -> torch.Tensor:
    """Top ``K = ceil(budget · #blocks)`` blocks by score (ties: lower index first) -> bool mask;
    with ``positive_only`` blocks of score ``<= 0`` are omitted (Alg. 1)."""
    k = _budget_count(budget, scores.numel())
    flat = scores.reshape(-1)
    order = torch.sort(flat, descending=True, stable=True).indices[:k]
    if positive_only:
        order = order[flat[order] > 0]
    mask = torch.zeros(flat.numel(), dtype=torch.bool, device=scores.device)
    mask[order] = True
    return mask.reshape(scores.shape)


def global_topk(scores: list[torch.Tensor], budget: float) -> list[torch.Tensor]:
    """One budget over several matrices (extension): ``K = ceil(budget · Σ #blocks)`` blocks with
    the largest positive scores among all of them -> one mask per matrix."""
    flat = torch.cat([s.reshape(-1).double().cpu() for s in scores])
    mask = topk_blocks(flat, budget)
    out, pos = [], 0
    for s in scores:
        out.append(mask[pos : pos + s.numel()].reshape(s.shape).to(s.device))
        pos += s.numel()
    return out


def greedy_oracle(
    R: torch.Tensor, QR: torch.Tensor, H: torch.Tensor, block: tuple[int, int], budget: float
) -> torch.Tensor:
    """The exact greedy output-distortion oracle (§3): repeatedly add the block with the largest
    marginal gain in ``ΔD``; stops at ``K`` blocks or when no block gains.  Incremental: with
    ``G = E H`` the gain of block ``b`` (rows I, columns J, ``C = Q(R)_IJ``) is
    ``2 <C, G_IJ> - Σ_i C_i H_JJ C_iᵀ``, and adding it updates ``G_I -= C H_J``."""
    out, n = R.shape
    nr, nc = block_grid((out, n), block)
    bm, bk = block
    E = R.double()
    Q = QR.double()
    H64 = H.double().to(R.device)
    G = E @ H64
    own = torch.zeros(nr, nc, dtype=torch.float64)
    for c in range(nc):
        J = slice(c * bk, min(n, (c + 1) * bk))
        QH = Q[:, J] @ H64[J, J]
        own[:, c] = block_reduce((QH * Q[:, J]), (bm, QH.shape[1]))[:, 0]
    chosen = torch.zeros(nr, nc, dtype=torch.bool)
    for _ in range(_budget_count(budget, nr * nc)):
        gain = 2 * block_reduce(Q * G, block).cpu() - own
        gain[chosen] = -math.inf
        best = int(torch.argmax(gain))
        if not gain.reshape(-1)[best] > 0:
            break
        r, c = divmod(best, nc)
        I, J = slice(r * bm, min(out, (r + 1) * bm)), slice(c * bk, min(n, (c + 1) * bk))
        G[I] -= Q[I, J] @ H64[J]
        chosen[r, c] = True
    return chosen.to(R.device)


def distortion(E: torch.Tensor, H: torch.Tensor) -> float:
    """``tr(E H Eᵀ)`` (= ``||E Xᵀ||²`` for ``H = XᵀX``), float64."""
    E64 = E.double()
    return float(((E64 @ H.double().to(E.device)) * E64).sum())


def delta_distortion(R: torch.Tensor, QR: torch.Tensor, mask: torch.Tensor, H: torch.Tensor) -> float:
    """Exact ``ΔD(S) = tr(R H Rᵀ) - tr(E H Eᵀ)``, ``E = R - M ⊙ Q(R)`` (Eq. 5); element ``mask``."""
    return distortion(R, H) - distortion(R.double() - mask.double() * QR.double(), H)


def channel_count(budget: float, shape: tuple[int, int], block: tuple[int, int]) -> int:
    """Input columns with as many elements as ``K = ceil(budget · #blocks)`` blocks of ``block``."""
    nr, nc = block_grid(shape, block)
    k_blocks = _budget_count(budget, nr * nc)
    return min(shape[1], round(k_blocks * block[0] * block[1] / shape[0]))


def column_block_width(k: int, bk: int) -> int:
    """Block width for ``k`` gathered columns: as many column blocks as ``bk`` gives
    (``ceil(k / bk)``), evenly wide and rounded up to 8 (the packing's unit), so at most
    ``8 · ceil(k / bk) - 1`` padded columns are stored instead of up to ``bk - 1``."""
    nb = max(1, -(-k // bk))
    return max(8, -(-k // (8 * nb)) * 8)


def select(
    selection: str,
    *,
    W: torch.Tensor,
    R: torch.Tensor,
    QR: torch.Tensor,
    hdiag: torch.Tensor | None,
    H: torch.Tensor | None,
    block: tuple[int, int],
    budget: float,
    seed: int = 0,
    act_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """The element mask ``M [out, in]`` (bool) a selection criterion picks at ``budget``
    (``act_amax``: the float input's ``max|X_j|`` per input channel, for ``channel-act``)."""
    shape = tuple(W.shape)
    nr, nc = block_grid(shape, block)
    if selection == "none" or budget == 0:
        return torch.zeros(shape, dtype=torch.bool, device=W.device)
    if selection in ("delta-hessian", "channel") and hdiag is None:
        raise ValueError(f"selection {selection!r} needs the Hessian diagonal")
    if selection == "delta-hessian":
        bm = topk_blocks(delta_hessian_scores(R, QR, hdiag, block), budget)
    elif selection == "magnitude":
        bm = topk_blocks(block_reduce(W.double().pow(2), block), budget, positive_only=False)
    elif selection == "residual-norm":
        bm = topk_blocks(block_reduce(R.double().pow(2), block), budget, positive_only=False)
    elif selection == "random":
        g = torch.Generator().manual_seed(seed)
        bm = topk_blocks(torch.rand(nr, nc, generator=g, dtype=torch.float64), budget, positive_only=False)
    elif selection == "oracle":
        if H is None:
            raise ValueError("selection 'oracle' needs the full Hessian")
        bm = greedy_oracle(R, QR, H, block, budget)
    elif selection in COLUMN_SELECTIONS:
        if selection == "channel":
            score = delta_hessian_scores(R, QR, hdiag, (shape[0], 1))[0]
        elif act_amax is None or act_amax.numel() != shape[1]:
            raise ValueError(f"selection 'channel-act' needs the input's max|X_j| for {shape[1]} channels")
        else:
            score = act_amax.double().cpu()
        n_cols = channel_count(budget, shape, block)
        frac = n_cols / shape[1] if shape[1] else 0.0
        cols = topk_blocks(score[None, :], frac, positive_only=selection == "channel")[0]
        return cols[None, :].expand(shape).clone().to(W.device)
    else:
        raise ValueError(f"unknown selection {selection!r}; choose from {SELECTIONS}")
    return expand_blocks(bm.to(W.device), shape, block)


@dataclass
class MosaicResult(QuantResult):
    """A :class:`QuantResult` whose ``codes``/``scales`` are the dense base (unsigned codes, zero 8,
    per channel) and whose ``sparse`` is the dense view of ``M ⊙ Q(R)``; the compressed residual
    is ``res_codes`` (signed, zero outside the mask) with ``res_scales [out, col blocks]`` on
    the blocks of ``block_mask``.  With ``columns`` (a channel selection) the residual lives on the
    gathered matrix ``W[:, columns]``: ``res_codes [out, k]``, ``res_scales`` and ``block_mask``
    are over its block grid (every block kept: dense columns)."""

    block: tuple[int, int] = (64, 64)
    block_mask: torch.Tensor | None = None  # [row blocks, col blocks] bool: the stored blocks
    res_codes: torch.Tensor | None = None  # [out, in | k] int32 in [-7, 7], 0 outside the element mask
    res_scales: torch.Tensor | None = None  # [out, col blocks] float32 (fp16-exact)
    columns: torch.Tensor | None = None  # [k] int64 ascending: the gathered input columns, or None
    residual: torch.Tensor | None = field(default=None, repr=False)  # R (float32), for reports


def mosaic_decompose(
    W: torch.Tensor,
    H: torch.Tensor | None,
    *,
    budget: float = 0.1,
    block=(64, 64),
    selection: str = "delta-hessian",
    clip_search: bool = False,
    base_codes: torch.Tensor | None = None,
    base_scales: torch.Tensor | None = None,
    seed: int = 0,
    hdiag: torch.Tensor | None = None,
    report: bool = True,
    act_amax: torch.Tensor | None = None,
) -> MosaicResult:
    """Alg. 1: dense base, residual, scores, selection, ``Ŵ = Q(W~) + M ⊙ Q(R)``.

    ``H``: ``[in, in]`` Hessian of the smoothed float inputs (any positive multiple of ``XᵀX``);
    only its diagonal is used unless ``selection="oracle"`` or ``report``.  ``hdiag`` may replace
    ``H`` when only the diagonal is needed.  ``base_codes``/``base_scales`` (signed codes, per-row
    scales) replace the absmax base (the GPTQ-base extension).  With ``report`` the exact ``ΔD``,
    ``tr(R H Rᵀ)`` and the recovered fraction go into ``info``.  ``act_amax``: ``max|X_j|`` of the
    float input (``selection="channel-act"``).  A channel selection stores its columns densely
    (module doc): ``Q(R)`` of the chosen columns is re-quantized on the gathered matrix.
    """
    block = parse_block(block)
    Wf = W.float()
    if hdiag is None and H is not None:
        hdiag = torch.diagonal(H).float()
    if base_codes is None:
        base_codes, base_scales = dense_base(Wf, clip_search=clip_search, hdiag=hdiag)
    assert base_scales is not None
    Qbase = base_codes.float() * base_scales[:, None]
    R = Wf - Qbase
    rc, rs = residual_quant(R, block)
    QR = residual_values(rc, rs, block[1])
    M = select(selection, W=Wf, R=R, QR=QR, hdiag=hdiag, H=H, block=block, budget=budget, seed=seed,
               act_amax=act_amax)  # fmt: skip
    out, n = W.shape
    if selection in COLUMN_SELECTIONS and bool(M.any()):  # dense columns (module doc)
        columns, rblock, res_codes, rs, sparse, bmask = _column_residual(M, R, Wf, block)
    else:
        columns, rblock = None, block
        res_codes, sparse, bmask = _block_residual(M, rc, rs, block)
    nr, nc = block_grid((out, n), block)
    info = {
        "selection": selection,
        "budget": budget,
        "block": f"{block[0]}x{block[1]}",
        "blocks_selected": int(bmask.sum()),  # channels: the gathered matrix's blocks
        "blocks_total": nr * nc,
        "elements_compensated": int(M.sum()),
    }
    if columns is not None:
        info["columns_compensated"] = int(columns.numel())
    if report and H is not None:
        info.update(_distortion_report(R, sparse, H))
    return MosaicResult(
        codes=(base_codes + 8).to(torch.int32),
        scales=base_scales[:, None].clone(),
        zeros=torch.full((out, 1), 8.0, device=W.device),
        g_idx=default_g_idx(n, None, device=W.device),
        sparse=sparse,
        info=info,
        block=rblock,
        block_mask=bmask,
        res_codes=res_codes,
        res_scales=rs,
        columns=columns,
        residual=R,
    )


def _block_residual(
    M: torch.Tensor, rc: torch.Tensor, rs: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``M ⊙ Q(R)`` on the chosen blocks (Eq. 4): ``(res_codes, sparse, block_mask)``, the codes
    zero outside the element mask ``M``."""
    res_codes = torch.where(M, rc, torch.zeros_like(rc))
    sparse = residual_values(res_codes, rs, block[1])
    bmask = block_reduce(M.to(torch.float32), block, "amax") > 0
    return res_codes, sparse, bmask


def _column_residual(M: torch.Tensor, R: torch.Tensor, Wf: torch.Tensor, block: tuple[int, int]):
    """A channel selection's residual as dense columns (module doc): ``Q(R)`` re-quantized on the
    gathered matrix ``R[:, columns]`` with :func:`column_block_width` blocks, every block kept
    (``sparse`` shaped and typed as ``Wf``).
    Returns ``(columns, rblock, res_codes, res_scales, sparse, block_mask)``."""
    out = R.shape[0]
    columns = torch.nonzero(M.any(0)).reshape(-1)
    rblock = (block[0], column_block_width(columns.numel(), block[1]))
    res_codes, rs = residual_quant(R[:, columns], rblock)
    sparse = torch.zeros_like(Wf)
    sparse[:, columns] = residual_values(res_codes, rs, rblock[1])
    bmask = torch.ones(block_grid((out, columns.numel()), rblock), dtype=torch.bool, device=Wf.device)
    return columns, rblock, res_codes, rs, sparse, bmask


def _distortion_report(R: torch.Tensor, sparse: torch.Tensor, H: torch.Tensor) -> dict[str, float]:
    """The exact objective (Eq. 5-6) for ``info``: ``tr(R H Rᵀ)``, ``ΔD = D(R) - D(R - S)`` and the
    recovered fraction (float32 products, float64 sums: a report, not a selection)."""
    Hf = H.float().to(R.device)
    d0 = float(((R @ Hf) * R).sum(dtype=torch.float64))
    dd = float(((sparse @ Hf) * (2 * R - sparse)).sum(dtype=torch.float64))  # = D(R) - D(R - S)
    return {"residual_distortion": d0, "delta_D": dd, "recovered": dd / d0 if d0 > 0 else 0.0}


def _gptq_codes(T: torch.Tensor, H: torch.Tensor, scales: torch.Tensor, damp: float) -> torch.Tensor:
    """GPTQ of ``T`` on the symmetric 4-bit grid of per-row ``scales`` (unsigned codes, zero 8)."""
    s = scales[:, None]
    z = torch.full_like(s, 8.0)
    return gptq_quantize(T, H.float(), IntGrid(4, True), None, scales=s, zeros=z, percdamp=damp).codes


def mosaic_decompose_gptq(
    W: torch.Tensor,
    H: torch.Tensor,
    *,
    damp: float = 0.01,
    clip_search: bool = False,
    report: bool = True,
    **selection,
) -> MosaicResult:
    """MosaicQuant with a GPTQ dense base (our extension, not in the paper): the residual branch chosen
    as the paper does, then GPTQ solving the dense base *around* it.

    1. Algorithm 1 on the round-to-nearest base (Eq. 1): ``R₀ = W - Q_RTN(W)``, the Δ-Hessian scores,
       the selection ``M`` and the compensation ``S = M ⊙ Q(R₀)`` (Eq. 4) -- :func:`mosaic_decompose`'s
       keyword arguments in ``selection`` (``budget``, ``block``, ``selection``, ``seed``, ``act_amax``);
    2. GPTQ (Frantar et al., Alg. 1) on ``W - S`` with the base's per-channel absmax scales fixed: the
       dense base ``B``.  The stored ``B + S`` has exactly GPTQ's error on ``W - S``: the chosen blocks
       are part of what GPTQ compensates.  (The form before issue 73 ran GPTQ on ``W`` and took
       ``R = W - Q_GPTQ(W)``: ``M ⊙ Q(R)`` restored ``W`` on the chosen blocks and undid the error the
       later columns had absorbed for them -- a negative recovered fraction on SmolLM2 and Gemma-3.)

    With ``report``, ``info`` measures the residual against GPTQ alone: ``residual_distortion`` =
    ``tr(E H Eᵀ)`` of GPTQ on ``W`` without a residual, ``delta_D`` = that less the stored model's,
    ``recovered`` = their ratio (one more GPTQ solve)."""
    Wf = W.float()
    hdiag = torch.diagonal(H).float()
    codes0, scales = dense_base(Wf, clip_search=clip_search, hdiag=hdiag)
    first = mosaic_decompose(Wf, H, base_codes=codes0, base_scales=scales, report=False, **selection)
    codes = _gptq_codes(Wf - first.sparse, H, scales, damp)
    base = (codes.float() - 8.0) * scales[:, None]
    info = dict(first.info)
    if report:
        alone = (_gptq_codes(Wf, H, scales, damp).float() - 8.0) * scales[:, None]
        d0 = distortion(Wf - alone, H)
        dd = d0 - distortion(Wf - (base + first.sparse), H)
        info.update({"residual_distortion": d0, "delta_D": dd, "recovered": dd / d0 if d0 > 0 else 0.0})
    return dataclasses.replace(first, codes=codes.to(torch.int32), info=info, residual=Wf - base)
