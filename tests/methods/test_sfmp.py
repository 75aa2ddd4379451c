"""SFMP: allocation, reordering, blocks, the sfmp module kind, Fisher salience, CLI."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.algorithms.gptq import IntColumnQuantizer, gptq_quantize
from bitmosaic.algorithms.sfmp import (
    BlockPlan,
    MixedRowQuantizer,
    allocate_bits,
    bits_from_budget,
    block_salience,
    inverse_perm,
    layout_overhead_bits,
    permute,
    reorder_perms,
)
from bitmosaic.formats.blocks import pack_blocks, unpack_blocks
from bitmosaic.formats.grid import IntGrid
from tests.helpers import tiny_llama


def _plans(shapes, block_rows=8, block_cols=16, group=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    plans, sums = {}, {}
    for i, (n, k) in enumerate(shapes):
        S = torch.rand(n, k, generator=g, dtype=torch.float64) ** 4
        rp, cp = reorder_perms(S)
        plans[f"l{i}"] = BlockPlan(n, k, block_rows, block_cols, group, rp, cp)
        sums[f"l{i}"] = block_salience(permute(S, rp, cp), block_rows, block_cols)
    return plans, sums


SHAPES = [(20, 40), (8, 16), (33, 24), (64, 48)]  # partial row and column blocks


@pytest.mark.parametrize("b", [2.0, 2.37, 3.5, 1.25, 3.999])
def test_allocation_fills_the_weight_budget_in_mean_order(b):
    plans, sums = _plans(SHAPES)
    info = allocate_bits(sums, plans, b)
    lo, hi = math.floor(b), math.floor(b) + (b > math.floor(b))
    assert (info["low"], info["high"]) == (lo, max(hi, lo))
    N = sum(n * k for n, k in SHAPES)
    means, counts, high = [], [], []
    for name, p in plans.items():
        c = p.block_counts()
        assert set(p.bits.unique().tolist()) <= {lo, hi}
        means.append((sums[name] / c).flatten())
        counts.append(c.flatten())
        high.append(p.bits.flatten() == hi)
    means, counts, high = torch.cat(means), torch.cat(counts), torch.cat(high)
    n_high = int(counts[high].sum()) if hi > lo else 0
    assert n_high == info["high_weights"]
    assert n_high <= (b - lo) * N + 1e-6
    reached = sum(p.average_bits() * p.out_features * p.in_features for p in plans.values()) / N
    assert reached == pytest.approx(info["b_reached"], abs=1e-12)
    if hi > lo and high.any() and (~high).any():
        assert means[high].min() >= means[~high].max()  # the high blocks are a prefix of the ranking
        nxt = counts[~high][means[~high].argmax()]  # the first block that did not fit
        assert n_high + int(nxt) > (b - lo) * N


def test_allocation_sum_rank_is_the_papers_block_quantile():
    plans, sums = _plans(SHAPES)
    allocate_bits(sums, plans, 2.3, rank="sum")
    k = sum(int((p.bits == 3).sum()) for p in plans.values())
    K = sum(p.bits.numel() for p in plans.values())
    assert k == round(0.3 * K)
    allsum = torch.cat([s.flatten() for s in sums.values()])
    hi = torch.cat([p.bits.flatten() == 3 for p in plans.values()])
    assert allsum[hi].min() >= allsum[~hi].max()


def test_equal_blocks_mean_and_sum_agree():
    plans, sums = _plans([(16, 32), (32, 32)], block_rows=8, block_cols=16)
    a = copy.deepcopy(plans)
    allocate_bits(sums, plans, 2.25)
    allocate_bits(sums, a, 2.25, rank="sum")
    for n in plans:
        assert torch.equal(plans[n].bits, a[n].bits)


def test_budget_from_bpw_uses_the_measured_overhead():
    plans, _ = _plans(SHAPES)
    N = sum(n * k for n, k in SHAPES)
    over = sum(sum(layout_overhead_bits(p).values()) for p in plans.values())
    got = bits_from_budget(plans, bpw=6.0)
    assert got["b"] == pytest.approx(6.0 - over / N)
    assert bits_from_budget(plans, budget_mb=6.0 * N / 8 / 2**20)["b"] == pytest.approx(got["b"])
    with pytest.raises(ValueError, match="exactly one"):
        bits_from_budget(plans, bpw=3.0, avg_bits=2.0)
    with pytest.raises(ValueError, match="1..8"):
        bits_from_budget(plans, bpw=0.5)


def test_smollm2_group_overheads_match_the_issue():
    """SmolLM2-135M's shapes: scale+zero overhead 0.271 BPW at g128, 0.156 at g256 (partial groups)."""
    shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
    for g, want in ((128, 0.271), (256, 0.156)):
        plans = {i: BlockPlan(n, k, 512, g, g, None, None) for i, (n, k) in enumerate(shapes)}
        N = sum(n * k for n, k in shapes)
        sz = sum(layout_overhead_bits(p)["scales_zeros"] for p in plans.values()) / N
        assert sz == pytest.approx(want, abs=5e-4)


