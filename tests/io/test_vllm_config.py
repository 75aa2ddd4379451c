"""vLLM's own checkpoint-config parsing reads the ``quantization_config`` of our exports: which
quantization method it detects, what its config class parses, and which compressed-tensors scheme class
each Llama linear layer (as vLLM names and fuses them) resolves to.

vLLM is not a bitmosaic dependency and its wheel is CUDA-only, so it runs in another interpreter:
``$BITMOSAIC_VLLM_PYTHON``, a virtual environment holding vLLM installed with ``--no-deps`` plus the
pure-Python packages its import chain needs (``benchmarks/results/vllm_config_check.md``; checked with
vLLM 0.33.0 on torch 2.13 CPU: vLLM's compiled kernels do not load, its config code does not need them).
Skipped where the variable is not set. The child builds vLLM's ``ModelConfig`` and ``VllmConfig`` on
each export folder, which run vLLM's quantization-method detection (the ``override_quantization_method``
chain) and the config class's ``from_config``; for compressed-tensors it then asks ``get_quant_method``
for every linear of the tiny Llama, with no GPU (capability None) and with the capability of an A100
(80) and an H100 (90) reported by the platform, the only hardware inputs of the scheme choice. No kernel
runs.

What vLLM 0.33.0 accepts of our GPTQ exports is narrower than what GPTQModel loads: only symmetric 4-
and 8-bit checkpoints without act-order groups (``desc_act: false``, i.e. static-groups or GAR results);
asymmetric results, 3-bit, and ``desc_act: true`` are refused with the errors pinned below.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

PYTHON = os.environ.get("BITMOSAIC_VLLM_PYTHON", "")
if not PYTHON or not Path(PYTHON).exists():
    pytest.skip(
        "vLLM is not available: set BITMOSAIC_VLLM_PYTHON to a python with vLLM installed "
        "(benchmarks/results/vllm_config_check.md)",
        allow_module_level=True,
    )

from bitmosaic import quantize_  # noqa: E402
from bitmosaic.io import save_quantized  # noqa: E402
from bitmosaic.io.export import export_model  # noqa: E402
from tests.helpers import SPECIALS, VOCAB, tiny_llama, word_tokenizer  # noqa: E402

CALIB = torch.randint(len(SPECIALS), VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")  # vLLM's names
CT = {  # name -> (method, options)
    "w4 g32 asym": ("rtn", {"bits": 4, "group_size": 32}),
    "w4 g32 sym": ("rtn", {"bits": 4, "group_size": 32, "sym": True}),
    "w3 g48 sym gar": ("gptq", {"bits": 3, "group_size": 48, "order": "gar", "sym": True}),
    "w4 channel asym awq": ("awq", {"bits": 4, "group_size": None}),
    "w8a8 int": ("smoothquant", {"scheme": "W8A8", "group_size": None, "sym": True}),
    "fp8 weights": ("fp8", {}),
    "mixed 4/8": ("rtn", {"bits": 4, "group_size": 32, "sym": True}),
}
GPTQ = {  # name -> (GPTQ options, the checkpoint_format and desc_act the default export writes)
    "w4 g32 sym static-groups": ({"bits": 4, "group_size": 32, "sym": True, "static_groups": True},
                                 ("gptq", False)),
    "w8 g32 sym static-groups": ({"bits": 8, "group_size": 32, "sym": True, "static_groups": True},
                                 ("gptq", False)),
    "w4 g32 asym static-groups": ({"bits": 4, "group_size": 32, "static_groups": True}, ("gptq_v2", False)),
    "w4 g32 sym act-order": ({"bits": 4, "group_size": 32, "sym": True}, ("gptq", True)),
    "w3 g32 sym static-groups": ({"bits": 3, "group_size": 32, "sym": True, "static_groups": True},
                                 ("gptq", False)),
}

CHILD = r"""
import contextlib, json, sys
with contextlib.redirect_stdout(sys.stderr):
    import torch
    import vllm
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import linear
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
folders, names = json.loads(sys.argv[1]), json.loads(sys.argv[2])
kinds = {"qkv_proj": linear.QKVParallelLinear, "gate_up_proj": linear.MergedColumnParallelLinear,
         "o_proj": linear.RowParallelLinear, "down_proj": linear.RowParallelLinear}
