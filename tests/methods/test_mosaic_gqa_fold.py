"""MosaicQuant smooths ``o_proj`` under grouped-query attention (issue 73): one factor per ``v_proj`` row,
shared by the query heads of its key-value head, folded into ``v_proj``.  The float model must compute the
same logits after the folds (checked against transformers' own attention, on a tiny GQA Llama, a
SmolLM2-shaped one with 9 query and 3 key-value heads, and a tiny Gemma 3 whose norms multiply by
``1 + w``), factors that differ between the heads of one group are refused, and W4A8 runs end to end."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from bitmosaic import quantize_
from bitmosaic.algorithms.smooth import gqa_channel_map, smooth_scales
from bitmosaic.methods import get_method
from bitmosaic.models.arch import get_arch
from bitmosaic.pipeline.capture import gqa_tie
from bitmosaic.pipeline.smoothing import fold_group_scales
from tests.helpers import transform_every_layer

A8 = {"fmt": "int", "bits": 8}


def _outliers(m, norms, seed, offset=0.0):
    """Non-trivial norm weights with a few outlier channels, as in real models (``offset``: the norm
    multiplies by ``offset + w``)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in m.model.layers:
            for name in norms:
                w = layer.get_submodule(name).weight
                scale = torch.rand(w.shape[0], generator=g) + 0.5
                scale[:2] *= 20
                w.copy_(scale - offset)
            v = layer.self_attn.v_proj.weight
            v[: v.shape[0] // 8] *= 8  # outlier channels at o_proj's input
    return m


def llama(heads=4, kv=2, hidden=64, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64,
        tie_word_embeddings=True,
    )  # fmt: skip
    return _outliers(LlamaForCausalLM(cfg).eval(), ("input_layernorm", "post_attention_layernorm"), seed)


def smollm2_shaped(seed=0):
    """SmolLM2-135M's attention shape (hidden 576, 9 query heads of 64, 3 key-value heads), one layer."""
    return llama(heads=9, kv=3, hidden=576, layers=1, seed=seed)


def gemma3(seed=0):
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, sliding_window=16,
    )  # fmt: skip
    norms = ("input_layernorm", "post_attention_layernorm")
    norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    return _outliers(Gemma3ForCausalLM(cfg).eval(), norms, seed, offset=1.0)


MODELS = {"llama-4q-2kv": llama, "smollm2-9q-3kv": smollm2_shaped, "gemma3-4q-1kv": gemma3}
CALIB = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
IDS = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))


def _logits(m):
    with torch.inference_mode():
        return m(IDS).logits.double()


def test_channel_map_is_transformers_repeat_kv():
    """Query head ``h`` reads key-value head ``h // rep``: the map equals transformers' ``repeat_kv``
    applied to the channel indices of ``v`` ([n_kv, head_dim] per token)."""
    from transformers.models.llama.modeling_llama import repeat_kv

    for n_q, n_kv, hd in ((4, 2, 16), (9, 3, 64), (4, 1, 16), (8, 8, 4)):
        v = torch.arange(n_kv * hd).view(1, n_kv, 1, hd)  # [batch, kv heads, seq, head_dim]
        want = repeat_kv(v, n_q // n_kv).reshape(-1)  # o_proj's input order: head-major
        assert torch.equal(gqa_channel_map(n_q * hd, n_kv * hd, hd), want)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fold_of_shared_factors_keeps_float_logits(name):
    """Random factors shared per key-value head channel folded into ``o_proj``/``v_proj`` of every layer:
    the logits of transformers' forward do not move; factors that differ between two query heads of
    one group are refused (they could not be folded)."""
    m = MODELS[name]().double()
    ref = _logits(m)
    arch = get_arch(m)
    g = torch.Generator().manual_seed(3)
    for layer in arch.layers(m):
        tie = gqa_tie(layer, arch, 1)
        assert tie is not None
        t = torch.rand(int(tie.max()) + 1, generator=g, dtype=torch.float64) * 4 + 0.1
        v_before = layer.self_attn.v_proj.weight.clone()
        fold_group_scales(layer, arch, 1, t[tie])
        assert not torch.equal(layer.self_attn.v_proj.weight, v_before)
        bad = t[tie].clone()
        bad[0] *= 2  # first query head only: its key-value head's other query heads keep the old factor
        with pytest.raises(ValueError, match="differ within a group"):
            fold_group_scales(copy.deepcopy(layer), arch, 1, bad)
    torch.testing.assert_close(_logits(m), ref, rtol=1e-5, atol=1e-6)  # the fold computes in float32


def _transform_all(m, **opts):
    """MosaicQuant's transform (the alpha search and every fold, no quantization) on each float layer."""
    spec = get_method("mosaic")
    return transform_every_layer(m, spec, spec.make_config(act=A8, block="32x32", **opts), CALIB)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_mosaic_smoothing_keeps_float_logits(name):
    """The method's own factors (searched alpha, every group incl. GQA ``o_proj``; Gemma 3: norms of
    ``1 + w``) folded into the float model leave its logits unchanged."""
    m = MODELS[name]()
    ref = _logits(m)
    before = copy.deepcopy(m.state_dict())
    infos = _transform_all(m, alpha_grid=(0.5, 1.0))
    torch.testing.assert_close(_logits(m), ref, rtol=2e-4, atol=2e-4)
    for info in infos:
        assert all(info[gi]["folded"] for gi in range(4)), info
        assert info[1].get("shared_by_heads") is True
    changed = {k.split(".")[-2] for k, v in m.state_dict().items() if not torch.equal(v, before[k])}
    assert {"v_proj", "o_proj", "input_layernorm"} <= changed


def test_fold_o_proj_off_keeps_the_old_behaviour():
    m = llama()
    infos = _transform_all(m, alpha_grid=(0.5,), fold_o_proj=False)
    unfolded = [i[1]["folded"] is False and i[1]["reason"] == "no foldable preceding op" for i in infos]
    assert all(unfolded)
    assert all(info[0]["folded"] for info in infos)


def test_w4a8_end_to_end_on_smollm2_shape():
    """Quantized W4A8 MosaicQuant on the SmolLM2-shaped GQA model: every o_proj smoothed and folded, the
    quantized logits finite and near the float ones."""
    m = smollm2_shaped()
    ref = _logits(m)
    rep = quantize_(m, "mosaic", CALIB, scheme="W4A8", block="64x64", alpha_grid=(0.5, 0.8), progress=False)
    rows = {r["name"].split(".")[-1]: r for r in rep.layers}
    assert rows["o_proj"]["transform"]["folded"] is True
    assert rows["o_proj"]["transform"]["alpha"] in (0.5, 0.8)
    out = _logits(m)
    assert torch.isfinite(out).all()
    assert 0 < float((out - ref).norm() / ref.norm()) < 0.5


def test_shared_factors_are_the_formula_on_the_merged_channel():
    """``tie``: one factor per class from the class's largest ``max|X|`` and ``max|W|``."""
    tie = gqa_channel_map(8, 4, 2)  # 4 query heads of 2 over 2 key-value heads of 2
    a = torch.arange(1.0, 9.0)
    W = torch.ones(3, 8) * torch.linspace(0.5, 2.0, 8)
    s = smooth_scales(a, [W], 0.5, tie=tie)
    for k in range(4):
        cols = (tie == k).nonzero().flatten()
        want = a[cols].max().sqrt() / W[:, cols].abs().max().sqrt()
        assert torch.allclose(s[cols], want.expand(len(cols)))
