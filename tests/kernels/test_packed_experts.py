"""Packed experts (issue 71, item 3): a MoE projection's experts over one stacked storage compute what the
per-expert modules compute, bit for bit; the saved folder keeps the per-expert names and bytes."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.kernels import lut
from bitmosaic.kernels.select import select_kernel
from bitmosaic.modules import QuantLinear, QuantModule, full_layer_config, module_from_layer_config
from bitmosaic.modules.base import resident_bytes
from bitmosaic.modules.experts import RoutedExperts
from bitmosaic.modules.packed_experts import (
    PackedRoutedExperts,
    pack_experts,
    packed_experts_report,
    runs_stacked,
)

E, K, H = 4, 2, 32  # experts, top-k, hidden size of the tiny qwen3_moe


def tiny_moe(seed: int = 0):
    """A tiny random qwen3_moe from transformers' own config (2 layers, 4 experts, top-2)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(
        "qwen3_moe", hidden_size=H, intermediate_size=64, num_hidden_layers=2, vocab_size=128,
        num_attention_heads=4, num_key_value_heads=2, num_experts=E, num_experts_per_tok=K,
        moe_intermediate_size=16, head_dim=8,
    )  # fmt: skip
    m = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.ndim >= 2 or "bias" in n:
                p.normal_(0, 0.1)
    return m


def _calib() -> torch.Tensor:
    return torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))


def _quantized(method: str, **options):
    import bitmosaic

    model = tiny_moe()
    bitmosaic.quantize_(model, method, _calib(), progress=False, **options)
    assert not any(type(m) is PackedRoutedExperts for _, m in _experts(model))  # packing is asked for
    assert pack_experts(model) == 2
    return model


@pytest.fixture(scope="module")
def gptq():
    """The tiny qwen3_moe after GPTQ w4 g16, its experts packed (``pack_experts``)."""
    return _quantized("gptq", bits=4, group_size=16)


def unpacked(model):
    """A copy of ``model`` whose experts are plain :class:`RoutedExperts` of fresh per-expert modules
    rebuilt from their saved configs and tensors (own kernels, nothing shared with the stack)."""
    ref = copy.deepcopy(model)
    for name, m in list(ref.named_modules()):
        if isinstance(m, PackedRoutedExperts):
            for mlp in m:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    old = getattr(mlp, proj)
                    new = module_from_layer_config(full_layer_config(old))
                    new.load_state_dict(old.state_dict())
                    setattr(mlp, proj, new)
            ref.set_submodule(name, RoutedExperts(list(m), m.fused_class))
    return ref


def _experts(model) -> list[tuple[str, RoutedExperts]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedExperts)]


def test_the_pipeline_packs_every_moe_layer(gptq):
    layers = _experts(gptq)
    assert len(layers) == 2 and all(type(m) is PackedRoutedExperts for _, m in layers)
    for _, m in layers:
        assert set(m.packed) == {"gate_proj", "up_proj", "down_proj"}
        for proj, pe in m.packed.items():
            mods = [getattr(mlp, proj) for mlp in m]
            assert all(type(q) is QuantLinear for q in mods)  # the per-expert modules stay
            assert pe.expert_config() == mods[0].layer_config()
            for e, q in enumerate(mods):  # each expert's kernel is a row of the stack (no copy)
                assert q._kernel is pe._kernel[e]
                for path, stack in pe._kernel.stacks.items():  # whichever kernel the selector built
                    field = functools.reduce(getattr, path, q._kernel)
                    assert field.data_ptr() == stack[e].data_ptr(), path
                assert torch.equal(pe.qweight[e], q.qweight) and torch.equal(pe.scales[e], q.scales)
                x = torch.randn(3, q.in_features)
                assert runs_stacked(q, pe._kernel[e])  # the packed forward takes the stacked row itself
                assert torch.equal(pe(x, e), q(x))
            w = pe.dequantize_reference()
            assert torch.equal(w, torch.stack([q.dequantize_reference() for q in mods]))
            assert torch.equal(pe._dequantize(torch.float32), w)
            assert pe.bits_per_weight() == pytest.approx(mods[0].bits_per_weight())


@pytest.mark.parametrize("tokens", [1, 32])  # decode, prefill
def test_packed_equals_per_expert_modules(gptq, tokens):
    ref = unpacked(gptq)
    assert not _experts(ref) or all(type(m) is RoutedExperts for _, m in _experts(ref))
    ids = torch.randint(0, 128, (2, tokens), generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        assert torch.equal(gptq(ids).logits, ref(ids).logits)
    g = torch.Generator().manual_seed(7)
    for (_, pm), (_, rm) in zip(_experts(gptq), _experts(ref), strict=True):
        h = torch.randn(tokens, H, generator=g)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
        w = torch.rand(tokens, K, generator=g).softmax(-1)
        with torch.no_grad():
            assert torch.equal(pm(h, idx, w), rm(h, idx, w))


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 70),
    pool=st.lists(st.integers(0, E), min_size=1, max_size=E, unique=True),  # E: a masked-out slot
    seed=st.integers(0, 2**16),
    bf16=st.booleans(),
)
def test_random_selections_match(gptq, tokens, pool, seed, bf16):
    """Any selection, experts with no tokens and masked slots included, in float32 and bfloat16."""
    global _REF
    if _REF is None:
        _REF = unpacked(gptq)
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    choice = torch.tensor(pool)[torch.randint(0, len(pool), (tokens, K), generator=g)]
    h = torch.randn(tokens, H, generator=g).to(dtype)
    w = torch.rand(tokens, K, generator=g).to(dtype)
    for (_, pm), (_, rm) in zip(_experts(gptq), _experts(_REF), strict=True):
        with torch.no_grad():
            got, want = pm(h, choice, w), rm(h, choice, w)
        assert got.dtype == dtype and torch.equal(got, want)


