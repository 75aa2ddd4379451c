"""Bits-per-weight: the analytic count equals the bytes of real packed buffers."""

from __future__ import annotations

import pytest
import torch

from bitmosaic.formats import layout
from bitmosaic.formats.accounting import bits_per_weight, paper_storage_bits, storage_bits
from bitmosaic.formats.packing import SUPPORTED_BITS, pack_codes


def nominal_bits_per_weight(bits, in_features, out_features, group_size, symmetric, g_idx_bits=0):
    """The analytic count, written from the format's definition (independent of the code under
    test): codes padded to 8 per row, one fp16 scale (+ fp16 zero if asymmetric) per row and group
    (a partial last group counts), optionally a g_idx of ``g_idx_bits`` per column."""
    g = in_features if group_size in (None, -1) else min(group_size, in_features)
    n_groups = -(-in_features // g)
    code_bits = out_features * (-(-in_features // 8) * 8) * bits
    per_group = 16 + (0 if symmetric else 16)
    return (code_bits + out_features * n_groups * per_group + in_features * g_idx_bits) / (
        out_features * in_features
    )


def _packed_buffers(bits, out_f, in_f, group_size, symmetric, with_g_idx=False):
    """The buffers a packed layer stores: qweight uint8, scales fp16 [out,G], zeros only if asym."""
    n_groups = layout.num_groups(in_f, group_size)
    codes = torch.randint(0, 1 << bits, (out_f, in_f), generator=torch.Generator().manual_seed(0))
    bufs = {
        "qweight": pack_codes(codes, bits),
        "scales": torch.rand(out_f, n_groups).to(torch.float16),
        "zeros": None if symmetric else torch.zeros(out_f, n_groups, dtype=torch.float16),
    }
    if with_g_idx:
        bufs["g_idx"] = layout.default_g_idx(in_f, group_size).to(torch.int32)
    return bufs


def test_storage_bits_basics():
    a = torch.zeros(3, 5, dtype=torch.uint8)
    b = torch.zeros(2, dtype=torch.float16)
    c = torch.zeros(4, dtype=torch.int32)
    assert storage_bits([a, b, c]) == 15 * 8 + 2 * 16 + 4 * 32
    assert storage_bits({"a": a, "none": None, "b": b}) == 15 * 8 + 2 * 16
    assert storage_bits(x for x in [a, None]) == 120
    assert storage_bits(a) == 120
    assert storage_bits([]) == 0
    assert bits_per_weight([a], 30) == 4.0
    with pytest.raises(ValueError, match="positive"):
        bits_per_weight([a], 0)


def test_4bit_asym_g128_nominal_equals_real_buffers():
    out_f, in_f = 64, 576
    bufs = _packed_buffers(4, out_f, in_f, 128, symmetric=False)
    real = bits_per_weight(bufs, out_f * in_f)
    nominal = nominal_bits_per_weight(4, in_f, out_f, 128, symmetric=False)
    assert real == nominal
    # 576/128 -> 5 groups (partial last one counts): 4 + 5 * (16 + 16) / 576
    assert nominal == pytest.approx(4 + 5 * 32 / 576)


def test_symmetric_has_no_zero_cost():
    out_f, in_f = 64, 576
    sym = nominal_bits_per_weight(4, in_f, out_f, 128, symmetric=True)
    asym = nominal_bits_per_weight(4, in_f, out_f, 128, symmetric=False)
    assert sym == bits_per_weight(_packed_buffers(4, out_f, in_f, 128, symmetric=True), out_f * in_f)
    assert sym == pytest.approx(4 + 5 * 16 / 576)
    assert asym - sym == pytest.approx(5 * 16 / 576)


def test_3bit_is_three_bits_plus_overhead():
    out_f, in_f = 32, 1024
    bufs = _packed_buffers(3, out_f, in_f, 128, symmetric=False)
    nominal = nominal_bits_per_weight(3, in_f, out_f, 128, symmetric=False)
    assert nominal == bits_per_weight(bufs, out_f * in_f)
    assert nominal == pytest.approx(3 + 8 * 32 / 1024)  # 3.25
    per_channel = nominal_bits_per_weight(3, in_f, out_f, None, symmetric=True)
    assert per_channel == pytest.approx(3 + 16 / 1024)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("out_f,in_f,group_size", [(64, 576, 128), (7, 100, 32), (3, 13, None), (5, 70, -1)])
def test_nominal_equals_real_everywhere(bits, symmetric, out_f, in_f, group_size):
    # includes per-row code padding (in not a multiple of 8) and an int32 g_idx
    bufs = _packed_buffers(bits, out_f, in_f, group_size, symmetric, with_g_idx=True)
    nominal = nominal_bits_per_weight(bits, in_f, out_f, group_size, symmetric, g_idx_bits=32)
    assert nominal == pytest.approx(bits_per_weight(bufs, out_f * in_f), rel=1e-15)
    assert storage_bits(bufs) == round(nominal * out_f * in_f)


def test_paper_storage_bits_hand_counts():
    # 3 x 40, 3-bit, groups of 16 -> 3 groups per row (the last one partial): 360 code bits,
    # 3 rows * 3 groups * 16 scale bits = 144, 2 outliers * 32 = 64; no zeros, no g_idx, no padding
    assert paper_storage_bits(3, 40, 3, 16, 2) == 360 + 144 + 64
    assert paper_storage_bits(3, 40, 3, None) == 360 + 3 * 16  # one scale per row
    assert paper_storage_bits(3, 40, 3, -1) == 360 + 3 * 16
    # the Babai paper's Table 3 widths at Qwen3-8B's shapes (4096 wide: whole groups)
    n = 4096 * 4096
    assert paper_storage_bits(4096, 4096, 4, 128) / n == 4.125
    assert paper_storage_bits(4096, 4096, 2, 128) / n == 2.125
    ssqr_1pct = paper_storage_bits(4096, 4096, 3, 128, round(0.01 * n)) / n
    assert ssqr_1pct == pytest.approx(3.445, abs=1e-6)
    ssqr_3pct = paper_storage_bits(4096, 4096, 4, 128, round(0.03 * n)) / n
    assert ssqr_3pct == pytest.approx(5.085, abs=1e-6)
    # below the stored count of the same layout: asymmetric zeros, padding and g_idx are left out
    assert paper_storage_bits(64, 576, 4, 128) / (64 * 576) < nominal_bits_per_weight(
        4, 576, 64, 128, symmetric=False, g_idx_bits=32
    )
    for bad in ((0, 40, 3, 16), (3, 40, 3, 16, -1), (3, 40, 3, 16, 121)):
        with pytest.raises(ValueError):
            paper_storage_bits(*bad)
