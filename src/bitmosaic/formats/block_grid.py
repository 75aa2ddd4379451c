"""Block geometry of a weight matrix: a block shape parsed from ``RxC``, the grid of (possibly
partial) blocks, per-block sums or maxima, and a block mask expanded to its elements -- the layout
pieces of block-sparse residuals (MosaicQuant's 64x64 blocks, :mod:`bitmosaic.algorithms.mosaic`)."""

from __future__ import annotations

import torch

from ..errors import OptionError

__all__ = ["parse_block", "block_grid", "block_reduce", "expand_blocks"]


def parse_block(block) -> tuple[int, int]:
    """``"64x64"`` / ``64`` / ``(64, 32)`` -> ``(rows, cols)``, both positive."""
    if isinstance(block, str):
        parts = block.lower().split("x")
        try:
            dims = tuple(int(p) for p in parts)
        except ValueError:
            raise OptionError(f"block must look like 64x64, got {block!r}") from None
    elif isinstance(block, int):
        dims = (block,)
    else:
        dims = tuple(int(b) for b in block)
    if len(dims) == 1:
        dims = dims * 2
    if len(dims) != 2 or min(dims) < 1:
        raise OptionError(f"block must be two positive sizes like 64x64, got {block!r}")
    return dims  # type: ignore[return-value]


def block_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """Number of row blocks and column blocks (partial edge blocks count)."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def _pad(M: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    nr, nc = block_grid(tuple(M.shape), block)
    return torch.nn.functional.pad(M, (0, nc * block[1] - M.shape[1], 0, nr * block[0] - M.shape[0]))


def block_reduce(M: torch.Tensor, block: tuple[int, int], op: str = "sum") -> torch.Tensor:
    """``[out, in]`` -> ``[row blocks, col blocks]`` sums (or maxima with ``op="amax"``)."""
    nr, nc = block_grid(tuple(M.shape), block)
    P = _pad(M, block).reshape(nr, block[0], nc, block[1])
    return P.sum(dim=(1, 3)) if op == "sum" else P.amax(dim=(1, 3))


def expand_blocks(mask: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Block mask ``[nr, nc]`` -> element mask ``[out, in]``."""
    return mask.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]
