"""Compiled decode by default (issue 74, modules/decode.py ``default_compiled_decode``): ``bitmosaic.load``
and ``from_pretrained`` of a bitmosaic folder decode through the compiled step without being asked, with
eager's greedy tokens; the compile is announced on stderr and cached across processes; ``compile=False``
and ``$BITMOSAIC_NO_COMPILE=1`` opt out; what cannot compile decodes eagerly with no error.

The session sets ``$BITMOSAIC_NO_COMPILE=1`` for every other test (conftest: a compile costs 30-60 s on
the shared 2-core machine); the tests here that need the default remove it.  ``slow``: a compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import bitmosaic
from bitmosaic.errors import OptionError
from bitmosaic.modules.decode import (
    NO_COMPILE_ENV,
    default_compiled_decode,
    default_inductor_options,
    inductor_cache_dir,
)
from bitmosaic.modules.intact import RUNTIME_ACT_ENV
from bitmosaic.testing import SPECIALS, VOCAB, tiny_llama
from tests.helpers import varied_quantized_dir

NEW = 16
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def default_on(monkeypatch):
    """The whole default of a load path: the compiled step and, where it is on (a VNNI CPU), 16-bit
    run-time activations (tests/io/test_default_runtime_act.py)."""
    monkeypatch.delenv(NO_COMPILE_ENV, raising=False)
    monkeypatch.delenv(RUNTIME_ACT_ENV, raising=False)


@pytest.fixture(scope="module")
def qdir(tmp_path_factory):
    return varied_quantized_dir(tmp_path_factory.mktemp("q") / "w4", tokenizer=False)


def scaled_llama():
    """The tiny float Llama (transformers' ``LlamaConfig``, random) with its weights scaled as in
    ``varied_quantized_dir``."""
    m = tiny_llama()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(8)
    return m


def prompt() -> torch.Tensor:
    return torch.randint(len(SPECIALS), VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))


def greedy(m, ids=None):
    ids = prompt() if ids is None else ids
    with torch.inference_mode():
        return m.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)


def compiled(m) -> bool:
    return m.generation_config.cache_implementation == "static" and hasattr(m, "_compiled_call")


def test_load_and_from_pretrained_take_the_compiled_step_by_default(qdir, default_on):
    from transformers import AutoModelForCausalLM

    for m in (bitmosaic.load(qdir), AutoModelForCausalLM.from_pretrained(qdir)):
        assert compiled(m)
        # the step's entry in C++, built apart from the kernels (modules/decode.py default_inductor_options)
        opts = m.generation_config.compile_config.options
        assert opts == {"size_asserts": False, **default_inductor_options()}
        assert opts.get("cpp_wrapper") == hasattr(torch._inductor.config, "cpp_wrapper_build_separate")


def test_opt_outs(qdir, default_on, monkeypatch):
    m = bitmosaic.load(qdir, compile=False)
    assert not compiled(m) and m.generation_config.cache_implementation is None
    monkeypatch.setenv(NO_COMPILE_ENV, "1")
    assert not compiled(bitmosaic.load(qdir))
    assert default_compiled_decode(tiny_llama()) == f"compile=False or {NO_COMPILE_ENV}=1"
    monkeypatch.setenv(NO_COMPILE_ENV, "0")  # "0" is not an opt-out
    assert compiled(bitmosaic.load(qdir))
    with pytest.raises(OptionError, match="compile must be True or False") as e:
        bitmosaic.load(qdir, compile="no")
    assert "\n" not in str(e.value)


def test_what_cannot_compile_stays_eager_without_an_error(default_on):
    from bitmosaic.modules.experts import unfuse_experts
    from bitmosaic.testing import tiny_moe

    moe = tiny_moe("qwen3_moe")
    unfuse_experts(moe)
    assert "mixture of experts" in default_compiled_decode(moe)
    assert not compiled(moe)
    assert default_compiled_decode(torch.nn.Linear(4, 4)).startswith("Linear has no generation_config")
    meta = tiny_llama().to("meta")
    assert default_compiled_decode(meta) == "the model is on meta, not the CPU alone"
    assert not compiled(meta)


def test_a_step_that_fails_to_compile_decodes_eagerly(qdir, default_on, capfd):
    """A compile failure found on the first ``generate`` (here the compiled function raises what dynamo
    raises for an operator it cannot trace) is one line on stderr; decode goes on eagerly, same tokens."""
    ref = greedy(bitmosaic.load(qdir, compile=False))
    m = bitmosaic.load(qdir)
    step = m._compiled_call

    def untraceable(*args, **kwargs):
        raise torch._dynamo.exc.Unsupported("an operator without a fake implementation")

    step._fn = untraceable
    capfd.readouterr()
    assert torch.equal(greedy(m), ref)
    err = capfd.readouterr().err.splitlines()
    assert step.eager
    assert [x for x in err if "did not compile" in x] == [
        "bitmosaic: the decode step did not compile (Unsupported: an operator without a fake "
        "implementation); decoding eagerly"
    ]


@pytest.mark.slow
def test_default_greedy_tokens_equal_eager_and_the_compile_is_announced(qdir, default_on, capfd):
    """The W4 folder through ``bitmosaic.load`` and a float random Llama (transformers' ``LlamaConfig``)
    through ``default_compiled_decode``: one graph each, no graph break, eager's tokens."""
    torch._dynamo.reset()
    float_model = scaled_llama()
    cases = {"w4": (bitmosaic.load(qdir, compile=False), bitmosaic.load(qdir))}
    cases["float"] = (float_model, None)
    for name, (eager, model) in cases.items():
        ref = greedy(eager)
        assert len(set(ref[0, 8:].tolist())) > NEW // 4, name  # a test that can fail
        if model is None:
            assert default_compiled_decode(eager) is None
            model = eager
        capfd.readouterr()
        counters.clear()
        out = greedy(model)
        err = capfd.readouterr().err
        assert compiled(model) and not model._compiled_call.eager, name
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], name
        assert torch.equal(out, ref), name
        announce = [x for x in err.splitlines() if x.startswith("bitmosaic: compiling the decode step")]
        assert len(announce) == 1 and inductor_cache_dir() in announce[0], err


_CHILD = """
import json, sys, torch
from torch._dynamo.utils import counters
import bitmosaic
m = bitmosaic.load(sys.argv[1])
with torch.inference_mode():
    m.generate(torch.tensor([[5, 9, 17, 20]]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
print(json.dumps({k: dict(counters[k]) for k in ("inductor", "aot_autograd", "stats")}))
"""


@pytest.mark.slow
def test_a_second_process_compiles_nothing(qdir, tmp_path):
    """The compiled step lands in inductor's FX-graph and AOT-autograd caches under bitmosaic's cache
    folder: a second process finds it there (cache hits, no miss: inductor compiles nothing)."""
    unset = (NO_COMPILE_ENV, RUNTIME_ACT_ENV, "TORCHINDUCTOR_CACHE_DIR")  # the whole default
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["BITMOSAIC_CACHE"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])

    def run() -> dict:
        r = subprocess.run(
            [sys.executable, "-c", _CHILD, str(qdir)], env=env, capture_output=True, text=True, timeout=600
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = run()
    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1
    assert any((tmp_path / "cache" / "inductor").rglob("*")), "nothing written to bitmosaic's cache"
    second = run()
    assert second["stats"]["unique_graphs"] == 1  # the step was compiled (traced), not skipped
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0, second
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1, second
