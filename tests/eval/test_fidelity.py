"""KL divergence and top-1 agreement against a reference model, in the perplexity pass."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

from bitmosaic.errors import NonFiniteError
from bitmosaic.eval import fidelity, perplexity
from bitmosaic.eval.fidelity import FidelityMeter, token_kl, token_nll
from tests.eval.test_perplexity import NextTokenLM, TinyLM, UniformLM, V, counting


def test_token_kl_matches_torch_kl_div():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 5, 11, generator=g), torch.randn(3, 5, 11, generator=g)
    ours = token_kl(a, b)
    # torch's kl_div(input=log q, target=log p, log_target=True) is sum p (log p - log q)
    ref = F.kl_div(F.log_softmax(b, -1), F.log_softmax(a, -1), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert torch.all(token_kl(a, a) < 1e-6)


def test_token_kl_shape_mismatch_is_one_clear_error():
    with pytest.raises(ValueError, match="vocabulary"):
        token_kl(torch.zeros(2, 5), torch.zeros(2, 6))


@pytest.mark.parametrize("chunk", [1 << 22, 64, 11])  # one chunk per window, 7 rows, 1 row
def test_chunked_scores_equal_one_pass_bit_for_bit(monkeypatch, chunk):
    """token_nll / token_kl work over chunks of positions (issue 73: a 262k vocabulary's whole-window
    temporaries cost more in page faults than in arithmetic); every score must equal the one-pass
    F.cross_entropy / log-softmax KL exactly, on strided batches (logits[:, :-1]) and flat rows."""
    monkeypatch.setattr(fidelity, "CHUNK_ELEMENTS", chunk * 7)
    g = torch.Generator().manual_seed(3)
    V = 7 * 9
    ref, q = torch.randn(3, 12, V, generator=g) * 4, torch.randn(3, 12, V, generator=g) * 4
    target = torch.randint(0, V, (3, 11), generator=g)
    x, r = q[:, :-1], ref[:, :-1]  # strided, as window_nll slices them
    one_nll = F.cross_entropy(x.reshape(-1, V), target.reshape(-1), reduction="none").view(target.shape)
    lp, lq = F.log_softmax(r, -1), F.log_softmax(x, -1)
    one_kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)
    assert torch.equal(token_nll(x, target), one_nll)
    assert torch.equal(token_kl(r, x), one_kl)
    assert torch.equal(token_kl(r.reshape(-1, V), x.reshape(-1, V)), one_kl.reshape(-1))
    with pytest.raises(ValueError, match="targets"):
        token_nll(x, target[:, :-1])


def test_meter_summary_against_numpy():
    g = torch.Generator().manual_seed(2)
    m = FidelityMeter()
    kls, agree, n = [], 0, 0
    for _ in range(3):
        a, b = torch.randn(2, 7, 13, generator=g), torch.randn(2, 7, 13, generator=g)
        m.update(a, b)
        pa, pb = np.exp(a.double().numpy()), np.exp(b.double().numpy())
        pa, pb = pa / pa.sum(-1, keepdims=True), pb / pb.sum(-1, keepdims=True)
        kls.append((pa * (np.log(pa) - np.log(pb))).sum(-1).ravel())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        n += 14
    kl = np.concatenate(kls)
    s = m.summary()
    assert s["compared_tokens"] == n
    assert s["kl_mean"] == pytest.approx(kl.mean(), rel=1e-5)
    assert s["kl_p99"] == pytest.approx(np.percentile(kl, 99), rel=1e-5)
    assert s["top1_agreement"] == pytest.approx(agree / n)


def test_perplexity_with_itself_as_reference_is_zero_kl_full_agreement():
    model = TinyLM()
    r = perplexity(model, counting(200), 16, progress=False, reference=TinyLM())
    assert r["kl_mean"] < 1e-6 and r["kl_p99"] < 1e-6
    assert r["top1_agreement"] == 1.0
    assert r["compared_tokens"] == r["tokens"] == 12 * 15


@pytest.mark.parametrize("bos", [None, 0])
def test_perplexity_kl_uniform_model_against_sharp_reference(bos):
    """Reference: next token with probability ~1; model: uniform.  KL = log V - H(p) per token."""
    r = perplexity(UniformLM(), counting(400), 20, progress=False, reference=NextTokenLM(), bos_token_id=bos)
    p = torch.softmax(torch.tensor([30.0] + [-30.0] * (V - 1), dtype=torch.float64), 0)
    expected = float((p * (p.log() + math.log(V))).sum())
    assert r["kl_mean"] == pytest.approx(expected, rel=1e-4)
    assert r["compared_tokens"] == r["tokens"]
    # uniform logits: argmax is token 0, which the reference predicts only after token V-1
    assert 0.0 < r["top1_agreement"] < 0.1
    assert r["ppl"] == pytest.approx(V, rel=1e-5)


def test_perplexity_without_reference_has_no_fidelity_keys():
    r = perplexity(TinyLM(), counting(100), 16, progress=False)
    assert "kl_mean" not in r


def test_meter_state_continues_in_a_new_meter():
    """Half the batches, state saved and restored, then the rest: the same summary as one meter."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(2, 7, 13, generator=g), torch.randn(2, 7, 13, generator=g)) for _ in range(4)]
    whole, first = FidelityMeter(), FidelityMeter()
    for ref, q in batches:
        whole.update(ref, q)
    for ref, q in batches[:2]:
        first.update(ref, q)
    rest = FidelityMeter.from_state(first.state())
    for ref, q in batches[2:]:
        rest.update(ref, q)
    assert rest.summary() == whole.summary()
    assert FidelityMeter.from_state(FidelityMeter().state()).state()["count"] == 0
    bad = first.state()
    bad["count"] += 1
    with pytest.raises(ValueError, match="KL values"):
        FidelityMeter.from_state(bad)


class _BadReference(nn.Module):
    """NextTokenLM whose logits hold one ``value`` at one position of the batch's second window."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, input_ids, **kwargs):
        logits = NextTokenLM()(input_ids).logits
        if input_ids.shape[0] > 1:
            logits[1, 3, 5] = self.value
        return CausalLMOutput(logits=logits)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_reference_logit_is_one_error_naming_the_window(value):
    """Any NaN or Inf among the reference's logits -- even one -Inf, which leaves its top-1 and its
    softmax elsewhere intact -- stops the pass with the window named, not a NaN in the summary."""
    with pytest.raises(NonFiniteError, match=r"the reference model's outputs on evaluation window 2 of 12"):
        perplexity(TinyLM(), counting(200), 16, progress=False, reference=_BadReference(value), batch_size=4)
