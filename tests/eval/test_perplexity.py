"""bitmosaic.eval.perplexity on tiny models whose perplexity is known in closed form."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

from bitmosaic.eval import perplexity

V = 37


class UniformLM(nn.Module):
    """Logits all equal: every token has probability 1/V, so the perplexity is exactly V."""

    def __init__(self, vocab=V):
        super().__init__()
        self.vocab = vocab
        self.calls = []

    def forward(self, input_ids, **kwargs):
        self.calls.append((tuple(input_ids.shape), kwargs, self.training, torch.is_inference_mode_enabled()))
        return CausalLMOutput(logits=torch.zeros(*input_ids.shape, self.vocab))


class NextTokenLM(nn.Module):
    """Predicts ``(x + 1) % V`` with a huge margin: perfect on a counting sequence (perplexity ~ 1)."""

    def forward(self, input_ids, **kwargs):
        logits = torch.full((*input_ids.shape, V), -30.0)
        logits.scatter_(-1, ((input_ids + 1) % V).unsqueeze(-1), 30.0)
        return CausalLMOutput(logits=logits)


class TinyLM(nn.Module):
    """A small random model (embedding, causal mean of the prefix, head); bfloat16 logits optional."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Parameter(torch.randn(V, 8, generator=g))
        self.head = nn.Parameter(torch.randn(8, V, generator=g))
        self.dtype = dtype

    def forward(self, input_ids, **kwargs):
        h = self.emb[input_ids].cumsum(1) / torch.arange(1, input_ids.shape[1] + 1)[None, :, None]
        return CausalLMOutput(logits=(h @ self.head).to(self.dtype))


def counting(n):
    return (torch.arange(n) % V).unsqueeze(0)


def reference_ppl(model, tokens, seqlen, windows):
    """Window by window, the obvious way."""
    total, count = 0.0, 0
    with torch.no_grad():
        for w in range(windows):
            x = tokens[:, w * seqlen : (w + 1) * seqlen]
            logits = model(x).logits.float()
            total += F.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum").item()
            count += seqlen - 1
    return math.exp(total / count)


def test_uniform_model_ppl_is_vocab_size():
    res = perplexity(UniformLM(), torch.randint(0, V, (1, 1000)), seqlen=100, progress=False)
    assert res["ppl"] == pytest.approx(V, rel=1e-6)
    assert res["nll"] == pytest.approx(math.log(V), rel=1e-6)
    assert res["windows"] == 10 and res["seqlen"] == 100
    assert res["tokens"] == 10 * 99


def test_perfect_model_ppl_is_one():
    res = perplexity(NextTokenLM(), counting(640), seqlen=64, progress=False)
    assert res["ppl"] == pytest.approx(1.0, abs=1e-6)
    assert res["windows"] == 10 and res["tokens"] == 10 * 63


def test_windows_are_independent_and_the_tail_dropped():
    """A window's first token is never predicted (no context carried over); the tail is not scored."""
    tokens = counting(1050)
    tokens[0, ::100] = (tokens[0, ::100] + 5) % V  # break the count at every window start only
    tokens[0, 1000:] = 0  # tail after 10 full windows: not scored
    res = perplexity(NextTokenLM(), tokens, seqlen=100, progress=False)
    # the broken token at a window start is context only; the token after it is then mispredicted:
    # one miss per window of 99 predictions, -log p = 60 + log1p(...) (target at -30, winner at +30)
    miss = math.log1p((V - 1) * math.exp(-60.0)) + 60.0
    assert res["windows"] == 10
    assert res["nll"] == pytest.approx(miss / 99, rel=1e-5)


def test_max_windows():
    model = UniformLM()
    tokens = torch.randint(0, V, (1, 1000))
    res = perplexity(model, tokens, seqlen=100, max_windows=3, progress=False)
    assert res["windows"] == 3 and res["tokens"] == 3 * 99
    assert len(model.calls) == 3
    res = perplexity(model, tokens, seqlen=100, max_windows=50, progress=False)
    assert res["windows"] == 10
    with pytest.raises(ValueError, match="max_windows"):
        perplexity(model, tokens, seqlen=100, max_windows=0, progress=False)


def test_matches_reference_and_batch_size_invariant():
    model = TinyLM()
    tokens = torch.randint(0, V, (1, 10 * 48 + 17), generator=torch.Generator().manual_seed(1))
    ref = reference_ppl(model, tokens, 48, 10)
    for bs in (1, 3, 10, 64):
        res = perplexity(model, tokens, seqlen=48, batch_size=bs, progress=False)
        assert res["ppl"] == pytest.approx(ref, rel=1e-5)
        assert res["windows"] == 10 and res["tokens"] == 10 * 47
    assert 1.0 < ref < 10 * V


