"""IQ4_NL / IQ4_XS from calibrated integers (issue 72): GPTQ on llama.cpp's non-linear grid, exported exactly.

The bytes are read back with ``gguf.quants.dequantize`` (gguf-py's transcription of ggml's formulas, not
our packer) and must equal the solver's own float weights bit for bit; the saved model round-trips; the
export needs no ``--lossy``; llama.cpp (llama-cpp-python, where installed) runs the file with logits that
follow bitmosaic's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import bitmosaic
from benchmarks.moe.gguf_llamacpp import llama_cpp_logits
from bitmosaic.algorithms.gguf_grid import importance, iq_gptq, iq_scales
from bitmosaic.cli import main
from bitmosaic.formats import gguf_iq as iq
from bitmosaic.io import save_quantized
from bitmosaic.io.export import ExportError, export_model
from bitmosaic.io.saved.save import quantized_modules
from bitmosaic.testing import tiny_gguf
from tests.io.test_export_gguf import CALIB, _check_weights
from tests.io.test_gguf_checkpoint import _transformers


def _hessian(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(4 * n, n, generator=g) * torch.linspace(0.2, 3, n)
    return X.T @ X / X.shape[0]


@pytest.mark.parametrize("typ", sorted(iq.IQ_TYPES))
def test_packed_blocks_read_back_with_gguf_quants(typ):
    from gguf import quants

    t = iq.IQ_TYPES[typ]
    g = torch.Generator().manual_seed(3)
    out, n = 5, 512
    codes = torch.randint(0, 16, (out, n), generator=g, dtype=torch.uint8)
    d = (torch.randn(out, n // t.block, generator=g) * 0.01).half()
    l = torch.randint(t.l_lo, t.l_hi + 1, (out, n // iq.SUB), generator=g).to(torch.int8)
    data = iq.pack(codes, d, l, t)
    assert data.shape == (out, iq.row_bytes(t, n))
    got = np.asarray(quants.dequantize(data, t.qtype)).reshape(out, n)
    assert np.array_equal(got, iq.dequantize(codes, d, l, t).numpy())
    c2, d2, l2 = iq.unpack(data, t, n)
    assert (
        torch.equal(c2, codes)
        and torch.equal(d2.view(torch.int16), d.view(torch.int16))
        and torch.equal(l2, l)
    )


@pytest.mark.parametrize("typ", sorted(iq.IQ_TYPES))
def test_gptq_on_the_grid_is_exact_and_beats_nearest_rounding(typ):
    """The solver's weights are the stored blocks' (bit for bit), and error feedback lowers the
    Hessian-weighted error below nearest rounding with the same stored scales."""
    from gguf import quants

    t = iq.IQ_TYPES[typ]
    g = torch.Generator().manual_seed(1)
    out, n = 48, 512
    W = torch.randn(out, n, generator=g) * 0.05
    H = _hessian(n)
    res = iq_gptq(W, H, typ)
    data = iq.pack(*res.stored(), t)
    got = torch.from_numpy(np.asarray(quants.dequantize(data, t.qtype)).reshape(out, n))
    assert torch.equal(got, res.dequantize())
    d, l = iq_scales(W, importance(H), t)
    assert torch.equal(res.stored()[1].view(torch.int16), d.view(torch.int16)) and torch.equal(
        res.stored()[2], l
    )
    dl = (d.float().repeat_interleave(t.nsub, 1) * l.float()).repeat_interleave(iq.SUB, 1)
    kv = iq.grid()
    nearest = (W[..., None] - dl[..., None] * kv).abs().argmin(-1)
    rtn = iq.dequantize(nearest, d, l, t)

    def err(A):
        E = W - A
        return float(torch.einsum("oi,ij,oj->", E, H, E))

    assert err(res.dequantize()) < 0.97 * err(rtn)
    assert float((res.dequantize() - W).norm() / W.norm()) < 0.12


@pytest.fixture(scope="module")
def iq_model(tmp_path_factory):
    """A tiny Llama with 256-wide attention/gate/up inputs (IQ4_XS) and a 288-wide down_proj (IQ4_NL,
    llama.cpp's fallback), quantized with ``--gguf-type IQ4_XS`` and saved."""
    root = tmp_path_factory.mktemp("iq4")
    src = tiny_gguf(root / "llama.gguf", "llama", tied=False, layers=1, hidden=256, intermediate=288,
                    vocab="none")  # fmt: skip
    m = _transformers(src)
    bitmosaic.quantize_(m, "gptq", CALIB, progress=False, source_model=str(src), gguf_type="IQ4_XS")
    return save_quantized(m, root / "q"), src


def test_iq4_xs_run_saves_loads_and_exports_exactly(iq_model, tmp_path):
    folder, _ = iq_model
    mods = quantized_modules(bitmosaic.load(folder))
    types = {n: m.gguf_type for n, m in mods.items()}
    assert {t for n, t in types.items() if "down_proj" in n} == {"IQ4_NL"}
    assert {t for n, t in types.items() if "down_proj" not in n} == {"IQ4_XS"}
    for m in mods.values():  # the gguf package's reader and ours agree on the stored bytes
        assert torch.equal(m.dequantize_reference(), m.dequantize_weight())
        assert abs(m.bits_per_weight() - iq.IQ_TYPES[m.gguf_type].bits) < 1e-9
    out = tmp_path / "m.gguf"
    res = export_model(folder, out, "gguf")  # no --gguf-type, no lossy: exact
    assert not res.changed
    assert _check_weights(folder, out, "llama") == {n: types[n] for n in types}
    res = export_model(folder, tmp_path / "x.gguf", "gguf", gguf_type="IQ4_XS")
    assert not res.changed
    from gguf import GGUFReader, LlamaFileType

    ft = GGUFReader(str(out)).fields["general.file_type"].contents()
    assert ft == LlamaFileType.MOSTLY_IQ4_XS


def test_other_types_are_refused_in_one_line(iq_model, tmp_path, capsys):
    folder, _ = iq_model
    with pytest.raises(ExportError, match="calibrated on the GGUF grid of IQ4_NL/IQ4_XS"):
        export_model(folder, tmp_path / "m.gguf", "gguf", gguf_type="Q4_0")
    rc = main(["export", str(folder), "--format", "gguf", "--gguf-type", "Q4_K", "--lossy", "--out",
               str(tmp_path / "k.gguf")])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and err[0].startswith("error:") and "IQ4" in err[0]
    res = export_model(folder, tmp_path / "f.gguf", "gguf", gguf_type="F32")  # floats: exact
    assert not res.changed
    with pytest.raises(ExportError, match="no such layers|calibrated on its grid"):
        plain = tmp_path / "plain"
        src = iq_model[1]
        m = _transformers(src)
        bitmosaic.quantize_(m, "gptq", CALIB, progress=False, source_model=str(src), bits=4, group_size=32)
        export_model(save_quantized(m, plain), tmp_path / "p.gguf", "gguf", gguf_type="IQ4_NL")


def test_a_width_no_iq4_block_fits_is_refused_in_one_line():
    from bitmosaic.errors import OptionError
    from bitmosaic.methods.gguf_mix import tensor_type

    assert (
        tensor_type("IQ4_XS", "x", 576, 30, 3) == "IQ4_NL"
        and tensor_type("IQ4_XS", "x", 1536, 30, 3) == "IQ4_XS"
    )
    with pytest.raises(OptionError, match="not a multiple of 32"):
        tensor_type("IQ4_NL", "x", 100, 30, 3)


def test_llama_cpp_runs_the_iq4_file(iq_model, tmp_path):
    """llama.cpp loads the file and its logits follow bitmosaic's (llama.cpp multiplies IQ4 weights with
    8-bit activations, so not bit for bit)."""
    pytest.importorskip("llama_cpp")
    folder, _ = iq_model
    out = tmp_path / "m.gguf"
    export_model(folder, out, "gguf")
    ids = [1, 5, 9, 17, 33, 65, 100, 3]
    theirs = llama_cpp_logits(out, ids)  # the MoE check's reader (benchmarks/moe/gguf_llamacpp.py)
    with torch.inference_mode():
        ours = bitmosaic.load(folder)(torch.tensor([ids])).logits[0]
    assert torch.isfinite(theirs).all()
    assert float((theirs - ours).norm() / ours.norm()) < 0.05
