"""GPTQModel, an independent GPTQ loader, reads ``bitmosaic export --format gptq`` of the tiny Llama: its
own unpacking (``TorchLinear.dequantize_weight``, the CPU kernel) gives our weights bit for bit, and its
model's logits are ours (float16 against float32).

Skipped where GPTQModel is not installed (CI: it is not a bitmosaic dependency and its install on a
CPU-only machine takes a few steps, see ``benchmarks/results/gptqmodel_check.md``).  Not
``pytest.importorskip``: importing gptqmodel patches ``safetensors.torch.save_file`` and transformers'
quantizer registry for the whole process, so the GPTQModel side runs in a child interpreter and this
session only asks whether the package is there.  The SmolLM2 comparison is
``benchmarks/peers/gptqmodel_check.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

INSTALL = (
    "GPTQModel is not installed: BUILD_CUDA_EXT=0 pip install --no-deps gptqmodel==7.3.6 and its missing "
    "dependencies (benchmarks/results/gptqmodel_check.md)"
)
if importlib.util.find_spec("gptqmodel") is None:
    pytest.skip(INSTALL, allow_module_level=True)

from bitmosaic import load, quantize_  # noqa: E402
from bitmosaic.io import save_quantized  # noqa: E402
from bitmosaic.io.export import export_model  # noqa: E402
from tests.helpers import SPECIALS, VOCAB, tiny_llama, word_tokenizer  # noqa: E402

CALIB = torch.randint(len(SPECIALS), VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
IDS = torch.randint(len(SPECIALS), VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
CASES = {  # name -> (bitmosaic GPTQ options, the checkpoint_format the default export writes)
    "w4 act-order asym (gptq_v2)": ({"bits": 4, "group_size": 32}, "gptq_v2"),
    "w4 static-groups sym (gptq)": ({"bits": 4, "group_size": 32, "static_groups": True, "sym": True},
                                    "gptq"),
    "w3 act-order sym (gptq)": ({"bits": 3, "group_size": 32, "sym": True}, "gptq"),
}

# Runs in the child: GPTQModel loads each export on the CPU with its torch kernel in float16 and returns,
# per quantized layer, its dequantized weight as it computes it and the same unpacking with float32
# scales (no rounding), plus the logits of IDS.
CHILD = r"""
import os, sys, json, contextlib
os.environ["TORCH_COMPILE_DISABLE"] = "1"  # TorchLinear compiles its dequantization; the same code eagerly
import torch
from gptqmodel import BACKEND, GPTQModel
from gptqmodel.nn_modules.qlinear import BaseQuantLinear
folders, ids, dest = json.loads(sys.argv[1]), torch.tensor(json.loads(sys.argv[2])), sys.argv[3]
out = {}
for name, path in folders.items():
    with contextlib.redirect_stdout(sys.stderr):
        model = GPTQModel.load(path, device="cpu", backend=BACKEND.TORCH, dtype=torch.float16).model.eval()
    layers = {n: m for n, m in model.named_modules() if isinstance(m, BaseQuantLinear)}
    native, exact = {}, {}
    with torch.no_grad():
        for n, m in layers.items():
            native[n] = m.dequantize_weight().t().contiguous()
            scales = m.scales.data
            m.scales.data = scales.float()
            exact[n] = type(m).dequantize_weight(m).t().contiguous()
            m.scales.data = scales
        logits = model(ids, use_cache=False).logits
    out[name] = {"kernels": sorted({type(m).__name__ for m in layers.values()}), "native": native,
                 "exact": exact, "logits": logits}
torch.save(out, dest)
"""


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    """``{case: (bitmosaic model, GPTQModel's results)}``: every case quantized, saved and exported, then
    loaded by GPTQModel in one child interpreter."""
    tmp = tmp_path_factory.mktemp("gptqmodel")
    folders, ours = {}, {}
    for i, (name, (opts, fmt)) in enumerate(CASES.items()):
        m = tiny_llama(seed=3)
        quantize_(m, "gptq", CALIB, progress=False, **opts)
        src = save_quantized(m, tmp / f"src{i}", {"method": "gptq"}, tokenizer=word_tokenizer())
        export_model(src, tmp / f"gptq{i}", "gptq")  # the default checkpoint_format, as a user gets it
        qc = json.loads((tmp / f"gptq{i}" / "config.json").read_text())["quantization_config"]
        assert qc["checkpoint_format"] == fmt, name
        folders[name] = str(tmp / f"gptq{i}")
        ours[name] = load(src).eval()
    dest = tmp / "gptqmodel.pt"
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1"}
    cmd = [sys.executable, "-c", CHILD, json.dumps(folders), json.dumps(IDS.tolist()), str(dest)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, f"GPTQModel failed to load our export:\n{r.stderr[-4000:]}"
    theirs = torch.load(dest)
    return {name: (ours[name], theirs[name]) for name in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_gptqmodel_unpacks_our_weights_bit_for_bit(peer, case):
    model, theirs = peer[case]
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "layer_config")}
    assert theirs["kernels"] == ["TorchLinear"]
    assert sorted(theirs["native"]) == sorted(layers)  # every quantized linear, nothing else
    for name, m in layers.items():
        w = m.dequantize_reference(torch.float32)
        native, exact = theirs["native"][name], theirs["exact"][name]
        assert native.dtype == torch.float16 and exact.dtype == torch.float32
        assert torch.equal(exact, w), name  # GPTQModel's unpacking, no rounding: our exact weight
        assert torch.equal(native, w.half()), name  # as it runs: our weight rounded once to float16


@pytest.mark.parametrize("case", list(CASES))
def test_gptqmodel_logits_match_ours(peer, case):
    model, theirs = peer[case]
    with torch.no_grad():
        ref = model(IDS).logits
    got = theirs["logits"].float()
    assert got.shape == ref.shape
    # float16 activations against float32 (measured: max |diff| / max |logit| about 5e-4)
    assert float((got - ref).abs().max()) <= 3e-3 * float(ref.abs().max())
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.95
