"""Streaming a mixture-of-experts checkpoint (issue 71, item 4): per-expert hub tensors
(``mlp.experts.E.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.E.w1``) and transformers 5's
fused ones (``mlp.experts.gate_up_proj`` [E, 2I, H]) stream to the bytes of the in-memory run, and a run
interrupted between layers resumes to the same bytes."""

import json

import pytest
import torch
from safetensors.torch import save_file

from bitmosaic.api import as_recipe, quantize_
from bitmosaic.io import load_quantized, save_quantized
from bitmosaic.io.sources.checkpoint import Checkpoint
from bitmosaic.pipeline import RunSettings
from bitmosaic.pipeline.stream import LayerStore, partial_dir, quantize_streaming
from bitmosaic.testing import word_tokenizer

from .test_stream import _Crash, _same_folder

SPECS = {  # transformers' own configs, tiny (4 experts, top-2)
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


def _moe(model_type: str, layers: int = 2):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                               vocab_size=128, num_attention_heads=4, num_key_value_heads=2,
                               tie_word_embeddings=False, **SPECS[model_type])  # fmt: skip
    m = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for _, p in m.named_parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.1)
    return m


def _src(tmp, model_type: str, naming: str, layers: int = 2):
    """The tiny model saved as the hub ships it (``save_pretrained``: one tensor per expert projection)
    or as transformers 5 holds it (its own state dict: the fused 3-D expert tensors)."""
    m = _moe(model_type, layers)
    folder = tmp / f"src-{model_type}-{naming}"
    m.save_pretrained(folder, safe_serialization=True)
    if naming == "fused":
        (folder / "model.safetensors").unlink()
        save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})  # fmt: skip
    word_tokenizer().save_pretrained(folder)
    return folder


def _keys(folder):
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return list(f.keys())


def _calib():
    return torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))


RECIPE = ("gptq", {"bits": 4, "group_size": 16})


def _stream(src, out):
    return quantize_streaming(Checkpoint(src), word_tokenizer(), out, as_recipe(*RECIPE), _calib(),
                              RunSettings(progress=False, moe_min_tokens=1))  # fmt: skip


@pytest.mark.parametrize("model_type,naming", [("qwen3_moe", "hub"), ("qwen3_moe", "fused"),
                                               ("mixtral", "hub"), ("mixtral", "fused")])  # fmt: skip
def test_streamed_moe_bytes_equal_the_in_memory_run(model_type, naming, tmp_path):
    src = _src(tmp_path, model_type, naming)
    keys = _keys(src)
    fused = any(k.endswith("mlp.experts.gate_up_proj") for k in keys)
    assert fused == (naming == "fused")  # the checkpoint is in the naming under test
    if model_type == "mixtral" and naming == "hub":
        assert any(".block_sparse_moe.experts.0.w1." in k for k in keys)
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)  # transformers reads both namings
    quantize_(m, RECIPE[0], _calib(), progress=False, moe_min_tokens=1, **RECIPE[1])
    mem = save_quantized(m, tmp_path / "mem")
    _stream(src, tmp_path / "str")
    _same_folder(mem, tmp_path / "str")
    with torch.inference_mode():
        x = _calib()[:1]
        a, b = load_quantized(mem)[0], load_quantized(tmp_path / "str")[0]
        assert torch.equal(a(x).logits, b(x).logits)


@pytest.mark.parametrize("naming,at", [("hub", 0), ("fused", 1)])
def test_moe_resume_after_a_kill_between_layers_gives_the_same_bytes(naming, at, tmp_path, monkeypatch):
    src = _src(tmp_path, "qwen3_moe", naming, layers=3)
    _stream(src, tmp_path / "whole")
    real_done = LayerStore.done

    def done(self, li, *a):
        real_done(self, li, *a)
        if li == at:
            raise _Crash

    monkeypatch.setattr(LayerStore, "done", done)
    with pytest.raises(_Crash):
        _stream(src, tmp_path / "out")
    assert json.loads((partial_dir(tmp_path / "out") / "progress.json").read_text())["layers_done"] == at + 1
    monkeypatch.setattr(LayerStore, "done", real_done)
    _stream(src, tmp_path / "out")
    _same_folder(tmp_path / "whole", tmp_path / "out")


