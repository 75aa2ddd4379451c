"""``bitmosaic export --format gguf``: GGUF files for llama.cpp, proven by independent readers.

The file is read back with ``gguf.GGUFReader``, every tensor dequantized with ``gguf.quants`` (llama.cpp's
reference formulas, not our packer) and, for Llama's q/k projections, compared after llama.cpp's own
convert-time row permutation (written here from ``convert_hf_to_gguf.py``'s description, not taken from
the exporter): the weights must equal bitmosaic's bit for bit.  transformers' GGUF loader reads the file
into a model whose logits match the bitmosaic model's.  Refusals are one line (exit code 2 in the CLI).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import bitmosaic
from bitmosaic.cli import main
from bitmosaic.io import save_quantized
from bitmosaic.io.export import ExportError, export_model
from bitmosaic.io.export.gguf import default_types
from bitmosaic.io.saved.save import quantized_modules
from bitmosaic.testing import tiny_gguf
from tests.io.test_gguf_checkpoint import _transformers

CALIB = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))
HEADS, KV_HEADS = 4, 2  # tiny_gguf's


def _read(path: Path) -> tuple[dict, dict]:
    """``({GGUF name: (type name, float32 [rows, cols])}, {key: value})`` of a GGUF file, by gguf-py."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = GGUFReader(os.fspath(path))
    tensors = {t.name: (t.tensor_type.name, np.asarray(dequantize(t.data, t.tensor_type))) for t in r.tensors}
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return tensors, fields


def _to_file_rows(w: np.ndarray, gname: str, arch: str) -> np.ndarray:
    """A model (Hugging Face) weight in the row order llama.cpp's converter stores: its ``permute`` of
    Llama's q (heads) and k (kv heads) rows, ``reshape(n, 2, rows/n/2, ...).swapaxes(1, 2)`` (Qwen: as is)."""
    if arch != "llama":
        return w
    n = HEADS if gname.endswith("attn_q.weight") else KV_HEADS if gname.endswith("attn_k.weight") else 0
    if not n:
        return w
    return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_CACHE: dict = {}


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf_sources")


def _quantized(root, arch="llama", **opts) -> tuple[Path, Path]:
    """``(saved folder, source GGUF)`` of a tiny model of ``arch`` quantized with GPTQ ``opts`` (made once
    per module in ``root``, the module's shared folder; the tests never change it)."""
    opts = {"bits": 4, "group_size": 32, "order": "natural", **opts}
    key = (str(root), arch, tuple(sorted(opts.items())))
    if key not in _CACHE:
        src = root / f"{arch}.gguf"
        if not src.exists():
            tiny_gguf(src, arch, tied=False)
        m = _transformers(src)
        bitmosaic.quantize_(m, "gptq", CALIB, progress=False, source_model=str(src), **opts)
        _CACHE[key] = (save_quantized(m, root / f"q{len(_CACHE)}"), src)
    return _CACHE[key]


def _check_weights(folder: Path, out: Path, arch: str) -> dict[str, str]:
    """Every quantized weight of the file, dequantized by gguf-py, equals bitmosaic's bit for bit;
    returns each layer's GGUF type."""
    import gguf

    tensors, _ = _read(out)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), 2)
    types = {}
    for name, mod in quantized_modules(bitmosaic.load(folder)).items():
        gname = names.get_name(name) + ".weight"
        typ, got = tensors[gname]
        want = _to_file_rows(mod.dequantize_reference(torch.float32).numpy(), gname, arch)
        assert got.shape == want.shape and np.array_equal(got, want), (name, typ)
        types[name] = typ
    return types


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_symmetric_4bit_is_q4_0_bit_for_bit(shared_dir, arch, tmp_path):
    folder, src = _quantized(shared_dir, arch, sym=True)
    res = export_model(folder, tmp_path / "m.gguf", "gguf")
    assert not res.changed and res.summary()["max_abs"] == 0.0
    assert set(_check_weights(folder, tmp_path / "m.gguf", arch).values()) == {"Q4_0"}
    # metadata and tokenizer as in the source file; every other tensor exactly the source's values
    (got, meta), (want, src_meta) = _read(tmp_path / "m.gguf"), _read(src)
    for k, v in src_meta.items():
        if k not in ("general.file_type", "general.quantization_version"):
            assert meta[k] == v, k
    assert meta["general.file_type"] == 2 and meta["general.quantized_by"].startswith("bitmosaic")
    assert set(got) == set(want)
    for g, (_, w) in want.items():
        if w.ndim == 1 or "norm" in g:
            assert got[g][0] == "F32" and np.array_equal(got[g][1], w), g
    assert np.array_equal(got["token_embd.weight"][1], want["token_embd.weight"][1])


