"""The calibration passes run each projection once per layer and batch(q/k before v,
gate before up, and q/k/v again under the attention cache were recomputed), with Hessians equal
to a pass that runs every module."""

from __future__ import annotations

import collections

import torch
from torch import nn

from bitmosaic import quantize_
from bitmosaic.io import quantized_modules
from bitmosaic.pipeline.calibration import LayerInputs, capture_layer_inputs
from bitmosaic.pipeline.statistics import group_statistics
from tests.pipeline.test_pipeline import tiny_llama


def _calib(n=8, seqlen=16, seed=0):
    return torch.randint(0, 100, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _count_linear_calls(monkeypatch) -> collections.Counter:
    calls: collections.Counter = collections.Counter()
    orig = nn.Linear.forward

    def forward(self, x):
        calls[id(self)] += 1
        return orig(self, x)

    monkeypatch.setattr(nn.Linear, "forward", forward)
    return calls


def test_each_projection_runs_once_per_batch(monkeypatch):
    m = tiny_llama(layers=2)
    names = {id(mod): n for n, mod in m.named_modules() if isinstance(mod, nn.Linear)}
    calls = _count_linear_calls(monkeypatch)
    quantize_(m, "gptq", _calib(8), bits=4, group_size=16, progress=False, batch_size=4)
    per_layer = {n: calls[i] for i, n in names.items() if ".layers." in n}
    assert len(per_layer) == 14
    assert set(per_layer.values()) == {2}, per_layer  # 2 batches, once each


def test_stand_in_outputs_give_the_hessians_of_a_full_pass(monkeypatch):
    m = tiny_llama(layers=1)
    layer = m.model.layers[0]
    calib = _calib(6)
    inputs, kw = capture_layer_inputs(m, m.model.layers, calib, 3)
    for group in (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("mlp.gate_proj", "mlp.up_proj"),
    ):
        li = LayerInputs(inputs, torch.device("cpu"), False)
        accs, owner, _ = group_statistics(layer, group, li, kw["default"], hessian_dtype=torch.float64)
        assert set(owner.values()) == {group[0]} and list(accs) == [group[0]]
        # reference: each member's input captured from a plain, complete forward
        seen: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
        hooks = [
            layer.get_submodule(n).register_forward_pre_hook(
                lambda mod, a, n=n, seen=seen: seen[n].append(a[0].reshape(-1, a[0].shape[-1]).double())
            )
            for n in group
        ]
        with torch.no_grad():
            for hs, k in zip(inputs, kw["default"], strict=True):
                layer(hs, **k)
        for h in hooks:
            h.remove()
        for n in group:
            X = torch.cat(seen[n])
            torch.testing.assert_close(accs[group[0]].H, 2 * X.T @ X / X.shape[0], rtol=1e-12, atol=1e-12)


class _Chain(nn.Module):
    """A 'group' whose second member reads the first one's output: stand-ins must not leak."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_stand_ins_are_dropped_when_members_read_different_tensors():
    torch.manual_seed(0)
    layer = _Chain()
    xs = [torch.randn(2, 5, 8), torch.randn(2, 5, 8)]
    accs, owner, _ = group_statistics(
        layer, ("a", "b"), LayerInputs(xs, torch.device("cpu"), False), [{}, {}], hessian_dtype=torch.float64
    )
    assert owner == {"a": "a", "b": "b"}
    with torch.no_grad():
        Xb = torch.cat([torch.tanh(layer.a(x)).reshape(-1, 8) for x in xs]).double()
    torch.testing.assert_close(accs["b"].H, 2 * Xb.T @ Xb / Xb.shape[0], rtol=1e-12, atol=1e-12)
    assert "forward" not in vars(layer.a) and "forward" not in vars(layer.b)  # patches removed


def test_each_norm_runs_once_per_batch(monkeypatch):
    """A matrix-free child that finished before a group's first member (a norm) is final, so the
    layer's later passes reuse its output: one call per batch, not one per group."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    m = tiny_llama(layers=2)
    names = {id(mod): n for n, mod in m.named_modules() if isinstance(mod, LlamaRMSNorm)}
    calls: collections.Counter = collections.Counter()
    orig = LlamaRMSNorm.forward

    def forward(self, x):
        calls[id(self)] += 1
        return orig(self, x)

    monkeypatch.setattr(LlamaRMSNorm, "forward", forward)
    quantize_(m, "gptq", _calib(8), bits=4, group_size=16, progress=False, batch_size=4)
    per_layer = {n: calls[i] for i, n in names.items() if ".layers." in n}
    assert len(per_layer) == 4
    assert set(per_layer.values()) == {2}, per_layer  # 2 batches, once each (was 5 and 3)


class _Reused(nn.Module):
    """One norm called twice in a forward, on different inputs: only its first call may be cached."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        y = x + self.a(self.norm(x))
        return y + self.b(self.norm(y))


def test_a_cached_child_called_twice_runs_its_second_call():
    from bitmosaic.pipeline.statistics import OutputCache

    torch.manual_seed(0)
    layer = _Reused()
    xs = [torch.randn(2, 5, 8), torch.randn(2, 5, 8)]
    with OutputCache() as cache:
        stats = dict(hessian_dtype=torch.float64, cache=cache)
        group_statistics(layer, ("a",), LayerInputs(xs, torch.device("cpu"), False), [{}, {}], **stats)
        assert cache.modules == [layer.norm]  # it finished before `a` was called: cached
        cache.install(layer.a)  # as the pipeline does once `a` is solved
        accs, _, _ = group_statistics(layer, ("b",), LayerInputs(xs, torch.device("cpu"), False), [{}, {}],
                                      **stats)  # fmt: skip
    with torch.no_grad():
        Xb = torch.cat([layer.norm(x + layer.a(layer.norm(x))).reshape(-1, 8) for x in xs]).double()
    torch.testing.assert_close(accs["b"].H, 2 * Xb.T @ Xb / Xb.shape[0], rtol=1e-12, atol=1e-12)


class _MlpFirst(nn.Module):
    """A block whose forward runs its MLP (a later group's linear) before the first group's ``a``: only
    the matrix-free norm may be cached early, not the MLP."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 8))
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.norm(x)
        return x + self.mlp(h) + self.a(h)


def test_a_child_holding_a_linear_is_not_cached_early():
    from bitmosaic.pipeline.statistics import OutputCache

    layer = _MlpFirst()
    xs = [torch.randn(2, 5, 8)]
    with OutputCache() as cache:
        group_statistics(layer, ("a",), LayerInputs(xs, torch.device("cpu"), False), [{}], cache=cache)
        assert cache.modules == [layer.norm]


def test_codes_unchanged_by_the_pass_savings():
    """A model quantized with the output cache off (every group's pass recomputes its layer)
    gets the same codes."""
    calib = _calib(8)
    a, b = tiny_llama(layers=2), tiny_llama(layers=2)
    quantize_(a, "gptq", calib, bits=4, group_size=16, progress=False, batch_size=4)
    from bitmosaic.methods import get_method
    from bitmosaic.pipeline import RunSettings, quantize_model

    spec = get_method("gptq")
    settings = RunSettings(progress=False, batch_size=4, cache_outputs=False)
    quantize_model(b, calib, spec, spec.make_config(bits=4, group_size=16), settings)
    qa, qb = quantized_modules(a), quantized_modules(b)
    for n in qa:
        assert torch.equal(qa[n].codes(), qb[n].codes()), n


def test_check_finite_fast_path_is_exact():
    """The one-sum fast path never hides a NaN/Inf and never flags finite values whose sum
    overflows."""
    import pytest

    from bitmosaic.errors import NonFiniteError, check_finite

    check_finite(torch.full((4,), 3e38), "big")  # the sum overflows; the elements are finite
    check_finite(torch.full((8,), 6e4, dtype=torch.float16), "big half")
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn):
        check_finite(torch.ones(10).to(dt), "ones")
        bads = [float("nan")] if dt == torch.float8_e4m3fn else [float("nan"), float("inf"), -float("inf")]
        for bad in bads:
            u = torch.ones(10)
            u[3] = bad
            with pytest.raises(NonFiniteError, match="index \\[3\\]"):
                check_finite(u.to(dt), "u")


def test_upper_triangle_accumulation_equals_the_full_product():
    from bitmosaic.algorithms.hessian import HessianAccumulator

    g = torch.Generator().manual_seed(0)
    for n in (5, 130, 1100):  # one block, a partial second block, 256-wide blocks
        acc = HessianAccumulator(n)
        xs = [torch.randn(3, 7, n, generator=g), torch.randn(40, n, generator=g)]
        for x in xs:
            acc.add(x)
        X = torch.cat([x.reshape(-1, n) for x in xs]).double()
        H = acc.H
        assert torch.equal(H, H.T)
        torch.testing.assert_close(H.double(), 2 * X.T @ X / X.shape[0], rtol=1e-5, atol=1e-4)
        assert acc.n == X.shape[0]