_REF = None


def test_kernel_selection_reports(gptq):
    """The report names the kernel select_kernel picks for the packed kind (w4 g16: the bit-plane LUT
    where it is compiled, LowBitWeight pads groups under 64), the stack's bytes are the experts'
    kernels' bytes, and resident memory holds one copy."""
    rep = packed_experts_report(gptq)
    assert set(rep) == {f"model.layers.{i}.mlp.experts" for i in range(2)}
    want = select_kernel(QuantLinear.KERNELS, 4, group_size=16).KERNEL_NAME
    for name, projs in rep.items():
        m = gptq.get_submodule(name)
        for proj, r in projs.items():
            assert r["kernel"] == want == ("lut" if lut.extension() is not None else "lowbit")
            assert r["experts"] == E and not r["int_act"]
            assert r["bytes"] == sum(getattr(mlp, proj)._kernel.nbytes() for mlp in m)
    ref = unpacked(gptq)
    for m in ref.modules():
        if isinstance(m, QuantModule):
            m.kernel()
    assert resident_bytes(gptq) == resident_bytes(ref)
    assert pack_experts(ref) == 2  # kernels built (saved buffers released) before packing: packed too
    assert resident_bytes(gptq) == resident_bytes(ref)
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, gptq(ids).logits)


def test_two_bit_experts_stack_the_selected_kernel():
    """At 2 bits the kind's preferred kernel (the bit-plane LUT when compiled) is what gets stacked."""
    model = _quantized("rtn", bits=2, group_size=16)
    want = select_kernel(QuantLinear.KERNELS, 2, group_size=16).KERNEL_NAME
    kernels = {r["kernel"] for projs in packed_experts_report(model).values() for r in projs.values()}
    assert kernels == {want}
    ref = unpacked(model)
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_integer_activation_experts_stack_their_int_kernels():
    """W4A8: each expert's integer-activation kernel is stacked too, and the output is unchanged."""
    model = _quantized("rtn", scheme="W4A8", group_size=16)
    projs = [r for p in packed_experts_report(model).values() for r in p.values()]
    assert projs and all(r["int_act"] for r in projs)
    ref = unpacked(model)
    for ids in (torch.randint(0, 128, (1, 1)), torch.randint(0, 128, (2, 20))):
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits)


def test_fallbacks_keep_the_output(gptq):
    """A hook on an expert module runs (its module's own forward), and a cast drops the stack (the
    experts then run one by one) without changing what is computed."""
    model = copy.deepcopy(gptq)
    ref = unpacked(gptq)
    ids = torch.randint(0, 128, (1, 5))
    seen = []
    q = model.model.layers[0].mlp.experts[1].up_proj
    handle = q.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    with torch.no_grad():
        want = ref(ids).logits
        for _ in range(3):
            ids2 = torch.randint(0, 128, (1, 16))
            assert torch.equal(model(ids2).logits, ref(ids2).logits)
    assert seen  # 16 tokens over 4 experts: expert 1 got some
    handle.remove()
    model.float()
    assert all(not m.packed for _, m in _experts(model))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    assert pack_experts(model) == 0  # already PackedRoutedExperts: pack_experts leaves them


def test_save_load_round_trip(gptq, tmp_path):
    """The folder holds the per-expert names and bytes of the unpacked model; a load gives per-expert
    modules, which pack again."""
    from safetensors.torch import load_file

    from bitmosaic.io import load_quantized, save_quantized

    a = save_quantized(gptq, tmp_path / "packed", {"method": "gptq"})
    b = save_quantized(unpacked(gptq), tmp_path / "plain", {"method": "gptq"})
    sa, sb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert sa.keys() == sb.keys() and "model.layers.0.mlp.experts.3.down_proj.qweight" in sa
    assert all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)
    ca = json.loads((a / "config.json").read_text())["quantization_config"]["modules"]
    cb = json.loads((b / "config.json").read_text())["quantization_config"]["modules"]
    assert ca == cb and "model.layers.1.mlp.experts.0.gate_proj" in ca
    loaded, _ = load_quantized(a, load_tokenizer=False)
    assert _experts(loaded) and not any(type(m) is PackedRoutedExperts for _, m in _experts(loaded))
    assert pack_experts(loaded) == 2
    assert all(type(m) is PackedRoutedExperts for _, m in _experts(loaded))
    ids = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, gptq(ids).logits)