@pytest.mark.parametrize("naming", ["hub", "fused"])
def test_each_expert_is_read_alone_into_a_meta_skeleton(naming, tmp_path):
    """unfuse_experts works on the meta skeleton, and filling a layer gives every expert projection a
    tensor of its own (no fused [E, 2I, H] tensor of all experts behind the views)."""
    from bitmosaic.modules.experts import RoutedExperts, unfuse_experts

    ckpt = Checkpoint(_src(tmp_path, "qwen3_moe", naming))
    model = ckpt.empty_model(torch.float32)
    assert unfuse_experts(model) == 2
    layer = model.model.layers[1]
    assert isinstance(layer.mlp.experts, RoutedExperts) and layer.mlp.experts[0].gate_proj.weight.is_meta
    ckpt.fill(layer, "model.layers.1.", torch.float32)
    ref = _moe("qwen3_moe").model.layers[1].mlp.experts
    for e, expert in enumerate(layer.mlp.experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            w = getattr(expert, proj).weight
            assert w.untyped_storage().nbytes() == w.numel() * 4
        i = ref.gate_up_proj.shape[1] // 2
        assert torch.equal(expert.gate_proj.weight, ref.gate_up_proj[e, :i])
        assert torch.equal(expert.up_proj.weight, ref.gate_up_proj[e, i:])
        assert torch.equal(expert.down_proj.weight, ref.down_proj[e])


def _saved(model, out):
    from .test_stream import _tensors

    return _tensors(save_quantized(model, out))


@pytest.mark.parametrize("min_tokens", [1, 120])  # 120: some experts fall back to the pooled Hessian
def test_experts_in_parts_under_a_small_budget_give_the_same_bytes(min_tokens, tmp_path, monkeypatch):
    """Past the memory budget a group's experts are calibrated and solved in parts (one statistics pass
    per part, its Hessians freed before the next); an expert's Hessian is its own routed rows', and the
    pooled fallback is summed in the same order, so the bytes equal the whole group's at once."""
    from bitmosaic.pipeline import experts as pexperts

    calls = []
    real_part = pexperts.ExpertPool.part
    monkeypatch.setattr(pexperts.ExpertPool, "part",
                        lambda self, *a, **k: calls.append(a[1]) or real_part(self, *a, **k))  # fmt: skip
    runs = {}
    for budget in (None, 20_000):  # 20 kB: a quarter holds one expert's 32 x 32 gate/up Hessian
        m = _moe("qwen3_moe")
        rep = quantize_(m, RECIPE[0], _calib(), progress=False, moe_min_tokens=min_tokens, max_memory=budget,
                        **RECIPE[1])  # fmt: skip
        runs[budget] = (_saved(m, tmp_path / f"m{budget}"), rep)
    assert len(calls) == 2 * 4 and all(len(c) == 2 for c in calls)  # 2 layers x 4 parts of gate/up
    (a, ra), (b, rb) = runs[None], runs[20_000]
    assert sorted(a) == sorted(b) and not [k for k in a if not torch.equal(a[k], b[k])]
    fell = sorted(r["name"] for r in ra.layers if r.get("expert_fallback"))
    assert fell == sorted(r["name"] for r in rb.layers if r.get("expert_fallback"))
    assert bool(fell) == (min_tokens > 1)
    tok = {r["name"]: r["expert_tokens"] for r in ra.layers if "expert_tokens" in r}
    assert tok == {r["name"]: r["expert_tokens"] for r in rb.layers if "expert_tokens" in r}


def test_thin_experts_of_one_projection_share_one_pooled_hessian():
    """After the parts, every expert below moe_min_tokens gets the pooled Hessian of its projection: one
    tensor per projection, not a copy per expert (a DeepSeek-V3 layer's ~256 thin gate/up experts would
    hold 256 x 205 MB); each solve still takes its own copy (``take``)."""
    from bitmosaic.pipeline import experts as pexperts

    pool = pexperts.ExpertPool(RunSettings())
    gen = torch.Generator().manual_seed(0)
    for p, d in (("gate_proj", 6), ("down_proj", 4)):
        pool.sums[f"mlp.experts.*.{p}"] = torch.randn(d, d, generator=gen)
        pool.rows[f"mlp.experts.*.{p}"] = 10
        for e in range(3):
            pool.low[f"mlp.experts.{e}.{p}"] = [f"mlp.experts.{e}.{p}"]
    accs, owner = pool.rest()
    assert len(accs) == 6 and len(owner) == 6
    for p in ("gate_proj", "down_proj"):
        hs = [accs[f"mlp.experts.{e}.{p}"].H for e in range(3)]
        assert all(h is hs[0] for h in hs)
        taken = accs[f"mlp.experts.0.{p}"].take()
        assert taken.data_ptr() != hs[0].data_ptr() and torch.equal(taken, hs[0])
    assert {pool.stats.fallback[o] for o in owner} == {"pooled"}


def test_a_streamed_run_in_parts_equals_the_in_memory_run(tmp_path):
    src = _src(tmp_path, "qwen3_moe", "fused")
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    quantize_(m, RECIPE[0], _calib(), progress=False, moe_min_tokens=1, **RECIPE[1])
    quantize_streaming(Checkpoint(src), word_tokenizer(), tmp_path / "str", as_recipe(*RECIPE), _calib(),
                       RunSettings(progress=False, moe_min_tokens=1, max_memory=20_000))  # fmt: skip
    from .test_stream import _tensors

    a, b = _saved(m, tmp_path / "mem"), _tensors(tmp_path / "str")
    assert sorted(a) == sorted(b) and not [k for k in a if not torch.equal(a[k], b[k])]


def test_a_fused_tensor_that_does_not_match_the_config_is_one_line(tmp_path):
    from bitmosaic.errors import CorruptModelError

    src = _src(tmp_path, "qwen3_moe", "fused")
    cfg = json.loads((src / "config.json").read_text())
    cfg["moe_intermediate_size"] = 8  # the stored experts are 16 wide
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CorruptModelError, match="does not match its config") as e:
        _stream(src, tmp_path / "out")
    assert "\n" not in str(e.value) and "gate_up_proj" in str(e.value)


