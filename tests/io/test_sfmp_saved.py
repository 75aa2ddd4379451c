"""SFMP around the method: resident weights (one copy once the kernel is built), the
``quantize_`` entry with a precomputed salience, what a saved model records, and ``inspect``."""

from __future__ import annotations

import json

import pytest
import torch

from bitmosaic import quantize_
from bitmosaic.cli import build_parser, main, method_options
from bitmosaic.errors import OptionError
from bitmosaic.io import load_quantized, save_quantized
from bitmosaic.methods import get_method
from bitmosaic.methods.sfmp import sfmp_run_info
from bitmosaic.modules.base import prepare_kernels, resident_bytes
from bitmosaic.modules.sfmp import SFMPLinear
from bitmosaic.modules.sfmp_model import stored_summary as stored_sfmp_summary
from bitmosaic.pipeline.fisher import salience_linear_names
from tests.helpers import VOCAB, save_hf_dir, tiny_llama, words

OPTS = {
    "avg_bits": 2.5,
    "group_size": 16,
    "block_rows": 8,
    "fisher_cache": None,
    "n_grid": 2,
    "progress": False,
}


def _calib(n=4, seqlen=24, seed=0):
    return torch.randint(4, VOCAB, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _sfmp(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, SFMPLinear)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny Llama quantized with sfmp, its run report, logits, and its saved folder."""
    model = tiny_llama(0)
    rep = quantize_(model, "sfmp", _calib(), **OPTS)
    ids = _calib(2, 16, seed=1)
    for m in _sfmp(model).values():
        m._restore_saved()  # every buffer resident, whatever ran before
    with torch.no_grad():
        logits = model(ids).logits
    out = tmp_path_factory.mktemp("sfmp") / "q"
    save_quantized(
        model, out, {"method": "sfmp", "bits": 4, "config": rep.config, "sfmp": sfmp_run_info(rep)}
    )
    return model, rep, ids, logits, out


def test_kernel_releases_the_saved_codes_and_scales(saved, tmp_path):
    _, _, ids, logits, out = saved
    model, _ = load_quantized(out, load_tokenizer=False)
    mods = _sfmp(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    before = resident_bytes(model)
    freed = sum(m.qweight.nbytes + m.scales.nbytes + m.zeros.nbytes for m in mods.values())
    refs = {n: (m.dequantize_reference(), m.bits_per_weight()) for n, m in mods.items()}
    prepare_kernels(model)
    kernels = sum(m._kernel.nbytes() for m in mods.values())
    after = resident_bytes(model)
    assert all(m._released == {"qweight", "scales", "zeros"} for m in mods.values())
    assert after <= before + kernels - freed  # was before + kernels: the saved copy stayed
    assert after < 0.8 * (before + kernels)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
    again = model.state_dict()  # rebuilt from the kernels, bit for bit
    assert list(again) == list(state)
    assert all(again[k].dtype == v.dtype and torch.equal(again[k], v) for k, v in state.items())
    for n, m in mods.items():  # read through the released buffers, rebuilt from the kernel
        assert torch.equal(m.dequantize_reference(), refs[n][0]) and m.bits_per_weight() == refs[n][1]
    assert all(m._released and m.qweight.device.type == "cpu" for m in mods.values())  # still released
    save_quantized(model, tmp_path / "r", {"method": "sfmp"})
    assert (tmp_path / "r" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    reloaded, _ = load_quantized(tmp_path / "r", load_tokenizer=False)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, logits)


def test_quantize_api_takes_a_precomputed_salience_or_its_tokens():
    model = tiny_llama(0)
    names = salience_linear_names(model)
    hot = "model.layers.1.mlp.down_proj"
    sal = {}
    for n in names:
        N, K = model.get_submodule(n).weight.shape
        rows = torch.arange(N, dtype=torch.float32)[:, None] + 1  # row sums ascending: row order reversed
        sal[n] = rows * torch.ones(1, K) * (1e6 if n == hot else 1.0)
    rep = quantize_(model, "sfmp", _calib(), salience=sal, **OPTS)
    alloc = rep.calibration["allocation"]
    assert alloc["fisher"] == {"given": True}
    mods = _sfmp(model)
    assert len(mods) == len(names) and alloc["b_reached"] == pytest.approx(2.5, abs=0.05)
    assert set(mods[hot].bit_map.unique().tolist()) == {3}  # the salient linear gets ceil(b) everywhere
    N = mods[hot].out_features
    assert torch.equal(mods[hot].row_perm.long(), torch.arange(N - 1, -1, -1))
    model2 = tiny_llama(0)
    rep2 = quantize_(model2, "sfmp", _calib(), salience_tokens=_calib(3, 20, seed=5), **OPTS)
    assert rep2.calibration["allocation"]["fisher"]["samples"] == 3
    assert rep2.calibration["allocation"]["fisher"]["seconds"] > 0
    with pytest.raises(ValueError, match="salience of"):
        quantize_(tiny_llama(0), "sfmp", _calib(), salience={n: s[:, :3] for n, s in sal.items()}, **OPTS)
    with pytest.raises(OptionError, match="global bit allocation"):
        quantize_(tiny_llama(0), "rtn", _calib(), salience=sal, bits=4, progress=False)


def test_saved_config_records_what_sfmp_used_and_old_saves_load(saved, tmp_path, capsys):
    model, rep, ids, logits, out = saved
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    s, alloc = qc["sfmp"], rep.calibration["allocation"]
    assert qc["bits"] is None and "bits" not in qc["config"]  # there is no single width
    assert s["budget"] == {"avg_bits": 2.5} and s["b_target"] == pytest.approx(2.5)
    assert s["b_reached"] == pytest.approx(alloc["b_reached"]) and s["b_reached"] <= 2.5 + 1e-9
    assert s["candidate_widths"] == [2, 3] and set(s["widths_used"]) <= {2, 3}
    assert s["group_size"] == 16 and s["block"] == [8, 16] and s["block_shapes"] == ["8x16"]
    assert s["bits_per_weight"] == pytest.approx(rep.bits_per_weight)
    parts = s["bits_per_weight_parts"]
    n = sum(m.in_features * m.out_features for m in _sfmp(model).values())
    want = {k: sum(m.bits_breakdown()[k] * m.in_features * m.out_features for m in _sfmp(model).values()) / n
            for k in parts}  # fmt: skip
    assert parts == pytest.approx(want) and parts["weights"] == pytest.approx(s["b_reached"])
    # a save from before these fields existed: "bits": 4, no "sfmp" section
    old = tmp_path / "old"
    old.mkdir()
    for f in out.iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    raw = json.loads((old / "config.json").read_text())
    raw["quantization_config"].pop("sfmp")
    raw["quantization_config"]["bits"] = 4
    (old / "config.json").write_text(json.dumps(raw))
    loaded, _ = load_quantized(old, load_tokenizer=False)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)
    summary = stored_sfmp_summary(old, raw["quantization_config"]["modules"])
    assert summary["b_reached"] == pytest.approx(s["b_reached"])
    assert main(["inspect", str(old)]) == 0
    text = capsys.readouterr().out
    assert f"b reached {s['b_reached']:.4f} (target not saved)" in text


def test_cli_budget_flags_reach_the_config():
    p = build_parser()
    spec = get_method("sfmp")
    for flag, field, v in (
        ("--avg-bits", "avg_bits", 2.75),
        ("--bpw", "bpw", 3.0),
        ("--budget-mb", "budget_mb", 40.0),
    ):
        a = p.parse_args(
            ["quantize", "--method", "sfmp", flag, str(v), "--block", "64x256", "--group-size", "128"]
        )
        cfg = spec.make_config(**method_options(a, spec))
        assert getattr(cfg, field) == v and (cfg.block_rows, cfg.block_cols) == (64, 256)
    for extra in (["--bpw", "3", "--avg-bits", "2.5"], []):  # refused before any Fisher salience
        a = p.parse_args(["quantize", "--method", "sfmp", *extra])
        with pytest.raises(OptionError, match="exactly one budget"):
            spec.make_config(**method_options(a, spec))


def test_cli_quantize_then_inspect_lists_the_bits_by_part(tmp_path, capsys):
    model = save_hf_dir(tmp_path / "tiny")
    text = tmp_path / "t.txt"
    text.write_text(words(3000))
    argv = ["quantize", "--model", str(model), "--method", "sfmp", "--budget-mb", "0.03",
            "--group-size", "32", "--block", "16x32", "--fisher-cache", "none", "--calib", str(text),
            "--nsamples", "2", "--seqlen", "32", "--no-progress", "--out", str(tmp_path / "q")]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    s = qc["sfmp"]
    assert s["budget"] == {"budget_mb": 0.03} and s["bpw_target"] == pytest.approx(0.03 * 2**23 / 61440)
    assert s["bits_per_weight"] <= s["bpw_target"] + 1e-9 and s["block"] == [16, 32]
    assert main(["inspect", str(tmp_path / "q"), "--layers"]) == 0
    text = capsys.readouterr().out
    p = s["bits_per_weight_parts"]
    assert (
        f"b reached {s['b_reached']:.4f} (budget_mb 0.03, b target {s['b_target']:.4f}), widths 2/3" in text
    )
    assert (
        f"sfmp bits/weight {s['bits_per_weight']:.4f} = weights {p['weights']:.4f} + scales/zeros "
        f"{p['scales_zeros']:.4f} + permutations {p['permutations']:.4f} + bit map {p['bit_map']:.4f}"
    ) in text
    loaded, _ = load_quantized(tmp_path / "q", load_tokenizer=False)
    q = loaded.model.layers[0].self_attn.q_proj
    row = next(ln for ln in text.splitlines() if ln.startswith("model.layers.0.self_attn.q_proj "))
    assert row.split()[3] == f"{q.code_bits():.2f}"