out = {"version": vllm.__version__, "platform": type(current_platform).__name__}
for case, folder in folders.items():
    r = out[case] = {}
    try:
        mc = ModelConfig(model=folder, dtype="float16", skip_tokenizer_init=True)
        r["method"] = mc.quantization
        vc = VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"))
    except Exception as e:  # pydantic wraps the config class's ValueError
        r["error"] = str(e)
        continue
    qc = vc.quant_config
    r["config"] = type(qc).__name__
    if r["method"] != "compressed-tensors":
        r["fields"] = {"bits": qc.weight_bits, "group_size": qc.group_size, "sym": qc.is_sym,
                       "desc_act": qc.desc_act, "quant_type": str(qc.quant_type)}
        continue
    qc.packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping  # as vLLM's loader sets it
    r["layers"] = {}
    with set_current_vllm_config(vc):
        for cap in (None, 80, 90):
            current_platform.get_device_capability = (
                lambda device_id=0, c=cap: None if c is None else DeviceCapability(c // 10, c % 10))
            for name in names:
                cls = kinds[name.rsplit(".", 1)[1]]
                layer = cls.__new__(cls)  # the real class, as isinstance and target matching see it
                torch.nn.Module.__init__(layer)
                method = qc.get_quant_method(layer, prefix=name)
                s = getattr(layer, "scheme", None)
                args = {k: getattr(s, k) for k in ("num_bits", "group_size", "symmetric", "strategy",
                                                  "is_static_input_scheme", "input_symmetric")
                        if hasattr(s, k)}
                r["layers"][f"{cap}:{name}"] = [type(method).__name__, type(s).__name__,
                                               {k: str(v) for k, v in args.items()}]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """``{case: what vLLM made of the export}`` for every case, from one child interpreter."""
    tmp = tmp_path_factory.mktemp("vllm")
    folders, ours = {}, {}
    for i, (name, (method, opts)) in enumerate(CT.items()):
        m = tiny_llama(seed=3)
        quantize_(m, method, CALIB, progress=False, **opts)
        if name == "mixed 4/8":
            m8 = tiny_llama(seed=3)
            quantize_(m8, "rtn", CALIB, progress=False, bits=8, group_size=32, sym=True)
            m.model.layers[1].mlp.down_proj = m8.model.layers[1].mlp.down_proj
        src = save_quantized(m, tmp / f"ct_src{i}", {"method": method}, tokenizer=word_tokenizer())
        export_model(src, tmp / f"ct{i}", "compressed-tensors")
        folders[name] = str(tmp / f"ct{i}")
    for i, (name, (opts, (fmt, desc_act))) in enumerate(GPTQ.items()):
        m = tiny_llama(seed=3)
        quantize_(m, "gptq", CALIB, progress=False, **opts)
        src = save_quantized(m, tmp / f"g_src{i}", {"method": "gptq"}, tokenizer=word_tokenizer())
        export_model(src, tmp / f"g{i}", "gptq")  # the defaults, as a user gets them
        qc = json.loads((tmp / f"g{i}" / "config.json").read_text())["quantization_config"]
        assert (qc["checkpoint_format"], qc["desc_act"]) == (fmt, desc_act), name
        folders[name] = ours[name] = str(tmp / f"g{i}")
    names = [f"model.layers.{i}.{n}" for i in range(2) for n in LINEARS]
    r = subprocess.run([PYTHON, "-c", CHILD, json.dumps(folders), json.dumps(names)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"vLLM's config parsing failed:\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def wna16(bits, group, sym, strategy="group"):
    return ["CompressedTensorsLinearMethod", "CompressedTensorsWNA16",
            {"num_bits": str(bits), "group_size": str(group), "symmetric": str(sym), "strategy": strategy}]


def layers(got, expect):
    """``expect(name)`` for every linear at every capability."""
    caps = {k.split(":")[0] for k in got}
    assert caps == {"None", "80", "90"}
    for key, value in got.items():
        assert value == expect(key.split(":", 1)[1]), key


def test_compressed_tensors_method_is_detected(vllm):
    assert vllm["version"] == "0.33.0" and vllm["platform"] == "UnspecifiedPlatform"  # what was checked
    for name in CT:
        assert vllm[name]["method"] == "compressed-tensors", name
        assert vllm[name]["config"] == "CompressedTensorsConfig", name


@pytest.mark.parametrize(
    "case,bits,group,sym",
    [("w4 g32 asym", 4, 32, False), ("w4 g32 sym", 4, 32, True)],
)
def test_pack_quantized_resolves_to_wna16(vllm, case, bits, group, sym):
    layers(vllm[case]["layers"], lambda n: wna16(bits, group, sym))


def test_per_layer_group_sizes_resolve_through_vllm_fused_names(vllm):
    # GAR with group 48 does not divide 64-wide inputs: q/k/v/o/gate/up get group 16, down_proj 48 (the
    # config lists them by name); vLLM fuses q/k/v and gate/up and must find one scheme for each.
    layers(vllm["w3 g48 sym gar"]["layers"], lambda n: wna16(3, 48 if "down_proj" in n else 16, True))


def test_channel_asymmetric_resolves_to_wna16(vllm):
    # group_size null (one scale per output channel), which vLLM's scheme holds as -1
    layers(vllm["w4 channel asym awq"]["layers"], lambda n: wna16(4, -1, False, "channel"))


def test_mixed_bit_widths_resolve_per_layer(vllm):
    layers(vllm["mixed 4/8"]["layers"],
           lambda n: wna16(8 if n == "model.layers.1.mlp.down_proj" else 4, 32, True))


def test_w8a8_resolves_to_dynamic_per_token_int8(vllm):
    expect = ["CompressedTensorsLinearMethod", "CompressedTensorsW8A8Int8",
              {"strategy": "channel", "is_static_input_scheme": "False", "input_symmetric": "True"}]
    layers(vllm["w8a8 int"]["layers"], lambda n: expect)


def test_fp8_weights_resolve_to_weight_only_fp8(vllm):
    # We write FP8 weights with no input_activations: vLLM's weight-only FP8 scheme (W8A16), on any GPU.
    expect = ["CompressedTensorsLinearMethod", "CompressedTensorsW8A16Fp8",
              {"strategy": "channel", "is_static_input_scheme": "None"}]
    layers(vllm["fp8 weights"]["layers"], lambda n: expect)


@pytest.mark.parametrize("case,bits", [("w4 g32 sym static-groups", 4), ("w8 g32 sym static-groups", 8)])
def test_symmetric_gptq_without_act_order_is_parsed_as_ours(vllm, case, bits):
    got = vllm[case]
    assert got["method"] == "auto_gptq" and got["config"] == "AutoGPTQConfig"
    qtype = {4: "uint4b8", 8: "uint8b128"}[bits]  # v1's stored zero-point 2^(b-1), as vLLM's type names it
    want = {"bits": bits, "group_size": 32, "sym": True, "desc_act": False, "quant_type": qtype}
    assert got["fields"] == want


@pytest.mark.parametrize(
    "case,error",
    [
        ("w4 g32 asym static-groups", "Unsupported quantization config: bits=4, sym=False"),
        ("w4 g32 sym act-order", "GPTQ group activation ordering (desc_act=True) is no longer supported"),
        ("w3 g32 sym static-groups", "Unsupported quantization config: bits=3, sym=True"),
    ],
)
def test_vllm_refuses_what_its_gptq_kernels_do_not_run(vllm, case, error):
    # vLLM 0.33.0 has one GPTQ config class (AutoGPTQConfig, Marlin-family kernels): symmetric 4/8-bit
    # only, no zero-points, no act-order groups, and it never reads checkpoint_format.  These exports
    # load in GPTQModel (test_gptqmodel_peer.py); for vLLM use compressed-tensors, which takes all three.
    assert vllm[case]["method"] == "auto_gptq"
    assert error in vllm[case]["error"], vllm[case]["error"]