@pytest.mark.parametrize("min_tokens", [1, 120])  # 120: some experts fall back to the pooled Hessian
def test_expert_weights_past_the_budget_are_read_part_by_part(min_tokens, tmp_path, monkeypatch):
    """A streamed layer whose expert weights exceed a quarter of the budget keeps them on ``meta`` and
    reads each part's experts for its pass (solved ones from their packed modules): never more than one
    part's experts float at once, and the bytes of the in-memory run (lazy_experts.py)."""
    from bitmosaic.pipeline import lazy_experts
    from bitmosaic.pipeline.lazy_experts import LazyExperts

    src = _src(tmp_path, "qwen3_moe", "hub")
    float_counts, per_call = [], []
    real_resident, real_per_call = LazyExperts.resident, LazyExperts.per_call

    def resident(self, names):
        ctx = real_resident(self, names)

        class _Count:
            def __enter__(s):
                ctx.__enter__()
                float_counts.append(sum(not self.layer.get_submodule(n).weight.is_meta for n in self.names))

            def __exit__(s, *exc):
                ctx.__exit__(*exc)
                assert all(self.layer.get_submodule(n).weight.is_meta for n in self.names)

        return _Count()

    monkeypatch.setattr(LazyExperts, "resident", resident)
    monkeypatch.setattr(LazyExperts, "per_call", lambda self: per_call.append(1) or real_per_call(self))
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    quantize_(m, RECIPE[0], _calib(), progress=False, moe_min_tokens=min_tokens, **RECIPE[1])
    quantize_streaming(Checkpoint(src), word_tokenizer(), tmp_path / "str", as_recipe(*RECIPE), _calib(),
                       RunSettings(progress=False, moe_min_tokens=min_tokens, max_memory=20_000))  # fmt: skip
    from .test_stream import _tensors

    assert per_call == [1, 1]  # both layers' last pass ran expert by expert
    assert float_counts and max(float_counts) <= 3  # one expert a part (and a fallback chunk)
    assert lazy_experts.WEIGHT_FRACTION * 20_000 < 4 * 3 * 16 * 32 * 4  # the experts exceed the fraction
    a, b = _saved(m, tmp_path / "mem"), _tensors(tmp_path / "str")
    assert sorted(a) == sorted(b) and not [k for k in a if not torch.equal(a[k], b[k])]


def test_deepseek_v3_streams_its_experts_part_by_part_to_the_in_memory_bytes(tmp_path, monkeypatch):
    """DeepSeek-V3's map (MLA attention, a first dense layer, shared experts, grouped top-k routing):
    its MoE layer read part by part under a small budget gives the in-memory run's bytes."""
    from transformers import AutoModelForCausalLM

    from bitmosaic.pipeline import lazy_experts
    from bitmosaic.testing import tiny_moe

    from .test_stream import _tensors

    src = tmp_path / "src"
    tiny_moe("deepseek_v3").save_pretrained(src)
    word_tokenizer().save_pretrained(src)
    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    quantize_(m, RECIPE[0], _calib(), progress=False, moe_min_tokens=1, bits=4, group_size=32)
    lazy = []
    real_init = lazy_experts.LazyExperts.__init__
    monkeypatch.setattr(lazy_experts.LazyExperts, "__init__",
                        lambda self, *a, **k: lazy.append(1) or real_init(self, *a, **k))  # fmt: skip
    quantize_streaming(Checkpoint(src), word_tokenizer(), tmp_path / "str", as_recipe("gptq", {"bits": 4,
                       "group_size": 32}), _calib(), RunSettings(progress=False, moe_min_tokens=1,
                       max_memory=40_000))  # fmt: skip
    assert lazy == [1]  # the MoE layer (the first is dense)
    a, b = _saved(m, tmp_path / "mem"), _tensors(tmp_path / "str")
    assert sorted(a) == sorted(b) and not [k for k in a if not torch.equal(a[k], b[k])]
