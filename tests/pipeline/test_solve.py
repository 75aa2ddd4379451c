"""Disposable Hessians: the pipeline lets GPTQ factorise a Hessian nobody reads again in its own
memory; results, report rows and the rare retry are exactly those of a run that keeps it."""

import pytest
import torch

import bitmosaic.algorithms.gptq as G
import bitmosaic.pipeline.calibration as C
import bitmosaic.pipeline.loop as P
from bitmosaic import quantize_
from bitmosaic.algorithms.hessian import HessianSpentError
from bitmosaic.methods import get_method
from tests.pipeline.test_pipeline import tiny_llama

_KW = dict(bits=4, group_size=32, order="act", progress=False)


@pytest.fixture
def calib():
    return torch.randint(0, 128, (6, 32), generator=torch.Generator().manual_seed(0))


def _run(calib, **kw):
    m = tiny_llama()
    rep = quantize_(m, "gptq", calib, **_KW, **kw)
    return m.state_dict(), [{k: r[k] for k in ("name", "rel_out_error", "hessian_error", "babai_bound")}
                            for r in rep.layers]  # fmt: skip


def _same(a, b):
    sd_a, rows_a = a
    sd_b, rows_b = b
    assert sd_a.keys() == sd_b.keys()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    assert rows_a == rows_b  # the report's errors too, bit for bit


def test_lone_solves_get_a_disposable_hessian_and_change_nothing(calib, monkeypatch):
    gptq = type(get_method("gptq"))
    seen = []
    real = gptq.quantize

    def spy(self, weight, stats, cfg, state=None, name=None):
        seen.append(stats.hessian_disposable)
        return real(self, weight, stats, cfg, state, name)

    monkeypatch.setattr(gptq, "quantize", spy)
    disposed = _run(calib)
    assert seen == [True] * 8  # q/k/v, o, gate/up, down in each of 2 layers: one owner, one solve
    seen.clear()
    monkeypatch.setattr(gptq, "may_overwrite_hessian", False)
    kept = _run(calib)
    assert seen == [False] * 8
    _same(disposed, kept)


def test_order_analysis_keeps_the_hessian(calib, monkeypatch):
    seen = []
    real = G.gptq_factor
    monkeypatch.setattr(G, "gptq_factor", lambda *a, **k: (seen.append(k.get("overwrite")), real(*a, **k))[1])
    m = tiny_llama()
    quantize_(m, "gptq", calib, **_KW, analyze_orders=("natural",))
    assert seen and not any(seen)


def test_a_failed_factorisation_in_place_recomputes_the_hessian(calib, monkeypatch):
    """When the in-place factorisation would need a retry, the pipeline recomputes the group's
    Hessian and solves with a kept one: the same bytes and rows as a run that never handed it over."""
    ref = _run(calib)
    real, stats_calls = G.gptq_factor, []

    def fail_in_place(*a, overwrite=False, **k):
        if overwrite:
            raise HessianSpentError("simulated")
        return real(*a, **k)

    real_stats = P.group_statistics

    def count(*a, **k):
        stats_calls.append(a[1])
        return real_stats(*a, **k)

    monkeypatch.setattr(G, "gptq_factor", fail_in_place)
    monkeypatch.setattr(P, "group_statistics", count)
    _same(_run(calib), ref)
    assert len(stats_calls) == 2 * 8  # every group's statistics twice: once more for its kept H


def test_activations_are_kept_in_the_models_dtype(calib, monkeypatch):
    """A bfloat16 model calibrated in float32 on the CPU hands bfloat16 hidden states from layer to
    layer (half the bytes, rounded as the model itself rounds them); a float32 model keeps float32."""
    kept = []

    class Spy(C.LayerInputs):
        def set(self, b, output):  # the final forward hands on each output as it is made
            super().set(b, output)
            if b == 0:
                kept.append((output.dtype, self.stored(0).dtype, next(iter(self)).dtype))

    monkeypatch.setattr(C, "LayerInputs", Spy)
    for dtype in (torch.bfloat16, torch.float32):
        kept.clear()
        m = tiny_llama().to(dtype)
        quantize_(m, "gptq", calib, **_KW)
        assert kept == [(torch.float32, dtype, torch.float32)] * 2  # computed, kept, handed on


def test_a_handed_hessian_is_freed_before_packing(calib, monkeypatch):
    """A disposable Hessian is garbage once the solve returns: nothing holds it while the layer
    is packed, checked and measured (the post-solve peak of a Llama-3-8B ``down_proj``)."""
    import weakref

    gptq = type(get_method("gptq"))
    real_quantize, real_pack = gptq.quantize, gptq.pack
    refs, alive = [], []

    def quantize(self, weight, stats, cfg, state=None, name=None):
        refs.append((weakref.ref(stats.hessian), stats.hessian_disposable))
        return real_quantize(self, weight, stats, cfg, state, name)

    def pack(self, res, cfg, bias=None):
        ref, disposable = refs[-1]
        alive.append((ref() is not None, disposable))
        return real_pack(self, res, cfg, bias)

    monkeypatch.setattr(gptq, "quantize", quantize)
    monkeypatch.setattr(gptq, "pack", pack)
    m = tiny_llama()
    quantize_(m, "gptq", calib, **_KW)
    assert len(alive) >= 8 and all(d for _, d in alive)
    assert not any(a for a, _ in alive)  # freed, not merely overwritten
    alive.clear()
    refs.clear()
    monkeypatch.setattr(gptq, "may_overwrite_hessian", False)  # a kept Hessian is still read
    quantize_(tiny_llama(), "gptq", calib, **_KW)
    assert alive and all(a for a, _ in alive)
