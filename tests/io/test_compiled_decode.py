"""Compiled decode (modules/decode.py): ``enable_compiled_decode`` makes plain ``model.generate`` use a
static KV cache and one compiled decode graph (no graph break: the kernels are ``torch.library``
operators), with the same greedy tokens and logits as eager generate, and no recompilation per token."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from bitmosaic import quantize_
from bitmosaic.modules.base import QuantModule
from bitmosaic.modules.decode import disable_compiled_decode, enable_compiled_decode
from bitmosaic.testing import SPECIALS, VOCAB, tiny_llama

NEW = 24


def quantized_tiny(bits: int, runtime_act: str | None = None, group_size: int = 32):
    """The tiny Llama with weights scaled up (its greedy tokens then vary, so equal tokens mean something),
    RTN ``bits`` g32 (or ``group_size``), optionally with run-time activations; kernels built."""
    m = tiny_llama()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(8)
    calib = torch.randint(len(SPECIALS), VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    quantize_(m, "rtn", calib, bits=bits, group_size=group_size, progress=False)
    if runtime_act is not None:
        from bitmosaic.modules.intact import set_runtime_activations

        assert set_runtime_activations(m, runtime_act) > 0
    return m


def prompt(length: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randint(len(SPECIALS), VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _generate(m, ids):
    out = m.generate(
        ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
        output_logits=True,
    )  # fmt: skip
    return out.sequences, torch.stack(out.logits)


def test_generate_compiled_equals_eager():
    torch._dynamo.reset()
    m = quantized_tiny(4)
    ids = prompt()
    with torch.inference_mode():
        ref_tokens, ref_logits = _generate(m, ids)
        assert len(set(ref_tokens[0, ids.shape[1] :].tolist())) > NEW // 3  # a test that can fail
        enable_compiled_decode(m)
        assert m.generation_config.cache_implementation == "static"
        counters.clear()
        tokens, logits = _generate(m, ids)
        graphs = counters["stats"]["unique_graphs"]
        assert hasattr(m, "_compiled_call")  # generate took the compiled decode step
        assert graphs == 1, f"{graphs} graphs for {NEW} tokens (recompiles per token?)"
        assert not counters["graph_break"], dict(counters["graph_break"])
        tokens2, _ = _generate(m, ids)  # the same graph again: nothing new compiled
        assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(tokens, ref_tokens) and torch.equal(tokens2, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    disable_compiled_decode(m)
    assert m.generation_config.cache_implementation is None and not hasattr(m, "_compiled_call")


def test_from_pretrained_model_compiles_its_decode(tmp_path):
    """A folder loaded by transformers (bitmosaic's HfQuantizer) takes the compiled step too (the
    quantizer says it is compileable) and gives eager's tokens."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import quantized_dir

    torch._dynamo.reset()
    m = AutoModelForCausalLM.from_pretrained(quantized_dir(tmp_path / "q", tokenizer=False))
    assert m.hf_quantizer.is_compileable
    ids = prompt()
    with torch.inference_mode():
        ref, _ = _generate(m, ids)
        enable_compiled_decode(m)
        counters.clear()
        out, _ = _generate(m, ids)
    assert hasattr(m, "_compiled_call") and counters["stats"]["unique_graphs"] == 1
    assert torch.equal(out, ref)


def test_enable_compiled_decode_builds_kernels_first():
    m = quantized_tiny(4)
    enable_compiled_decode(m)
    mods = [x for x in m.modules() if isinstance(x, QuantModule)]
    assert mods and all(x._kernel for x in mods)


def test_enable_compiled_decode_rejects_a_non_generative_module():
    with pytest.raises(ValueError, match="needs a transformers causal LM"):
        enable_compiled_decode(torch.nn.Linear(4, 4))


def test_module_guards_skipped_but_each_model_runs_its_own_graph():
    """The default (``guards="model"``) skips dynamo's guards on the modules; two models of the same class
    then still run their own graphs (each has its own step: with the guards skipped and a shared code
    object the second would run the first one's graph and weights), and a run-time change made through
    bitmosaic (here the 8-bit head) compiles the step again instead of going unseen."""
    from bitmosaic.modules.head import set_runtime_head

    torch._dynamo.reset()
    models = {"w4": quantized_tiny(4), "w2": quantized_tiny(2)}
    ids = prompt()
    with torch.inference_mode():
        ref = {k: _generate(m, ids) for k, m in models.items()}
        assert not torch.equal(ref["w4"][0], ref["w2"][0])  # the two models differ: the check can fail
        for m in models.values():
            enable_compiled_decode(m)
        for k, m in models.items():
            tokens, logits = _generate(m, ids)
            assert torch.equal(tokens, ref[k][0]), k
            torch.testing.assert_close(logits, ref[k][1], rtol=1e-4, atol=1e-4)
        a = models["w4"]
        assert set_runtime_head(a, "int8")
        _, head_logits = _generate(a, ids)  # the compiled step, after the change
        disable_compiled_decode(a)
        _, eager_head_logits = _generate(a, ids)
    # the 8-bit head moves the logits by far more than inductor's float32 reassociation does
    assert (head_logits - ref["w4"][1]).abs().max() > 2e-2
    torch.testing.assert_close(head_logits, eager_head_logits, rtol=1e-4, atol=1e-3)


def test_full_guards_and_unknown_guards():
    m = quantized_tiny(4)
    with pytest.raises(ValueError, match="guards must be one of"):
        enable_compiled_decode(m, guards="none")
    torch._dynamo.reset()
    ids = prompt()
    with torch.inference_mode():
        ref, _ = _generate(m, ids)
        enable_compiled_decode(m, guards="full")
        assert not hasattr(m, "_compiled_call")  # transformers compiles self.__call__ on the first generate
        out, _ = _generate(m, ids)
    assert torch.equal(out, ref) and hasattr(m, "_compiled_call")


def test_enable_compiled_decode_refuses_a_mixture_of_experts_in_one_line():
    """Routing picks experts per token (a data-dependent loop), which no static graph holds: refused
    before anything changes, and eager generate still works."""
    from bitmosaic.modules.experts import unfuse_experts
    from bitmosaic.testing import tiny_moe

    model = tiny_moe("qwen3_moe")
    unfuse_experts(model)
    with pytest.raises(ValueError, match="mixture of experts") as e:
        enable_compiled_decode(model)
    assert "\n" not in str(e.value) and model.generation_config.cache_implementation is None
    out = model.generate(torch.tensor([[5, 9, 17]]), max_new_tokens=2, do_sample=False)
    assert out.shape[1] == 5
