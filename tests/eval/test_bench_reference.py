"""The harness's cached float reference (``benchmarks/harness/float_reference.py``): a verdict run's
later rows re-apply only the output head to the reference's kept hidden states; KL, top-1 and
perplexity come out exactly as with the whole model, and the cache follows the reference's weights."""

from __future__ import annotations

import copy

import torch

from benchmarks import harness as common
from bitmosaic.eval.perplexity import perplexity
from tests.helpers import tiny_llama


def _ids(n: int = 200, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def test_cached_reference_gives_the_whole_models_numbers():
    ref = tiny_llama()
    quant = copy.deepcopy(ref)
    with torch.no_grad():
        for p in quant.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    ids = _ids()
    want = perplexity(quant, ids, 32, reference=ref, progress=False)
    cached = common.CachedReference(ref)
    first = perplexity(quant, ids, 32, reference=cached, progress=False)
    assert cached.exact is True and len(cached.hidden) == want["windows"]
    again = perplexity(quant, ids, 32, reference=cached, progress=False)  # from the kept hidden states
    for r in (first, again):
        assert r["ppl"] == want["ppl"] and r["kl_mean"] == want["kl_mean"]
        assert r["top1_agreement"] == want["top1_agreement"]
    assert want["kl_mean"] > 0


def test_cached_reference_follows_an_in_place_change():
    ref = tiny_llama()
    cached = common.CachedReference(ref)
    batch = _ids(32)
    with torch.inference_mode():
        before = cached(batch).logits
        with torch.no_grad():
            ref.lm_head.weight.mul_(2)
            ref.model.layers[0].mlp.down_proj.weight.mul_(0.5)
        after = cached(batch).logits
        assert torch.equal(after, ref(batch, use_cache=False).logits)
    assert not torch.equal(before, after)


def test_cached_reference_runs_the_whole_model_where_the_head_alone_differs():
    ref = tiny_llama()

    def cap(module, args, out):  # a full forward that does more than head(base) (Gemma-2's softcap)
        out.logits = 5.0 * torch.tanh(out.logits / 5.0)
        return out

    ref.register_forward_hook(cap)
    cached = common.CachedReference(ref)
    batch = _ids(32)
    with torch.inference_mode():
        out = cached(batch).logits
        assert cached.exact is False and not cached.hidden
        assert torch.equal(out, ref(batch, use_cache=False).logits)


def test_the_float_row_fills_the_reference_cache_with_the_same_numbers():
    """A verdict run's float row goes through the cached reference: its perplexity is the whole model's
    and the first quantized row after it already finds every window's hidden states."""
    ref = tiny_llama()
    ids = _ids()
    bench = common.Bench.__new__(common.Bench)
    bench.model, bench.tok, bench.eval_ids, bench.device = ref, None, ids, "cpu"
    bench.args = type("A", (), {"seqlen": 32, "max_windows": None})()
    bench.reference = common.CachedReference(ref)
    row = bench.measure(ref)
    want = perplexity(ref, ids, 32, progress=False)
    assert row["ppl"] == want["ppl"] and row["kl_mean"] == 0.0 and row["top1_agreement"] == 1.0
    assert len(bench.reference.hidden) == want["windows"]


def test_a_stored_reference_gives_the_same_numbers_in_the_next_run(tmp_path):
    """With a store, the next run's reference (a fresh object, as in a new process) reads every window
    back from disk instead of running the decoder, and KL, top-1 and perplexity stay bit for bit."""
    ref, quant = tiny_llama(), tiny_llama()
    with torch.no_grad():
        for p in quant.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    ids = _ids()
    want = perplexity(quant, ids, 32, reference=ref, progress=False)
    first = common.CachedReference(ref, tmp_path)
    perplexity(quant, ids, 32, reference=first, progress=False)
    assert first.loaded == 0
    second = common.CachedReference(copy.deepcopy(ref), tmp_path)
    calls = []
    second.inner.get_decoder().register_forward_hook(lambda *a: calls.append(1))
    got = perplexity(quant, ids, 32, reference=second, progress=False)
    assert second.loaded == want["windows"] and not calls  # every window from disk, no decoder run
    assert got["ppl"] == want["ppl"] and got["kl_mean"] == want["kl_mean"]
    assert got["top1_agreement"] == want["top1_agreement"]
    # other weights are another folder: nothing of the first model's is read for them
    other = copy.deepcopy(ref)
    with torch.no_grad():
        other.lm_head.weight.mul_(1.5)
    third = common.CachedReference(other, tmp_path)
    out = perplexity(quant, ids, 32, reference=third, progress=False)
    assert third.loaded == 0 and out["kl_mean"] != want["kl_mean"]
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_stored_reference_remembers_that_the_head_alone_differs(tmp_path):
    ref = tiny_llama()
    ref.register_forward_hook(lambda m, a, out: setattr(out, "logits", 5.0 * torch.tanh(out.logits / 5.0)))
    batch = _ids(32)
    with torch.inference_mode():
        common.CachedReference(ref, tmp_path)(batch)
        again = common.CachedReference(ref, tmp_path)
        out = again(batch).logits
    assert again.exact is False and again.loaded == 0
    assert torch.equal(out, ref(batch, use_cache=False).logits)
    assert not list(tmp_path.rglob("*.pt"))


def test_the_store_keys_on_what_decides_the_logits_besides_the_weights(tmp_path):
    """Same weights, another attention implementation or thread count: another folder of the store."""
    ref = tiny_llama()
    first = common.CachedReference(ref, tmp_path)._disk()
    assert common.CachedReference(copy.deepcopy(ref), tmp_path)._disk() == first
    other = copy.deepcopy(ref)
    other.config._attn_implementation = "eager" if ref.config._attn_implementation != "eager" else "sdpa"
    assert common.CachedReference(other, tmp_path)._disk() != first
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert common.CachedReference(ref, tmp_path)._disk() != first
    finally:
        torch.set_num_threads(threads)
