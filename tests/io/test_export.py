"""``bitmosaic export``: GPTQ and compressed-tensors checkpoints, proven by independent loaders.

- compressed-tensors: the ``compressed-tensors`` package (its registered compressors' ``decompress``,
  and the full ``transformers`` load, which runs it) dequantizes our export; the weights must equal ours
  bit for bit and the logits agree.
- GPTQ: transformers' GPTQ integration needs optimum + gptqmodel (not installed, heavy), so
  :func:`gptq_reference_unpack` below decodes the checkpoint from the format's public description
  (AutoGPTQ's ``pack``: a little-endian bit stream of 32-bit words along the input dimension, zeros
  along the output dimension, v1 zeros stored minus one), written independently of our packer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from bitmosaic import quantize_
from bitmosaic.cli import main
from bitmosaic.formats.wordpack import pack_words, unpack_words
from bitmosaic.io import load_quantized, save_quantized
from bitmosaic.io.export import MARKER, ExportError, export_model
from tests.helpers import SPECIALS, VOCAB, tiny_llama, word_tokenizer

CALIB = torch.randint(len(SPECIALS), VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
IDS = torch.tensor([[5, 9, 17, 33, 60, 2, 100, 7, 8, 44]])


# -- independent readers ----------------------------------------------------------------------------
def _bitstream_words(words: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Codes ``[rows, n]`` from int32 words ``[rows, nwords]``: the words' bits laid end to end (word 0
    first, each word's least significant bit first), cut into ``bits``-bit fields, first field first."""
    u8 = np.ascontiguousarray(words.astype("<i4")).view(np.uint8)  # little-endian bytes of each word
    stream = np.unpackbits(u8, axis=1, bitorder="little")[:, : n * bits]
    fields = stream.reshape(words.shape[0], n, bits).astype(np.int64)
    return (fields * (1 << np.arange(bits))).sum(axis=2)


