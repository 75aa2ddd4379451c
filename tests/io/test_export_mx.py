"""Microscaling exports (issue 75): compressed-tensors checkpoints as llm-compressor writes them, read
back by compressed-tensors' own decompressors and by transformers; GGUF MXFP4 read by the gguf package."""

from __future__ import annotations

import json

import pytest
import torch

from bitmosaic.io.export import ExportError, export_model
from tests.io.test_export import IDS, ct_decompress, ours, quantized

pytest.importorskip("compressed_tensors")

CASES = [
    ("NVFP4A16", "nvfp4-pack-quantized", {"strategy": "tensor_group", "group_size": 16, "num_bits": 4}),
    ("MXFP4A16", "mxfp4-pack-quantized", {"strategy": "group", "group_size": 32, "num_bits": 4}),
    ("MXFP8A16", "mxfp8-quantized", {"strategy": "group", "group_size": 32, "num_bits": 8}),
    ("FP8_BLOCK", "float-quantized", {"strategy": "block", "block_structure": [128, 128], "num_bits": 8}),
]


@pytest.mark.parametrize("scheme,fmt,args", CASES)
def test_compressed_tensors_reads_our_microscaling_bytes(tmp_path, scheme, fmt, args):
    src = quantized(tmp_path, "gptq", scheme=scheme)
    res = export_model(src, tmp_path / "out", "compressed-tensors")
    assert not res.changed
    out = tmp_path / "out"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == fmt and qc["ignore"] == ["lm_head"]
    group = next(iter(qc["config_groups"].values()))
    assert args.items() <= group["weights"].items() and group["weights"]["type"] == "float"
    if scheme == "FP8_BLOCK":  # llm-compressor's FP8_BLOCK inputs
        assert group["input_activations"] == {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": "group",
            "dynamic": True,
            "group_size": 128,
        }
    got = ct_decompress(out)
    logits, qmods = ours(src)
    assert set(got) == set(qmods)
    for name, m in qmods.items():
        ref = m.dequantize_reference(torch.float32)
        if got[name].dtype == torch.float32:
            assert torch.equal(got[name], ref), name
        else:  # their decompressors compute in bfloat16: our weights rounded once to it
            assert torch.allclose(got[name].float(), ref, rtol=2**-7, atol=0), name


@pytest.mark.parametrize("scheme,fmt", [("NVFP4", "nvfp4-pack-quantized"), ("MXFP4", "mxfp4-pack-quantized"),
                                        ("MXFP8", "mxfp8-quantized")])  # fmt: skip
def test_microscaled_activations_export_as_llm_compressor_writes_them(tmp_path, scheme, fmt):
    """W4A4 / W8A8: ``input_activations`` equal to llm-compressor's preset (as compressed-tensors
    serializes it) and read back by compressed-tensors; NVFP4's calibrated tensor scale as
    ``input_global_scale``; the weights as before."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from safetensors.torch import load_file

    src = quantized(tmp_path, "rtn", scheme=scheme)
    res = export_model(src, tmp_path / "out", "compressed-tensors")
    assert not res.changed
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == fmt
    group = next(iter(qc["config_groups"].values()))
    preset = PRESET_SCHEMES[scheme]["input_activations"]
    assert group["input_activations"] == preset.model_dump(mode="json")
    back = QuantizationConfig.model_validate(qc)  # read as it reads llm-compressor's own config.json
    theirs = QuantizationArgs.model_validate(preset.model_dump(mode="json"))
    assert next(iter(back.config_groups.values())).input_activations == theirs
    sd = load_file(str(tmp_path / "out" / "model.safetensors"))
    _, qmods = ours(src)
    for name, m in qmods.items():
        if scheme == "NVFP4":
            assert torch.equal(sd[f"{name}.input_global_scale"], m.input_quant.scale)
            assert float(m.input_quant.scale) != 1.0  # calibrated
        else:
            assert not any(k.startswith(f"{name}.input_") for k in sd)
    got = ct_decompress(tmp_path / "out")
    assert set(got) == set(qmods)


@pytest.mark.parametrize("scheme", ["NVFP4A16", "MXFP4A16"])
def test_transformers_loads_the_fp4_export(tmp_path, scheme):
    from transformers import AutoModelForCausalLM

    src = quantized(tmp_path, "rtn", scheme=scheme)
    export_model(src, tmp_path / "out", "compressed-tensors")
    # compressed-tensors decompresses FP4 to bfloat16 whatever the model's dtype: load in bfloat16
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = model(IDS).logits.float()
    logits, qmods = ours(src)
    for name, m in qmods.items():
        w = model.get_submodule(name).weight.float()
        assert torch.allclose(w, m.dequantize_reference(torch.float32), rtol=2**-7, atol=0), name
    assert float((theirs - logits).abs().max()) < 5e-2 * float(logits.abs().max())  # bfloat16 compute


def test_e5m2_mxfp8_is_refused_in_one_line(tmp_path):
    src = quantized(tmp_path, "rtn", wfmt="mxfp8-e5m2")
    with pytest.raises(ExportError, match="mxfp8-e5m2") as e:
        export_model(src, tmp_path / "out", "compressed-tensors")
    assert "\n" not in str(e.value)


# -- GGUF MXFP4 -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf_mx")


def test_gguf_mxfp4_is_read_back_by_the_gguf_package_bit_for_bit(gguf_dir, tmp_path):
    from tests.io.test_export_gguf import _check_weights, _quantized, _read

    folder, _ = _quantized(gguf_dir, "llama", scheme="MXFP4A16")
    res = export_model(folder, tmp_path / "m.gguf", "gguf")
    assert not res.changed and res.summary()["max_abs"] == 0.0
    assert set(_check_weights(folder, tmp_path / "m.gguf", "llama").values()) == {"MXFP4"}
    assert _read(tmp_path / "m.gguf")[1]["general.file_type"] == 38  # MOSTLY_MXFP4_MOE


def test_gguf_mxfp4_refuses_other_layers_in_one_line(gguf_dir, tmp_path):
    from tests.io.test_export_gguf import _quantized

    folder, _ = _quantized(gguf_dir, "llama", scheme="NVFP4A16")
    with pytest.raises(ExportError, match="not MXFP4") as e:
        export_model(folder, tmp_path / "m.gguf", "gguf", gguf_type="MXFP4")
    assert "\n" not in str(e.value)
    res = export_model(folder, tmp_path / "m.gguf", "gguf", gguf_type="MXFP4", lossy=True)
    assert res.changed
