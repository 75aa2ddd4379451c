"""``benchmarks/mosaic/outliers.py``: the statistics the findings' why texts cite (issue 73) find what is
planted -- a dequantized Q4_1 grid (16 values per 32 weights) and an activation outlier channel."""

import torch
import transformers

from benchmarks.mosaic import outliers


def test_a_q4_1_grid_is_found_and_float_weights_are_not():
    g = torch.Generator().manual_seed(0)
    rows, groups = 64, 8
    q = torch.randint(0, 16, (rows, groups, 32), generator=g).float()  # Q4_1: w = d * q + m per 32 weights
    d, m = torch.rand(rows, groups, 1, generator=g) * 0.01, torch.randn(rows, groups, 1, generator=g) * 0.05
    grid = (d * q + m).reshape(rows, groups * 32)
    assert outliers._grid_share(grid) == 1.0
    assert outliers._grid_share(torch.randn(rows, groups * 32, generator=g)) == 0.0


def test_a_planted_activation_outlier_channel_is_counted():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, 100, generator=g)
    x[:, :, 7] *= 50  # one channel 50x the others
    stats = outliers._Inputs(100)
    stats.add(x)
    s = outliers._channel_stats(stats.mx, stats.sq)
    assert abs(s["share_over_20x"] - 1 / 100) < 1e-6 and s["max_ratio"] > 20  # float32 mean
    assert s["top10_energy_share"] > 0.9  # the outlier channel's energy dominates


def test_every_linear_input_of_a_small_llama_is_measured():
    cfg = transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    layers = outliers.activation_stats(model, torch.randint(0, 50, (3, 8)))
    assert set(layers) == {f"{i}.{k}" for i in range(2) for k in ("qkv", "o_proj", "gate_up", "down_proj")}
    kinds = outliers.by_kind(layers)
    assert set(kinds) == {"qkv", "o_proj", "gate_up", "down_proj", "all"}
    assert set(outliers.weight_stats(model)) == set(outliers.WEIGHT_KINDS)