def gptq_reference_unpack(sd: dict, name: str, qc: dict, in_features: int) -> torch.Tensor:
    """``W [out, in]`` float32 of a GPTQ layer, from the format's description (not our packer)."""
    bits = qc["bits"]
    qweight = sd[f"{name}.qweight"].numpy()  # [in*bits/32, out], packed along the input dimension
    q = _bitstream_words(qweight.T, bits, in_features)  # [out, in]
    qzeros = sd[f"{name}.qzeros"].numpy()  # [G, out*bits/32], packed along the output dimension
    out = q.shape[0]
    z = _bitstream_words(qzeros, bits, out).T  # [out, G]
    if qc["checkpoint_format"] == "gptq":
        z = z + 1  # v1 stores zero - 1
    scales = sd[f"{name}.scales"].float().numpy().T  # [out, G]
    g_idx = sd[f"{name}.g_idx"].numpy().astype(np.int64)
    if not qc["desc_act"]:
        g = in_features if qc["group_size"] == -1 else qc["group_size"]
        assert np.array_equal(g_idx, np.arange(in_features) // g)
    w = (q - z[:, g_idx]).astype(np.float32) * scales[:, g_idx].astype(np.float32)
    return torch.from_numpy(w)


def ct_decompress(folder: Path) -> dict[str, torch.Tensor]:
    """Every quantized layer's weight as compressed-tensors' own compressors decompress it."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    cfg = QuantizationConfig.model_validate(qc)
    sd = load_file(str(folder / "model.safetensors"))
    layers = sorted({k.rsplit(".", 1)[0] for k in sd if k.endswith(".weight_scale")})
    out = {}
    for name in layers:
        scheme = next(s for s in cfg.config_groups.values() if s.targets == ["Linear"] or name in s.targets)
        local = {k[len(name) + 1 :]: v for k, v in sd.items() if k.startswith(name + ".")}
        compressor = BaseCompressor.get_value_from_registry(scheme.format)
        out[name] = compressor.decompress(local, scheme)["weight"]
    return out


def float_logits(folder: Path, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of the float architecture with the exported plain tensors and the given weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg).eval()
    sd = load_file(str(folder / "model.safetensors"))
    plain = {k: v for k, v in sd.items() if not k.startswith(tuple(n + "." for n in weights))}
    model.load_state_dict({**plain, **{f"{n}.weight": w.float() for n, w in weights.items()}}, strict=False)
    model.tie_weights()
    with torch.no_grad():
        return model(IDS).logits


# -- fixtures ---------------------------------------------------------------------------------------
def quantized(tmp: Path, method: str, **opts) -> Path:
    m = tiny_llama(seed=3)
    quantize_(m, method, CALIB, progress=False, **opts)
    return save_quantized(m, tmp / "src", {"method": method}, tokenizer=word_tokenizer(), overwrite=True)


def ours(src: Path):
    model, _ = load_quantized(src)
    qmods = {n: m for n, m in model.named_modules() if hasattr(m, "layer_config")}
    with torch.no_grad():
        return model(IDS).logits, qmods


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= 1e-4 * float(b.abs().max())


# -- packing ----------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(1, 8), st.integers(1, 5), st.integers(1, 80), st.integers(0, 1), st.integers(0, 2**31))
def test_wordpack_matches_the_bitstream_description(bits, rows, n, dim, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, n) if dim == 1 else (n, rows), generator=g)
    words = pack_words(codes, bits, dim)
    assert words.dtype == torch.int32 and words.shape[dim] == -(-n * bits // 32)
    flat = (words if dim == 1 else words.t()).numpy()
    ref = _bitstream_words(flat, bits, n)
    assert np.array_equal(ref, (codes if dim == 1 else codes.t()).numpy())
    assert torch.equal(unpack_words(words, bits, n, dim), codes.to(torch.int32))


def test_gptq_three_bit_spills_across_words():
    codes = torch.zeros(32, 1, dtype=torch.int64)
    codes[10, 0] = 0b101  # bits 30..32: two low bits at the top of word 0, the high bit in word 1
    w = pack_words(codes, 3, dim=0)
    assert w.shape == (3, 1)
    assert int(w[0, 0]) & 0xFFFFFFFF == 0b01 << 30 and int(w[1, 0]) == 0b1


# -- GPTQ -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "method,opts,v2",
    [
        ("rtn", {"bits": 4, "group_size": 32, "symmetric": True}, False),
        ("rtn", {"bits": 4, "group_size": 32}, True),
        ("gptq", {"bits": 3, "group_size": 32, "static_groups": False, "symmetric": True}, False),  # g_idx
        ("gptq", {"bits": 4, "group_size": 48, "static_groups": False, "symmetric": True}, False),  # partial
        ("gptq", {"bits": 4, "group_size": 32, "static_groups": True, "symmetric": True}, False),  # no g_idx
        ("gptq", {"bits": 2, "group_size": None, "order": "gar"}, True),
        ("gptq", {"bits": 4, "group_size": 32}, True),  # the default: act-order, auto (static) groups
        ("rtn", {"bits": 8, "group_size": 32, "symmetric": True}, False),
    ],
)
def test_gptq_export_is_bit_identical(tmp_path, method, opts, v2):
    src = quantized(tmp_path, method, **opts)
    res = export_model(src, tmp_path / "out", "gptq", gptq_v2=v2)
    assert not res.changed
    out = tmp_path / "out"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["bits"] == opts["bits"]
    assert qc["checkpoint_format"] == ("gptq_v2" if v2 else "gptq")
    assert qc["sym"] == opts.get("symmetric", False)
    auto_dynamic = "static_groups" not in opts and opts.get("order", "act") == "act" and opts["bits"] < 4
    act_groups = opts.get("static_groups") is False or (method == "gptq" and auto_dynamic)
    assert qc["desc_act"] == act_groups  # act-order groups need a g_idx
    sd = load_file(str(out / "model.safetensors"))
    logits, qmods = ours(src)
    weights = {}
    for name, m in qmods.items():
        assert sd[f"{name}.qweight"].shape == (m.in_features * opts["bits"] // 32, m.out_features)
        assert sd[f"{name}.scales"].dtype == torch.float16
        g = qc["group_size"]
        assert sd[f"{name}.scales"].shape[0] == (1 if g == -1 else m.in_features // g)
        weights[name] = gptq_reference_unpack(sd, name, qc, m.in_features)
        assert torch.equal(weights[name], m.dequantize_reference(torch.float32)), name
    assert close(float_logits(out, weights), logits)
    assert (out / "tokenizer.json").is_file()


def test_gptq_v1_refuses_a_zero_of_zero_and_the_default_writes_v2(tmp_path):
    m = tiny_llama(seed=3)
    quantize_(m, "rtn", CALIB, progress=False, bits=4, group_size=32)
    q = m.model.layers[0].self_attn.q_proj
    q.zeros[0, 0] = 0  # an asymmetric group whose zero-point is 0
    src = save_quantized(m, tmp_path / "src", {"method": "rtn"})
    with pytest.raises(ExportError, match="zero-point 0.*--gptq-format v2"):
        export_model(src, tmp_path / "out", "gptq", gptq_v2=False)
    assert not (tmp_path / "out").exists()
    export_model(src, tmp_path / "out", "gptq")  # auto: asymmetric -> gptq_v2
    sd = load_file(str(tmp_path / "out" / "model.safetensors"))
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["checkpoint_format"] == "gptq_v2" and qc["sym"] is False
    name = "model.layers.0.self_attn.q_proj"
    assert torch.equal(gptq_reference_unpack(sd, name, qc, 64), q.dequantize_reference(torch.float32))


@pytest.mark.parametrize("symmetric,fmt", [(True, "gptq"), (False, "gptq_v2")])
def test_gptq_default_checkpoint_format_follows_symmetry(tmp_path, symmetric, fmt, capsys):
    """Symmetric checkpoints stay v1 (every GPTQ loader, vLLM's Marlin); asymmetric ones are written v2,
    since GPTQModel refuses asymmetric v1 (benchmarks/results/gptqmodel_check.md).  The CLI's
    ``--gptq-format`` overrides it, ``--gptq-v2`` is ``--gptq-format v2``."""
    src = quantized(tmp_path, "gptq", bits=4, group_size=32, symmetric=symmetric)

    def written(out):
        return json.loads((out / "config.json").read_text())["quantization_config"]["checkpoint_format"]

    assert written(export_model(src, tmp_path / "auto", "gptq").out) == fmt
    cases = [([], fmt), (["--gptq-format", "auto"], fmt), (["--gptq-format", "v2"], "gptq_v2"),
             (["--gptq-v2"], "gptq_v2")]  # fmt: skip
    if symmetric:  # an asymmetric v1 export holds only layers without a zero of 0 (test above)
        cases.append((["--gptq-format", "v1"], "gptq"))
    for i, (flags, want) in enumerate(cases):
        out = tmp_path / f"cli{i}"
        rc = main(["export", str(src), "--format", "gptq", "--out", str(out), *flags])
        assert rc == 0, capsys.readouterr().err
        assert written(out) == want, flags
    rc = main(["export", str(src), "--format", "compressed-tensors", "--out", str(tmp_path / "ct"),
               "--gptq-format", "v1"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["error: --gptq-format applies to --format gptq only"], err


# -- compressed-tensors ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "method,opts,fmt",
    [
        ("rtn", {"bits": 4, "group_size": 32}, "pack-quantized"),
        ("gptq", {"bits": 3, "group_size": 48, "order": "gar", "symmetric": True}, "pack-quantized"),
        ("gptq", {"bits": 4, "group_size": 32}, "pack-quantized"),  # the default result (static groups)
        ("awq", {"bits": 4, "group_size": None}, "pack-quantized"),
        ("smoothquant", {"scheme": "W8A8", "group_size": None, "symmetric": True}, "int-quantized"),
        ("fp8", {}, "float-quantized"),
    ],
)
def test_compressed_tensors_export_is_bit_identical(tmp_path, method, opts, fmt):
    src = quantized(tmp_path, method, **opts)
    res = export_model(src, tmp_path / "out", "compressed-tensors")
    assert not res.changed
    out = tmp_path / "out"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == fmt and qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
    got = ct_decompress(out)
    logits, qmods = ours(src)
    assert set(got) == set(qmods)
    for name, m in qmods.items():
        assert torch.equal(got[name], m.dequantize_reference(got[name].dtype)), name
    if fmt == "int-quantized":  # W8A8: dynamic per-token INT8 activations, as compressed-tensors names them
        act = next(iter(qc["config_groups"].values()))["input_activations"]
        assert act == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    else:
        assert close(float_logits(out, got), logits)


def test_a_dynamic_activation_clip_ratio_is_refused_by_compressed_tensors(tmp_path):
    """compressed-tensors scales dynamic activations by their full maximum: a clip ratio would change
    the integers its runtime computes, so the export refuses in one line and writes nothing."""
    from bitmosaic.formats.act import ActQuantSpec

    act = ActQuantSpec("int", 8, clip_ratio=0.9)
    src = quantized(tmp_path, "smoothquant", bits=8, group_size=None, symmetric=True, act=act)
    with pytest.raises(ExportError, match="a dynamic clip ratio of 0.9") as e:
        export_model(src, tmp_path / "out", "compressed-tensors")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("symmetric", [True, False])
def test_transformers_loads_the_compressed_tensors_export(tmp_path, symmetric):
    """The full loader: transformers + compressed-tensors decompress the checkpoint on their own
    (asymmetric: after the work-around for compressed-tensors' meta zero-point shape)."""
    from transformers import AutoModelForCausalLM

    from bitmosaic.io.export import fix_compressed_tensors_loading

    src = quantized(tmp_path, "gptq", bits=4, group_size=32, order="gar", symmetric=symmetric)
    export_model(src, tmp_path / "out", "compressed-tensors")
    if not symmetric:
        fix_compressed_tensors_loading()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(IDS).logits  # the first forward decompresses
    logits, qmods = ours(src)
    for name, m in qmods.items():
        assert torch.equal(model.get_submodule(name).weight, m.dequantize_reference(torch.float32)), name
    assert close(theirs, logits)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_asymmetric_pack_quantized_equals_compressed_tensors_own_compress(tmp_path, bits):
    """Our ``weight_packed`` and packed ``weight_zero_point`` are what compressed-tensors' own
    compressor writes for the same weights, scales and zero-points, bit for bit (so the zero-point
    shape transformers trips on is the library's own; see docs/compressed_tensors_zero_point.md)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    src = quantized(tmp_path, "rtn", bits=bits, group_size=32)
    export_model(src, tmp_path / "out", "compressed-tensors")
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    scheme = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    assert not scheme.weights.symmetric and scheme.format == "pack-quantized"
    sd = load_file(str(tmp_path / "out" / "model.safetensors"))
    _, qmods = ours(src)
    half = 1 << (bits - 1)
    for name, m in qmods.items():
        theirs = PackedQuantizationCompressor.compress(
            {
                "weight": m.dequantize_reference(torch.float32),
                "weight_scale": m.scales.to(torch.float16),
                "weight_zero_point": (m.zeros.round().to(torch.int32) - half).to(torch.int8),
            },
            scheme,
        )
        for k in ("weight_packed", "weight_zero_point"):
            assert theirs[k].dtype == sd[f"{name}.{k}"].dtype and torch.equal(theirs[k], sd[f"{name}.{k}"]), (
                name,
                k,
            )


def test_the_compressed_tensors_work_around_is_idempotent_and_exact():
    from bitmosaic.io.export.ct_compat import fix_compressed_tensors_loading, meta_zero_point_is_packed

    fix_compressed_tensors_loading()
    assert meta_zero_point_is_packed()
    assert fix_compressed_tensors_loading()  # a second call changes nothing
    assert meta_zero_point_is_packed()


# -- refusals and --lossy ---------------------------------------------------------------------------
def test_act_order_is_refused_by_compressed_tensors_and_lossy_reports_the_error(tmp_path):
    src = quantized(tmp_path, "gptq", bits=4, group_size=32, order="act", static_groups=False)
    with pytest.raises(ExportError, match="act-order groups.*--lossy"):
        export_model(src, tmp_path / "out", "compressed-tensors")
    res = export_model(src, tmp_path / "out", "compressed-tensors", lossy=True)
    got = ct_decompress(tmp_path / "out")
    _, qmods = ours(src)
    for r in res.records:
        ref = qmods[r.name].dequantize_reference(torch.float32)
        d = got[r.name].double() - ref.double()
        assert r.changes and r.rel_err > 0
        assert r.rel_err == pytest.approx(float(d.norm() / ref.double().norm()), rel=1e-3)
    report = json.loads((tmp_path / "out" / MARKER).read_text())
    assert report["summary"]["changed_layers"] == len(qmods)


@pytest.mark.parametrize("method,why", [("hrtn", "Huffman"), ("ssqr", "CSR outliers")])
def test_unrepresentable_results_are_refused_then_exported_lossy(tmp_path, method, why):
    opts = {"bits": 4, "group_size": 32, "order": "gar"} if method == "ssqr" else {}
    src = quantized(tmp_path, method, **opts)
    for fmt in ("gptq", "compressed-tensors"):
        with pytest.raises(ExportError, match=why):
            export_model(src, tmp_path / fmt, fmt)
        res = export_model(
            src, tmp_path / fmt, fmt, lossy=True, **({"gptq_v2": True} if fmt == "gptq" else {})
        )
        assert res.changed and all(why in " ".join(r.changes) for r in res.records)
        if method == "hrtn":  # small integers with one scale per matrix: a wider grid holds them exactly
            assert res.summary()["max_abs"] == 0.0
        else:
            assert res.summary()["mean_rel_err"] > 0


def test_dpq_exports_lossy_as_fp8_exactly_in_compressed_tensors(tmp_path):
    src = quantized(tmp_path, "dpq", bits=4, group_size=32)
    with pytest.raises(ExportError, match="DPQ"):
        export_model(src, tmp_path / "ct", "compressed-tensors")
    res = export_model(src, tmp_path / "ct", "compressed-tensors", lossy=True)
    assert res.summary()["max_abs"] == 0.0  # its FP8 weight operand times s_w: the same values
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    scheme = next(iter(qc["config_groups"].values()))
    assert qc["format"] == "float-quantized" and scheme["input_activations"]["strategy"] == "tensor"
    got = ct_decompress(tmp_path / "ct")
    _, qmods = ours(src)
    for name, m in qmods.items():
        assert torch.equal(got[name], m.dequantize_reference(torch.float32))
    sd = load_file(str(tmp_path / "ct" / "model.safetensors"))
    assert sd["model.layers.0.self_attn.q_proj.input_scale"].shape == (1,)
    res = export_model(src, tmp_path / "g", "gptq", lossy=True, gptq_v2=True)
    assert res.summary()["mean_rel_err"] > 0  # as INT codes with scales s * s_w: the FP8 rounding is lost


def test_mixed_bit_widths(tmp_path):
    """One scheme per layer in compressed-tensors; GPTQ has one ``bits`` (refused; --lossy widens exactly)."""
    m4, m8 = tiny_llama(seed=3), tiny_llama(seed=3)
    quantize_(m4, "rtn", CALIB, progress=False, bits=4, group_size=32, symmetric=True)
    quantize_(m8, "rtn", CALIB, progress=False, bits=8, group_size=32, symmetric=True)
    m4.model.layers[1].mlp.down_proj = m8.model.layers[1].mlp.down_proj
    src = save_quantized(m4, tmp_path / "src", {"method": "rtn"})
    export_model(src, tmp_path / "ct", "compressed-tensors")
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    by_bits = {g["weights"]["num_bits"]: g["targets"] for g in qc["config_groups"].values()}
    assert by_bits[8] == ["model.layers.1.mlp.down_proj"] and len(by_bits[4]) == 13
    got = ct_decompress(tmp_path / "ct")
    _, qmods = ours(src)
    assert all(torch.equal(got[n], qm.dequantize_reference(got[n].dtype)) for n, qm in qmods.items())
    with pytest.raises(ExportError, match="different bit widths"):
        export_model(src, tmp_path / "g", "gptq")
    res = export_model(src, tmp_path / "g", "gptq", lossy=True)
    assert len(res.changed) == 13 and res.summary()["max_abs"] == 0.0  # 4-bit codes on the 8-bit grid


# -- output folder and CLI --------------------------------------------------------------------------
def test_output_folder_rules(tmp_path):
    src = quantized(tmp_path, "rtn", bits=4, group_size=32, symmetric=True)
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="never replaced"):
        export_model(src, user, "gptq")
    assert (user / "notes.txt").read_text() == "mine"
    with pytest.raises(ExportError, match="source folder"):
        export_model(src, src, "gptq")
    export_model(src, tmp_path / "out", "gptq")
    with pytest.raises(ExportError, match="--overwrite"):
        export_model(src, tmp_path / "out", "compressed-tensors")
    export_model(src, tmp_path / "out", "compressed-tensors", overwrite=True)
    assert (
        json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["quant_method"]
        == "compressed-tensors"
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_cli_export(tmp_path, capsys):
    src = quantized(tmp_path, "hrtn")
    out = str(tmp_path / "out")
    assert main(["export", str(src), "--format", "gptq", "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot export as gptq") and "\n" not in err and "--lossy" in err
    assert main(["export", str(src), "--format", "compressed-tensors", "--out", out, "--lossy"]) == 0
    text = capsys.readouterr().out
    assert "lossy:" in text and "| Huffman-coded integers" in text
    src2 = quantized(tmp_path, "rtn", bits=4, group_size=32, symmetric=True)
    assert main(["export", str(src2), "--format", "gptq", "--out", out, "--overwrite"]) == 0
    assert "bit-identical" in capsys.readouterr().out


# -- SmolLM2 ----------------------------------------------------------------------------------------
@pytest.mark.model
def test_smollm2_exports_load_in_independent_loaders(tmp_path, smollm):
    """SmolLM2-135M, RTN W4 g128 symmetric (576 columns: a partial last group, split exactly)."""
    import copy

    from transformers import AutoModelForCausalLM

    model, tok = smollm
    m = copy.deepcopy(model)
    quantize_(
        m, "rtn", torch.zeros(1, 8, dtype=torch.long), progress=False, bits=4, group_size=128, symmetric=True
    )
    src = save_quantized(m, tmp_path / "src", {"method": "rtn"}, tokenizer=tok)
    del m
    logits, qmods = ours(src)
    ct = export_model(src, tmp_path / "ct", "compressed-tensors")
    assert not ct.changed and any("partial last group" in n for n in ct.notes)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(IDS).logits
    q = "model.layers.0.self_attn.q_proj"
    assert torch.equal(hf.get_submodule(q).weight, qmods[q].dequantize_reference(torch.float32))
    assert close(theirs, logits)
    del hf
    export_model(src, tmp_path / "gptq", "gptq")
    qc = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    assert qc["group_size"] == 64 and qc["sym"] and not qc["desc_act"]  # gcd(128, 576): full groups
    sd = load_file(str(tmp_path / "gptq" / "model.safetensors"))
    for name in (q, "model.layers.29.mlp.down_proj"):
        w = gptq_reference_unpack(sd, name, qc, qmods[name].in_features)
        assert torch.equal(w, qmods[name].dequantize_reference(torch.float32)), name
