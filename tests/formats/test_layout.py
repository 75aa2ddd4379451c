"""Reference dequantization of group layouts (formats/layout.py)."""

import torch


def test_dequantize_in_row_blocks_equals_the_formula(monkeypatch):
    """The row-blocked reference dequantization gives the bits of the whole-matrix formula, for
    per-row scales and zeros, a scalar zero, permuted g_idx and partial groups."""
    import bitmosaic.formats.layout as L
    from bitmosaic.formats.grid import dequantize_codes

    monkeypatch.setattr(L, "_ROWS", 100)  # many blocks, the last one partial
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (37, 70), generator=g, dtype=torch.uint8)
    scales = torch.rand(37, 3, generator=g).half()
    zeros = torch.randint(0, 16, (37, 3), generator=g).half()
    g_idx = torch.randperm(70, generator=g) % 3
    for z in (zeros, 8.0):
        zf = z.float()[:, g_idx] if torch.is_tensor(z) else torch.tensor(z)
        want = dequantize_codes(codes.float(), scales.float()[:, g_idx], zf)
        assert torch.equal(L.dequantize(codes, scales, z, g_idx), want)
    one = scales[:1]  # one row of scales for every row: broadcast, as before
    want = dequantize_codes(codes.float(), one.float()[:, g_idx], torch.tensor(8.0))
    assert torch.equal(L.dequantize(codes, one, 8.0, g_idx), want)
