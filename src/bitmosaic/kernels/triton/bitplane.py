"""SFMP's bit-plane GEMV on the GPU (issue 76; SFMP §4.5, App. B): reads the block-major bit planes of
:mod:`bitmosaic.formats.bitplane` as packed -- any mix of widths 1-8 per (row block, group) block, the
per-block offset table -- and multiplies one row of ``x`` at a time (decode).

Reference: ``F.linear(x, formats.bitplane.dequantize(unpack(planes), scales, zeros, group_size))``; the
kernel rebuilds the same integer codes and the same ``(c - z) * s``, so only the float32 summation order
differs (tests/kernels/triton/test_triton_bitplane.py).  Not yet wired into the SFMP module (its row and
column permutations run around the CPU LUT kernel): a building block, tested on the format.
"""

from __future__ import annotations

import torch

from ...formats.bitplane import BitPlanes
from . import check_device, jit_module

__all__ = ["bitplane_gemv"]


def bitplane_gemv(p: BitPlanes, scales: torch.Tensor, zeros, x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` times the bit-plane weight ``p`` (``scales``/``zeros`` ``[N, G]`` or a number) ->
    ``[..., N]`` in ``x``'s dtype (float32 sums)."""
    if x.shape[-1] != p.K:
        raise ValueError(f"x has {x.shape[-1]} features but the bit-plane weight has {p.K} input columns")
    check_device(x)
    G = p.n_groups
    s = scales.float().expand(p.N, G).contiguous()
    z = zeros.float() if torch.is_tensor(zeros) else torch.tensor(float(zeros), device=x.device)
    z = z.expand(p.N, G).contiguous()
    data = p.data
    if data.numel() % 4:
        data = torch.cat([data, data.new_zeros(4 - data.numel() % 4)])
    words = data.view(torch.int32)
    x2 = x.reshape(-1, p.K)
    if x2.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        x2 = x2.float()
    x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, p.N, dtype=x2.dtype, device=x.device)
    if M and p.N:
        n_rb = p.bits.shape[0]
        grid = (n_rb, -(-p.row_block // 16), M)
        off = p.offsets.to(torch.int64).contiguous()
        bits = p.bits.to(torch.int32).contiguous()
        jit_module("bitplane_jit").bitplane_gemv_kernel[grid](
            x2, words, off, bits, s, z, y, p.N, p.K, G, p.group_size, p.row_block, x2.stride(0), y.stride(0)
        )
    return y.reshape(*x.shape[:-1], p.N).to(x.dtype)
