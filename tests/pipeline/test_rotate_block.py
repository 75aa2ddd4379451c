"""``--rotate block`` (issue 75): block-diagonal Hadamards of the scale block, folded like QuaRot's where
folding allows and online before o_proj / down_proj; the float model is unchanged, the rotation mixes only
inside a block, it composes with the microscaled schemes, and bad sizes are refused in one line."""

from __future__ import annotations

import math

import pytest
import torch

from bitmosaic import quantize_
from bitmosaic.algorithms.rotation import block_hadamard_transform, hadamard_matrix, orthogonal_matrix
from bitmosaic.cli import main
from bitmosaic.errors import OptionError
from bitmosaic.models.arch import get_arch
from bitmosaic.modules.rotation import input_rotation_spec
from bitmosaic.pipeline.rotate import parse_rotation, rotate_model
from tests.helpers import SPECIALS, VOCAB, save_hf_dir, tiny_llama, words
from tests.pipeline.test_rotate import tiny


def _ids():
    return torch.randint(len(SPECIALS), VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def _calib():
    return torch.randint(len(SPECIALS), VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))


def test_block_matrix_is_block_diagonal_and_the_transform_applies_it():
    Q = orthogonal_matrix("block", 64, seed=3, block=16)
    assert torch.allclose(Q @ Q.T, torch.eye(64, dtype=torch.float64), atol=1e-12)
    off = Q.clone()
    for b in range(4):
        off[16 * b : 16 * (b + 1), 16 * b : 16 * (b + 1)] = 0
    assert not off.any()  # nothing crosses a block
    x = torch.randn(5, 64, dtype=torch.float64)
    H = torch.kron(torch.eye(4, dtype=torch.float64), hadamard_matrix(16) / math.sqrt(16))
    assert torch.allclose(block_hadamard_transform(x, 16), x @ H, atol=1e-12)
    with pytest.raises(ValueError, match="divisible"):
        block_hadamard_transform(x, 24)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma", "phi3"])
def test_float_model_unchanged(model_type):
    model = tiny(model_type)  # hidden 48, head_dim 16, intermediate 80: block 16 divides them all
    ids = torch.randint(4, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        info = rotate_model(model, get_arch(model), "block:16", seed=5)
        out = model(ids).logits
    assert (out - ref).abs().max() <= 2e-5 * ref.abs().max()
    assert info["kind"] == "block:16" and len(info["online"]) == 4
    assert input_rotation_spec(model.model.layers[1].mlp.down_proj) == {
        "type": "hadamard",
        "n": 80,
        "block": 16,
    }


def test_outlier_stays_in_its_block():
    """The point of a block rotation: a residual outlier channel is spread over its own block only."""
    model = tiny("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 7] *= 50
    seen = []
    h = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        model(_ids())
        rotate_model(model, get_arch(model), "block:16", seed=0)
        model(_ids())
    h.remove()
    before, after = (x.abs().mean(dim=(0, 1)) for x in seen)
    blk = slice(0, 16)  # channel 7's block
    assert after[blk].mean() > 5 * after[16:].mean()  # its energy stays in block 0
    assert after[7] < before[7] / 2  # spread out within the block


def test_refusals_in_one_line(tmp_path, capsys):
    with pytest.raises(OptionError, match="divisible by 32.*hidden size of llama is 48"):
        rotate_model(tiny("llama"), get_arch(tiny("llama")), "block:32")
    with pytest.raises(OptionError, match="block is a size"):
        parse_rotation("block:x")
    with pytest.raises(OptionError, match="per channel; give --rotate-block N") as e:
        quantize_(tiny_llama(), "rtn", _calib(), bits=4, group_size=None, rotate="block", progress=False)
    assert "\n" not in str(e.value)
    (tmp_path / "t.txt").write_text(words(200))
    src = save_hf_dir(tmp_path / "f")
    argv = ["quantize", "--model", str(src), "--calib", str(tmp_path / "t.txt"), "--nsamples", "2",
            "--seqlen", "16", "--no-progress", "--out", str(tmp_path / "q"),
            "--rotate-block", "16"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--rotate-block 16 sizes a block rotation" in err and "Traceback" not in err


@pytest.mark.parametrize("scheme,block", [("MXFP4", 32), ("NVFP4", 16)])
def test_composes_with_the_microscaled_schemes(scheme, block, tmp_path):
    """The block defaults to the scheme's (32 MXFP4, 16 NVFP4); W4A4 then runs, saves and loads with the
    online block rotations re-attached, and stays near the float model (a wrong fold gives O(1) error)."""
    from bitmosaic.io import save_quantized
    from bitmosaic.io.saved.load import load_quantized

    ids = _ids()
    with torch.no_grad():
        ref = tiny_llama()(ids).logits
    m = tiny_llama()
    report = quantize_(m, "gptq", _calib(), scheme=scheme, rotate="block", progress=False)
    assert report.calibration["rotation"]["kind"] == f"block:{block}"
    down = m.model.layers[0].mlp.down_proj
    assert input_rotation_spec(down) == {"type": "hadamard", "n": 96, "block": block}
    assert down.input_quant.spec.mx == scheme.lower()
    with torch.no_grad():
        out = m(ids).logits
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 0.5, rel
    save_quantized(m, tmp_path / "q")
    back = load_quantized(tmp_path / "q", load_tokenizer=False)[0]
    with torch.no_grad():
        assert torch.equal(back(ids).logits, out)
