"""SQ-format activations run in integers on the CPU (modules/sq.py ``SQIntKernel``): the split is the
simulated path's own (same INT levels, same scales), each part's levels (int8) multiply the weight codes
in int32 per run of one weight group and one activation scale, and the output equals the simulated path
(``$BITMOSAIC_ACT_COMPUTE=sim``: the float32 split) up to float32 rounding -- dynamic and static masks,
per-token, per-bank, per-group and calibrated scales, pruned low parts; where the runs do not allow it
(a static mask whose bank keeps 4 high channels: runs of 4) or the format is FP, the layer runs simulated
and says why, and ``inspect``'s label agrees with the layer."""

from __future__ import annotations

import pytest
import torch

from bitmosaic.algorithms.rtn import rtn_quantize
from bitmosaic.algorithms.sq import static_act_scales, static_channel_mask
from bitmosaic.formats.act import ActQuantSpec
from bitmosaic.formats.grid import IntGrid
from bitmosaic.formats.sq import parse_sq
from bitmosaic.kernels import intmm, isa
from bitmosaic.modules import QuantLinear
from bitmosaic.modules.intact import act_path_label
from bitmosaic.modules.sq import SQActLinear
from bitmosaic.modules.sq_int import SQIntKernel
from tests.helpers import env_var
from tests.kernels.test_intact import simulated


def _dense(seed, out=40, n=256, gs=64, sym=False):
    W = torch.randn(out, n, generator=torch.Generator().manual_seed(seed))
    res = rtn_quantize(W, IntGrid(4, sym), gs, "minmax")
    return QuantLinear.from_result(res, bits=4, group_size=gs, symmetric=sym, bias=torch.randn(out))


def _layer(sq, strategy, scale, group=None, calibrated=False, seed=0, gs=64, sym=False):
    dense = _dense(seed, gs=gs, sym=sym)
    fmt = parse_sq(sq)
    x0 = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed + 1)) * torch.linspace(0.2, 3, 256)
    if strategy == "dynamic":
        return SQActLinear.from_packed(dense, sq, "dynamic", scale, act_group=group), x0
    mask = static_channel_mask(x0.abs().mean(0), fmt)
    scales = static_act_scales(x0.abs().amax(0), mask, fmt, scale, group) if calibrated else None
    return SQActLinear.from_packed(dense, sq, "static", scale, mask, group, scales), x0


def _run(m, x):
    with torch.inference_mode():
        assert m.int_act_blocker() is None and m.runs_int_act(x)
        y = m(x)
        assert isinstance(m._int_act, SQIntKernel)
        with simulated():
            assert not m.runs_int_act(x)
            y_sim = m(x)
    return y, y_sim


@pytest.mark.parametrize(
    "sq, strategy, scale, group, calibrated",
    [
        ("16-(8/4)-0.5", "dynamic", "token", None, False),
        ("16-(8/4)-0.5", "dynamic", "bank", None, False),
        ("16-(8/4)-0.75", "dynamic", "bank", None, False),
        ("16-(8/4)-0.5", "dynamic", "group", 32, False),
        ("16-(8/4)-0.5", "static", "token", None, False),
        ("16-(8/4)-0.5", "static", "bank", None, False),
        ("16-(8/4)-0.5", "static", "bank", None, True),
        ("16-(8/4)-0.5", "static", "group", 128, True),
        ("32-(8/4)-0.75", "static", "bank", None, False),
        ("16-(8/0)-0.5", "static", "bank", None, False),
        ("16-(8/2)-0.5", "dynamic", "bank", None, False),
    ],
)
@pytest.mark.parametrize("rows", [1, 7, 96])
def test_int_split_matches_the_simulated_split(sq, strategy, scale, group, calibrated, rows):
    m, x0 = _layer(sq, strategy, scale, group, calibrated)
    x = x0[:rows] * 1.3
    y, y_sim = _run(m, x)
    if scale == "bank":  # the scale changes inside weight groups: the kernel's runs mode
        k = m._int_act
        runs = [part[4] for part in k.parts.values()] + ([k.merged[4]] if k.merged is not None else [])
        assert runs and all(runs)
    b = m.bias
    bound = x.abs().double() @ m.dequantize_reference().abs().double().T  # Σ|x||W| of each output
    assert torch.all(((y - b).double() - (y_sim - b).double()).abs() <= bound * 1e-5 + 1e-5)
    assert not torch.equal(y, torch.nn.functional.linear(x, m.dequantize_reference(), b))  # it quantizes
    assert m.act_compute(m.layer_config()) == act_path_label(None, ActQuantSpec("int", m.fmt.h_high))


def test_what_stays_simulated_says_why():
    m, x0 = _layer("16-(8/4)-0.75", "static", "bank")  # 4 high channels per bank: runs of 4
    assert m.int_act_blocker().startswith("SQ-format high part: columns of one weight group and one")
    assert not m.runs_int_act(x0[:2])
    assert m.act_compute(m.layer_config()).startswith("simulated (SQ-format high part")
    fp, _ = _layer("16-(fp8/fp4)-0.5", "dynamic", "token")
    assert fp.int_act_blocker() == "FP SQ-format activations (fp8/fp4): no CPU instruction"
    label = "simulated (FP SQ-format activations (fp8/fp4): no CPU instruction)"
    assert fp.act_compute(fp.layer_config()) == label