def test_reordered_float_layer_equals_the_original():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(24, 40, generator=g, dtype=torch.float64)
    S = torch.rand(24, 40, generator=g, dtype=torch.float64)
    x = torch.randn(5, 40, generator=g, dtype=torch.float64)
    rp, cp = reorder_perms(S)
    assert torch.all(S.sum(1)[rp][:-1] >= S.sum(1)[rp][1:])
    assert torch.all(S.sum(0)[cp][:-1] >= S.sum(0)[cp][1:])
    Wt = permute(W, rp, cp)
    y = (x[:, cp] @ Wt.T)[:, inverse_perm(rp)]  # Eq. 14
    torch.testing.assert_close(y, x @ W.T, rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 20),
    k=st.integers(1, 40),
    br=st.integers(1, 9),
    bc=st.integers(1, 17),
    seed=st.integers(0, 1000),
)
def test_block_major_packing_round_trips(n, k, br, bc, seed):
    g = torch.Generator().manual_seed(seed)
    n_rb, n_cb = -(-n // br), -(-k // bc)
    bits = torch.randint(1, 9, (n_rb, n_cb), generator=g).to(torch.uint8)
    maxq = (1 << bits.long()).repeat_interleave(br, 0)[:n].repeat_interleave(bc, 1)[:, :k]
    codes = (torch.rand(n, k, generator=g) * maxq).long()
    data = pack_blocks(codes, bits, br, bc)
    sizes = [
        -(-(min(br, n - r * br) * min(bc, k - c * bc)) // 8) * int(bits[r, c])
        for r in range(n_rb)
        for c in range(n_cb)
    ]
    assert data.numel() == sum(sizes)
    assert torch.equal(unpack_blocks(data, (n, k), bits, br, bc), codes.to(torch.int32))


def test_mixed_gptq_with_one_width_equals_plain_gptq(layer64):
    W, _, H = layer64
    W, H = W.float(), H.float()
    plain = gptq_quantize(W, H, IntGrid(3), 16, quantizer=IntColumnQuantizer(IntGrid(3), "mse"))
    gb = torch.full((W.shape[0], 4), 3)
    mixed = gptq_quantize(W, H, IntGrid(8), 16, quantizer=MixedRowQuantizer(gb, "mse"))
    assert torch.equal(plain.codes, mixed.codes)
    gb[::2] = 2
    mixed = gptq_quantize(W, H, IntGrid(8), 16, quantizer=MixedRowQuantizer(gb, "mse"))
    assert int(mixed.codes[::2].max()) <= 3 and int(mixed.codes[1::2].max()) <= 7


def _variants():
    """Every layout the reorder and block ablations compare: (row_reorder, col_reorder, m_b)."""
    return [(r, c, mb) for r in (False, True) for c in (False, True) for mb in (4, 8, 64)]


@pytest.mark.parametrize("b", [2.37, 3.0677])
def test_equal_code_bits_budget_is_met_by_every_layout(b):
    """``avg_bits`` counts the codes only (the ablations' equal-code-bits budget): every layout plans
    ``b_reached <= b``, short of ``b`` by less than its largest block, and reports beside it exactly
    the bits it stores besides the codes (fp16 scale+zero per row and group, int16 indices of each
    reordered direction, the uint8 bit map)."""
    from bitmosaic.methods import get_method
    from bitmosaic.methods.sfmp import sfmp_allocate, sfmp_budget

    g = torch.Generator().manual_seed(0)
    sal = {f"l{i}": torch.rand(n, k, generator=g) ** 4 for i, (n, k) in enumerate(SHAPES)}
    shapes = {name: tuple(S.shape) for name, S in sal.items()}
    n = sum(a * c for a, c in SHAPES)
    spec = get_method("sfmp")
    reached = set()
    for r, c, mb in _variants():
        cfg = spec.make_config(avg_bits=b, group_size=16, block_rows=mb, row_reorder=r, col_reorder=c)
        state, summary = sfmp_allocate(sal, cfg)
        assert summary["b"] == b and sfmp_budget(shapes, cfg)["b"] == b
        code = sum(p.average_bits() * p.out_features * p.in_features for p in state.plans.values()) / n
        assert code == pytest.approx(summary["b_reached"], abs=1e-12)
        biggest = max(int(p.block_counts().max()) for p in state.plans.values())
        assert 0 <= b - summary["b_reached"] < biggest / n
        over = 0
        for N, K in SHAPES:
            n_rb, n_cb = -(-N // min(mb, N)), -(-K // 16)
            over += 32 * N * n_cb + 16 * N * r + 16 * K * c + 8 * n_rb * n_cb
        assert summary["overhead_bpw"] == pytest.approx(over / n, abs=1e-12)
        assert summary["bpw_target"] == pytest.approx(b + over / n, abs=1e-12)
        reached.add(round(summary["b_reached"], 9))
    assert len(reached) > 1  # the layouts differ only by less than a block each, not by the indices


def test_the_code_bits_of_a_total_budget_give_the_same_allocation():
    """``sfmp_budget`` gives the ``b`` that ``bpw`` leaves on a layout, without Fisher; that ``b`` as
    ``avg_bits`` gives the identical allocation (so the main row is the ablations' equal-code-bits row)."""
    from bitmosaic.methods import get_method
    from bitmosaic.methods.sfmp import sfmp_allocate, sfmp_budget

    g = torch.Generator().manual_seed(1)
    sal = {f"l{i}": torch.rand(n, k, generator=g) ** 4 for i, (n, k) in enumerate(SHAPES)}
    spec = get_method("sfmp")
    by_bpw = spec.make_config(bpw=4.9, group_size=16, block_rows=8)
    b = sfmp_budget({k: tuple(v.shape) for k, v in sal.items()}, by_bpw)["b"]
    s1, a1 = sfmp_allocate(sal, by_bpw)
    s2, a2 = sfmp_allocate(sal, spec.make_config(avg_bits=b, group_size=16, block_rows=8))
    assert a1["b"] == b == a2["b"] and a1["b_reached"] == a2["b_reached"]
    assert all(torch.equal(s1.plans[k].bits, s2.plans[k].bits) for k in sal)


# -- the sfmp method on a tiny Llama ---------------------------------------------------------


def _calib(model, n=4, seqlen=24):
    return torch.randint(0, model.config.vocab_size, (n, seqlen), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def tiny_sfmp(tmp_path_factory):
    """A tiny Llama quantized with sfmp (b = 2.5, 8x16 blocks) and its float twin."""
    from bitmosaic import quantize_

    model = tiny_llama(0)
    ref = copy.deepcopy(model)
    cache = tmp_path_factory.mktemp("fisher")
    rep = quantize_(
        model, "sfmp", _calib(model), avg_bits=2.5, group_size=16, block_rows=8, fisher_cache=str(cache),
        progress=False, n_grid=4,
    )  # fmt: skip
    return model, ref, rep, cache


def test_sfmp_reaches_the_budget_and_reports_each_part(tiny_sfmp):
    from bitmosaic.modules.sfmp import SFMPLinear

    model, _, rep, _ = tiny_sfmp
    alloc = rep.calibration["allocation"]
    assert alloc["b_reached"] <= 2.5 + 1e-9 and alloc["b_reached"] > 2.3
    assert alloc["fisher"]["seconds"] > 0 and alloc["fisher"]["samples"] == 4
    mods = [m for m in model.modules() if isinstance(m, SFMPLinear)]
    assert len(mods) == 14
    n = sum(m.in_features * m.out_features for m in mods)
    code = sum(m.code_bits() * m.in_features * m.out_features for m in mods) / n
    assert code == pytest.approx(alloc["b_reached"])
    for m in mods:
        parts = m.bits_breakdown()
        assert sum(parts.values()) == pytest.approx(m.bits_per_weight())
        assert parts["weights"] == pytest.approx(m.code_bits())  # every block holds a multiple of 8 codes
        N, K = m.out_features, m.in_features
        assert parts["permutations"] == pytest.approx(16 * (N + K) / (N * K))
        assert parts["bit_map"] == pytest.approx(8 * m.bit_map.numel() / (N * K))
    total = sum(m.bits_per_weight() * m.in_features * m.out_features for m in mods) / n
    assert rep.bits_per_weight == pytest.approx(total)
    assert rep.bits_per_weight == pytest.approx(alloc["b_reached"] + alloc["overhead_bpw"])


def test_sfmp_equal_code_bits_with_and_without_reordering(tiny_sfmp):
    """The same ``avg_bits`` with no reordering: the stored codes hold the planned ``b_reached``
    (within a block of the reordered run's), and the two totals differ by exactly the int16
    permutation indices, which the equal-code-bits budget reports beside the codes."""
    from bitmosaic import quantize_
    from bitmosaic.modules.sfmp import SFMPLinear

    model, ref, rep, cache = tiny_sfmp
    plain = copy.deepcopy(ref)
    rep2 = quantize_(
        plain, "sfmp", _calib(plain), avg_bits=2.5, group_size=16, block_rows=8, fisher_cache=str(cache),
        progress=False, n_grid=4, row_reorder=False, col_reorder=False,
    )  # fmt: skip
    a1, a2 = rep.calibration["allocation"], rep2.calibration["allocation"]
    assert a2["fisher"]["cached"] and a1["b"] == a2["b"] == 2.5
    mods = {name: m for name, m in plain.named_modules() if isinstance(m, SFMPLinear)}
    n = sum(m.in_features * m.out_features for m in mods.values())
    assert sum(m.code_bits() * m.in_features * m.out_features for m in mods.values()) / n == pytest.approx(
        a2["b_reached"]
    )
    biggest = 8 * 16
    assert 2.5 - biggest / n < a2["b_reached"] <= 2.5 and 2.5 - biggest / n < a1["b_reached"] <= 2.5
    perms = sum(16 * (m.in_features + m.out_features) for m in mods.values()) / n
    assert rep.bits_per_weight - a1["b_reached"] - (rep2.bits_per_weight - a2["b_reached"]) == pytest.approx(
        perms
    )


def test_sfmp_kernel_forward_matches_reference_and_folds_exactly(tiny_sfmp):
    from bitmosaic.modules import set_weight_cache
    from bitmosaic.modules.sfmp import SFMPLinear

    model, _, rep, _ = tiny_sfmp
    assert rep.calibration["permutations_folded"] == 2
    mlp = model.model.layers[0].mlp
    assert not mlp.down_proj._gather_input
    x = torch.randn(3, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    h = torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)  # in down_proj's column order
    y = mlp.down_proj(h)
    Wg, Wu, Wd = (m.dequantize_reference() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    want = (torch.nn.functional.silu(x @ Wg.T) * (x @ Wu.T)) @ Wd.T
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
    set_weight_cache(mlp, True)  # the dequantized-weight path sees the same folded orders
    try:
        y2 = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    finally:
        set_weight_cache(mlp, False)
    torch.testing.assert_close(y2, want, rtol=1e-4, atol=1e-5)
    q = model.model.layers[1].self_attn.q_proj
    assert isinstance(q, SFMPLinear) and q.row_perm is not None
    torch.testing.assert_close(q(x), x @ q.dequantize_reference().T, rtol=1e-4, atol=1e-5)


def test_sfmp_save_load_round_trip(tiny_sfmp, tmp_path):
    from bitmosaic.io import load_quantized, save_quantized

    model, _, _, _ = tiny_sfmp
    ids = _calib(model, 2, 16)
    with torch.no_grad():
        before = model(ids).logits
    save_quantized(model, tmp_path / "q", {"method": "sfmp"})
    loaded, _ = load_quantized(tmp_path / "q", load_tokenizer=False)
    assert not loaded.model.layers[0].mlp.down_proj._gather_input  # folded again at load
    with torch.no_grad():
        after = loaded(ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_fisher_is_the_per_sample_squared_gradient_and_is_cached(tiny_sfmp):
    from bitmosaic.pipeline.fisher import fisher_salience, salience_linear_names

    _, ref, _, cache = tiny_sfmp
    model = copy.deepcopy(ref)
    calib = _calib(model, 2, 12)
    names = salience_linear_names(model)
    sal, info = fisher_salience(model, calib, names, cache_dir=None, progress=False)
    assert not info["cached"] and info["seconds"] > 0
    w = model.get_submodule(names[3]).weight
    want = torch.zeros_like(w)
    for i in range(2):
        w.requires_grad_(True)
        (g,) = torch.autograd.grad(model(input_ids=calib[i : i + 1], labels=calib[i : i + 1]).loss, w)
        want += g * g
        w.requires_grad_(False)
    torch.testing.assert_close(sal[names[3]], want / 2, rtol=1e-5, atol=1e-12)
    assert all(p.grad is None for p in model.parameters())
    again, info2 = fisher_salience(model, calib, names, cache_dir=cache, progress=False)
    again, info2 = fisher_salience(model, calib, names, cache_dir=cache, progress=False)
    assert info2["cached"] and torch.equal(again[names[3]], sal[names[3]])


def test_sfmp_below_two_bits_and_gptq_solver():
    from bitmosaic import quantize_
    from bitmosaic.modules.sfmp import SFMPLinear

    model = tiny_llama(1)
    rep = quantize_(
        model, "sfmp", _calib(model), avg_bits=1.5, group_size=16, block_rows=16, solver="gptq",
        fisher_cache=None, progress=False, row_reorder=False,
    )  # fmt: skip
    assert rep.calibration["allocation"]["low"] == 1
    widths = set()
    for m in model.modules():
        if isinstance(m, SFMPLinear):
            assert m.row_perm is None and m.col_perm is not None
            widths |= set(m.bit_map.unique().tolist())
            codes = m.codes_permuted()
            assert int(codes.max()) <= 3
    assert widths == {1, 2}
    with torch.no_grad():
        assert torch.isfinite(model(_calib(model, 1, 8)).logits).all()


def test_cli_sfmp_flags():
    from bitmosaic.cli import build_parser, method_options
    from bitmosaic.methods import get_method

    p = build_parser()
    args = p.parse_args(
        ["quantize", "--method", "sfmp", "--bpw", "3.25", "--group-size", "256", "--block", "64x256",
         "--no-row-reorder", "--sfmp-solver", "gptq", "--rank", "sum", "--fisher-samples", "16"]
    )  # fmt: skip
    spec = get_method("sfmp")
    cfg = spec.make_config(**method_options(args, spec))
    assert (cfg.bpw, cfg.group_size, cfg.block_rows, cfg.block_cols) == (3.25, 256, 64, 256)
    assert not cfg.row_reorder and cfg.col_reorder and cfg.solver == "gptq" and cfg.rank == "sum"
    assert cfg.fisher_samples == 16
    bad = p.parse_args(["quantize", "--method", "gptq", "--avg-bits", "3"])
    with pytest.raises(ValueError, match="--avg-bits does not apply to method .gptq."):
        method_options(bad, get_method("gptq"))
    bad = p.parse_args(["quantize", "--method", "sfmp", "--bits", "3", "--avg-bits", "3"])
    with pytest.raises(ValueError, match="--bits"):
        method_options(bad, spec)
    with pytest.raises(ValueError, match="multiple of the group"):
        spec.make_config(avg_bits=3, group_size=128, block_cols=64)
    with pytest.raises(ValueError, match="512x128"):  # --block is shared with mosaic: checked per method
        method_options(p.parse_args(["quantize", "--method", "sfmp", "--block", "512"]), spec)


def test_cli_quantize_sfmp_end_to_end(tmp_path):
    """Through the CLI (a one-entry recipe): the global allocation reaches every linear."""
    from bitmosaic.cli import main
    from tests.helpers import save_hf_dir, words

    model = save_hf_dir(tmp_path / "tiny")
    text = tmp_path / "t.txt"
    text.write_text(words(3000))
    argv = ["quantize", "--model", str(model), "--method", "sfmp", "--avg-bits", "3.5", "--group-size", "32",
            "--block", "32x32", "--fisher-cache", "none", "--calib", str(text), "--nsamples", "2",
            "--seqlen", "32", "--no-progress", "--out", str(tmp_path / "q")]  # fmt: skip
    assert main(argv) == 0
    assert (tmp_path / "q" / "config.json").is_file()


def test_act_solve_order_is_plain_act_order_gptq_on_the_layout(layer64):
    """``gptq_order="act"`` (issue 73 item 6): on a one-width plan the layer is GPTQ in act-order with
    static groups on the layout's contiguous groups -- the independent reference below is the plain
    integer quantizer, not SFMP's mixed one -- and the columns are solved in the same order whatever
    the layout (act-order of the same Hessian), unlike the default, which solves W̃ in its own order."""
    from bitmosaic.algorithms.orders import act_order
    from bitmosaic.methods.registry import LayerStats
    from bitmosaic.methods.sfmp import SFMPConfig, quantize_sfmp

    W, _, H = layer64
    W, H = W.float(), H.float()
    S = torch.rand(W.shape, generator=torch.Generator().manual_seed(3))
    for rp, cp in ((None, None), reorder_perms(S)):
        plan = BlockPlan(48, 64, 16, 16, 16, rp, cp, bits=torch.full((3, 4), 3, dtype=torch.uint8))
        cfg = SFMPConfig(avg_bits=3.0, group_size=16, gptq_order="act", fisher_cache=None)
        got = quantize_sfmp(W, LayerStats(hessian=H), cfg, plan)
        Wt = permute(W, rp, cp)
        Ht = H if cp is None else H[cp][:, cp]
        ref = gptq_quantize(
            Wt, Ht, IntGrid(3), 16, quantizer=IntColumnQuantizer(IntGrid(3), "mse"), perm=act_order(Ht),
            static_groups=True,
        )  # fmt: skip
        rinv, cinv = (None if p is None else inverse_perm(p) for p in (rp, cp))
        codes = permute(ref.codes, rinv, cinv)
        assert torch.equal(got.codes, codes.to(got.codes.dtype))
        layout = quantize_sfmp(W, LayerStats(hessian=H), SFMPConfig(avg_bits=3.0, group_size=16), plan)
        assert cp is None or not torch.equal(layout.codes, got.codes)  # the default solves in W̃'s order
    # the solve order, in original columns, is the same for both layouts (distinct Hessian diagonals)
    assert torch.diagonal(H).unique().numel() == 64
    assert torch.equal(cp[act_order(H[cp][:, cp])], act_order(H))


def test_act_solve_order_needs_the_gptq_solver():
    from bitmosaic.errors import OptionError
    from bitmosaic.methods.sfmp import SFMPConfig

    with pytest.raises(OptionError, match="--gptq-order act orders GPTQ's solve: it needs --solver gptq"):
        SFMPConfig(avg_bits=3.0, solver="awq", gptq_order="act")