def test_low_precision_logits_scored_in_float32():
    res = perplexity(TinyLM(dtype=torch.bfloat16), torch.randint(0, V, (1, 300)), seqlen=50, progress=False)
    assert math.isfinite(res["ppl"]) and res["windows"] == 6


def test_model_call_contract():
    model = UniformLM()
    model.train()
    perplexity(model, torch.randint(0, V, (1, 250)), seqlen=50, batch_size=2, progress=False)
    shapes = [c[0] for c in model.calls]
    assert shapes == [(2, 50), (2, 50), (1, 50)]
    assert all(c[1] == {"use_cache": False} for c in model.calls)
    assert all(not c[2] for c in model.calls)  # eval mode during the evaluation
    assert all(c[3] for c in model.calls)  # under torch.inference_mode
    assert model.training  # training mode restored afterwards


def test_accepts_1d_tokens_and_progress_bar():
    res = perplexity(UniformLM(), torch.randint(0, V, (200,)), seqlen=50, progress=True)
    assert res["windows"] == 4 and res["ppl"] == pytest.approx(V, rel=1e-6)


def test_too_few_tokens():
    with pytest.raises(ValueError, match="fewer than one window"):
        perplexity(UniformLM(), torch.randint(0, V, (1, 99)), seqlen=100, progress=False)
    res = perplexity(UniformLM(), torch.randint(0, V, (1, 100)), seqlen=100, progress=False)
    assert res["windows"] == 1 and res["tokens"] == 99


def test_bad_arguments():
    tokens = torch.randint(0, V, (1, 100))
    with pytest.raises(ValueError, match="seqlen"):
        perplexity(UniformLM(), tokens, seqlen=1, progress=False)
    with pytest.raises(ValueError, match=r"\[1, N\]"):
        perplexity(UniformLM(), tokens.expand(2, 100), seqlen=10, progress=False)


class MoveSpy(nn.Module):
    """A model whose ``.to`` is recorded and moves nothing (e.g. weights held outside parameters)."""

    def __init__(self, fail_on=None):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.moves = []
        self.fail_on = fail_on

    def to(self, device):
        self.moves.append(str(device))
        if str(device) == self.fail_on:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self

    def forward(self, input_ids, **kwargs):
        return CausalLMOutput(logits=torch.zeros(*input_ids.shape, V))


def test_device_moves_the_model_there_and_back(monkeypatch):
    import sys

    mod = sys.modules["bitmosaic.eval.perplexity"]
    monkeypatch.setattr(mod, "_model_device", lambda m: torch.device("cuda"))  # the model "lives" on cuda
    model = MoveSpy()
    res = perplexity(model, torch.randint(0, V, (1, 200)), seqlen=50, progress=False, device="cpu")
    assert res["ppl"] == pytest.approx(V, rel=1e-6)
    assert model.moves == ["cpu", "cuda"]  # moved once for the evaluation, once back; no recursion


def test_device_out_of_memory_is_a_clear_error(monkeypatch):
    from bitmosaic.errors import DeviceError

    model = MoveSpy(fail_on="cuda")
    with pytest.raises(DeviceError, match="does not fit on cuda.*--device cpu"):
        perplexity(model, torch.randint(0, V, (1, 200)), seqlen=50, progress=False, device="cuda")
    assert model.moves == ["cuda", "cpu"]  # put back where it was


def test_per_window_nll_is_each_windows_mean_nll():
    """``per_window=True`` keeps each window's mean NLL, in window order and independent of the batch
    size: their mean is the result's NLL, and each equals the window scored alone (the input of a paired
    bootstrap, :func:`bitmosaic.eval.bootstrap.bootstrap_ratio`)."""
    model = TinyLM()
    tokens = torch.randint(0, V, (1, 6 * 40), generator=torch.Generator().manual_seed(2))
    plain = perplexity(model, tokens, seqlen=40, progress=False)
    assert "window_nll" not in plain  # only on request
    for bs in (1, 4):
        res = perplexity(model, tokens, seqlen=40, batch_size=bs, progress=False, per_window=True)
        assert len(res["window_nll"]) == 6
        assert sum(res["window_nll"]) / 6 == pytest.approx(res["nll"], rel=1e-12)
        for w, got in enumerate(res["window_nll"]):
            alone = math.log(reference_ppl(model, tokens[:, w * 40 : (w + 1) * 40], 40, 1))
            assert got == pytest.approx(alone, rel=1e-5)