def test_transformers_reads_the_file_with_the_same_logits(shared_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, _ = _quantized(shared_dir, sym=True)
    export_model(folder, tmp_path / "m.gguf", "gguf")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    ours = bitmosaic.load(folder).eval()
    with torch.inference_mode():
        a, b = ours(CALIB[:2]).logits, theirs(CALIB[:2]).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits,sym,want", [(8, True, "Q8_0"), (5, True, "Q5_0"), (3, True, "Q4_0"),
                                           (2, False, None), (4, False, None), (5, False, None)])  # fmt: skip
def test_each_width_and_symmetry_exports_exactly_by_default(shared_dir, bits, sym, want, tmp_path):
    folder, _ = _quantized(shared_dir, bits=bits, sym=sym)
    res = export_model(folder, tmp_path / "m.gguf", "gguf")
    types = set(_check_weights(folder, tmp_path / "m.gguf", "llama").values())
    assert not res.changed
    assert types == {want} if want else types <= set(default_types(bits, sym)), types


def test_the_default_gptq_result_exports_exactly(shared_dir, tmp_path):
    """``--method gptq --bits 4`` with its defaults (act-order, auto groups: static at 4 bits, asymmetric)
    has contiguous groups, so the default GGUF type holds it bit for bit (no --lossy)."""
    folder, _ = _quantized(shared_dir, order="act")
    res = export_model(folder, tmp_path / "m.gguf", "gguf")
    types = set(_check_weights(folder, tmp_path / "m.gguf", "llama").values())
    assert not res.changed and types <= set(default_types(4, False)), types


def test_asymmetric_q4_1_rounds_offsets_only_with_lossy(shared_dir, tmp_path):
    folder, _ = _quantized(shared_dir, sym=False)
    with pytest.raises(ExportError, match=r"^cannot export as gguf: asymmetric offsets .* --lossy") as e:
        export_model(folder, tmp_path / "m.gguf", "gguf", gguf_type="Q4_1")
    assert "\n" not in str(e.value)
    res = export_model(folder, tmp_path / "m.gguf", "gguf", gguf_type="Q4_1", lossy=True)
    assert res.changed and all("offsets m rounded" in r.changes[0] for r in res.changed)
    assert 0 < res.summary()["max_rel_err"] < 1e-3  # m to fp16: below 2**-11 of m
    tensors, _ = _read(tmp_path / "m.gguf")
    assert tensors["blk.0.attn_q.weight"][0] == "Q4_1"
    # a wider type holds narrower integers exactly
    res = export_model(folder, tmp_path / "m.gguf", "gguf", gguf_type="q8_0", overwrite=True)
    assert not res.changed and set(_check_weights(folder, tmp_path / "m.gguf", "llama").values()) == {"Q8_0"}


@pytest.mark.parametrize("opts,typ,reason", [
    ({"order": "act", "static_groups": False}, None, "act-order groups (g_idx)"),
    ({"group_size": 16}, None, "groups of 16 columns"),
    ({"bits": 8, "sym": True}, "Q4_0", "8-bit integers wider than Q4_0"),
    ({"sym": False}, "Q4_0", "asymmetric integers outside [-8, 7]"),
])  # fmt: skip
def test_what_a_type_cannot_hold_is_refused_in_one_line_and_lossy_re_rounds(
    shared_dir, opts, typ, reason, tmp_path
):
    folder, _ = _quantized(shared_dir, **opts)
    with pytest.raises(ExportError) as e:
        export_model(folder, tmp_path / "m.gguf", "gguf", gguf_type=typ)
    msg = str(e.value)
    assert msg.startswith("cannot export as gguf:") and reason in msg and "--lossy" in msg and "\n" not in msg
    assert not (tmp_path / "m.gguf").exists() and not [
        p for p in tmp_path.iterdir() if p.name.startswith(".")
    ]
    res = export_model(folder, tmp_path / "m.gguf", "gguf", gguf_type=typ, lossy=True)
    assert len(res.changed) == len(res.records) and 0 < res.summary()["max_rel_err"] < 0.5
    assert all("re-rounded with llama.cpp's" in r.changes[-1] for r in res.records)