def test_saved_and_loaded_model_runs_it(tmp_path):
    import bitmosaic
    from bitmosaic.io import load_quantized, save_quantized
    from tests.methods.saved_bytes import calib, tiny_llama

    model = tiny_llama()
    bitmosaic.quantize_(model, "sq-acts", calib(), progress=False, strategy="static", act_scale="bank")
    layers = [m for m in model.modules() if isinstance(m, SQActLinear)]
    tokens = calib()[:2]
    with torch.inference_mode():
        y = model(tokens).logits
        with simulated():
            y_sim = model(tokens).logits
    assert layers and all(isinstance(m._int_act, SQIntKernel) for m in layers)
    assert (y.argmax(-1) == y_sim.argmax(-1)).float().mean() >= 0.9
    loaded, _ = load_quantized(
        save_quantized(model, tmp_path / "m", {"method": "sq-acts"}), load_tokenizer=False
    )
    with torch.inference_mode():
        assert torch.equal(loaded(tokens).logits, y)


@pytest.mark.parametrize(
    "sq, scale, group, calibrated",
    [
        ("16-(8/4)-0.5", "token", None, False),
        ("16-(8/4)-0.5", "bank", None, False),
        ("16-(8/4)-0.5", "bank", None, True),
        ("16-(8/4)-0.5", "group", 128, False),
        ("16-(8/4)-0.5", "group", 64, True),
        ("32-(8/4)-0.75", "bank", None, False),
        ("16-(8/2)-0.5", "bank", None, False),
    ],
)
def test_static_levels_are_the_splits_own(sq, scale, group, calibrated):
    """The static integer path quantizes each part's gathered channels itself; its levels and scales
    are exactly the simulated split's (``static_split``), zeros, ties and huge values included."""
    from bitmosaic.algorithms.sq import static_split

    m, x0 = _layer(sq, "static", scale, group, calibrated)
    x = x0[:9].clone()
    x[0] = 0.0  # an all-zero token (scales clamp to the smallest fp16)
    x[1, 5] = 3e5  # one huge value
    x[2] = torch.round(x[2] * 4) / 4  # exact quarter values: ties in the rounding
    parts = m._int_parts(merge=False)
    k = SQIntKernel(m, parts)  # the per-part path (what runs without the extension)
    scales = None if m.act_low_scale is None else (m.act_low_scale, m.act_high_scale)
    t = static_split(x, m.channel_mask(), m.fmt, m.act_scale, m.act_group, scales)
    perm = m.sq_perm.long()
    for part, (w, cols, act_cols, col_act, run) in k.parts.items():
        levels, s = k.static_part(x, part, w, cols, act_cols, col_act, run)
        want, want_s = (t.high, t.high_scale) if part == "high" else (t.low, t.low_scale)
        assert torch.equal(levels, want[:, perm[cols]]), part
        assert torch.equal(s.expand(9, -1)[:, act_cols], want_s[:, act_cols]), part
        if not w.compiled():
            continue
        # the extension's gathered quantization (what the layer runs): the same levels and scales on
        # every instruction set, the run sums and the runs mode's zero-point term
        nruns, length = k._runs(w, run)
        for name in isa.available_isas(intmm.extension()):
            with env_var(isa.ISA_ENV, name):
                q, sums, sa, qz = k.static_levels(x, part, w, act_cols, run)
            n = levels.shape[1]
            assert torch.equal(q[:, :n].float(), levels) and torch.all(q[:, n:] == 0), (part, name)
            assert torch.equal(sa.expand(9, -1), s.expand(9, -1)[:, act_cols]), (part, name)
            lv = torch.nn.functional.pad(levels, (0, nruns * length - n)).reshape(9, nruns, length)
            assert torch.equal(sums, lv.sum(-1).int()), (part, name)
            if run:
                assert torch.allclose(qz, w.run_sums(q, sa, run), rtol=1e-6, atol=1e-6), (part, name)
    k = m._build_int_act()
    if k.merged is None:
        assert not m.fmt.h_low or not intmm.extension()  # the two static parts merge where both exist
        return
    assert not k.parts  # the layer keeps only the merged weight
    # both parts in one call (what the layer runs): the high part's levels then the low part's, each
    # run under its own part's scale
    w, cols, act_cols, _, run = k.merged
    kh = m.fmt.high_count(m.in_features)
    want = torch.cat([t.high[:, perm[:kh]], t.low[:, perm[kh:]]], 1)
    want_s = torch.cat([t.high_scale.expand(9, -1), t.low_scale.expand(9, -1)], 1)
    for name in isa.available_isas(intmm.extension()):
        with env_var(isa.ISA_ENV, name):
            q, sums, sa, qz = k.static_levels(x, "merged", w, act_cols, run)
        assert torch.equal(q[:, : m.in_features].float(), want), name
        assert torch.equal(sa.expand(9, -1), want_s[:, act_cols]), name