def test_quantized_weights_as_f32_are_exact(shared_dir, tmp_path):
    folder, _ = _quantized(shared_dir, sym=True)
    res = export_model(folder, tmp_path / "m.gguf", "gguf", gguf_type="F32")
    assert not res.changed and set(_check_weights(folder, tmp_path / "m.gguf", "llama").values()) == {"F32"}


def test_the_float_model_exports_in_the_smallest_exact_float_type(tmp_path):
    """A float model argument: every matrix in the first of (its source block type, F16, BF16, F32) that
    holds it exactly; F16 for all of them is refused unless --lossy."""
    src = tiny_gguf(tmp_path / "f.gguf", "llama", tied=False)
    res = export_model(f"gguf:{src}", tmp_path / "m.gguf", "gguf")
    assert not res.records
    (got, meta), (want, _) = _read(tmp_path / "m.gguf"), _read(src)
    for g, (typ, w) in want.items():
        w_file = got[g][1]
        assert np.array_equal(w_file, w), g  # the float model's values exactly (rows in the file's order)
        floats = {"F16": {"F16"}, "BF16": {"F16", "BF16"}, "F32": {"F16", "BF16", "F32"}}
        allowed = floats.get(typ, {typ, "F16", "BF16", "F32"})  # a block type when requantizing is exact
        assert got[g][0] in allowed, (g, typ, got[g][0])
    assert got["token_embd.weight"][0] == want["token_embd.weight"][0] == "Q8_0"  # requantizing is exact
    with pytest.raises(ExportError, match=r"F16 cannot hold \d+ tensor\(s\) exactly .* --lossy"):
        export_model(f"gguf:{src}", tmp_path / "m.gguf", "gguf", gguf_type="F16", overwrite=True)
    export_model(f"gguf:{src}", tmp_path / "m.gguf", "gguf", gguf_type="F16", lossy=True, overwrite=True)
    got, meta = _read(tmp_path / "m.gguf")
    assert {typ for typ, w in got.values() if w.ndim == 2} == {"F16"} and meta["general.file_type"] == 1
    with pytest.raises(ExportError, match="has no quantized layers"):
        export_model(f"gguf:{src}", tmp_path / "q.gguf", "gguf", gguf_type="Q4_0")


def test_cli_gguf_export_and_its_refusals(shared_dir, tmp_path, capsys):
    folder, _ = _quantized(shared_dir, sym=True)
    out = str(tmp_path / "m.gguf")
    assert main(["export", str(folder), "--format", "gguf", "--out", out]) == 0
    text = capsys.readouterr().out
    assert "as gguf" in text and "bit-identical" in text and "Q4_0 x14" in text

    def refused(*args) -> str:
        assert main(["export", str(folder), "--format", "gguf", "--out", out, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err
        return err

    assert "--overwrite" in refused()
    assert "unknown --gguf-type 'Q3_0'" in refused("--gguf-type", "q3_0", "--overwrite")
    assert "apply to --format gguf only" in refused("--gguf-type", "Q4_0", "--format", "gptq")
    user = tmp_path / "user.gguf"
    user.write_bytes(b"not mine")
    assert main(["export", str(folder), "--format", "gguf", "--out", str(user), "--overwrite"]) == 2
    assert "never replaced" in capsys.readouterr().err and user.read_bytes() == b"not mine"
    assert main(["export", str(folder), "--format", "gguf", "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert main(["export", str(folder), "--format", "gguf", "--out", out, "--overwrite"]) == 0


def test_a_model_without_a_source_gguf_is_refused_naming_the_fix(tmp_path):
    from tests.helpers import tiny_llama

    m = tiny_llama()
    bitmosaic.quantize_(m, "rtn", CALIB % 64, progress=False, bits=4, group_size=32, sym=True)
    folder = save_quantized(m, tmp_path / "q")
    with pytest.raises(ExportError, match=r"not loaded from a GGUF file .* --source-gguf FILE"):
        export_model(folder, tmp_path / "m.gguf", "gguf")


def test_gemma_norms_are_refused_in_one_line(tmp_path):
    src = tiny_gguf(tmp_path / "g.gguf", "gemma2")
    with pytest.raises(ExportError, match=r"^cannot export as gguf: .* changes its values"):
        export_model(f"gguf:{src}", tmp_path / "m.gguf", "gguf")
