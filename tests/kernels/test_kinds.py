"""Module kinds: one registry; every method's result exports or is refused with one line (exit 2);
every load path (``load_quantized``, ``bitmosaic.load``, ``AutoModelForCausalLM.from_pretrained``)
returns the same modules, bit for bit; the io layer names no method."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bitmosaic.cli import main
from bitmosaic.modules import KINDS, MODULE_KINDS, QuantModule
from tests.methods.saved_bytes import CASES, calib, tiny_llama

SRC = Path(__file__).resolve().parents[2] / "src" / "bitmosaic"

_saved: dict[str, Path] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("kinds")


# every method's saved-bytes case, plus the default ``--method gptq`` result (act-order, auto groups:
# static at 4 bits, so both formats hold it exactly) and explicit static groups
EXPORT_CASES = {
    **CASES,
    "gptq-default": ("gptq", {"bits": 4, "group_size": 32}),
    "gptq-static-groups": ("gptq", {"bits": 4, "group_size": 32, "static_groups": True}),
    # MosaicQuant W4A8 without residual blocks: its dense INT4 base and INT8 token activations
    "mosaic-w4a8-dense": ("mosaic", {"scheme": "W4A8", "budget_frac": 0.0, "block": "32x32"}),
    # GPTQ on a GGUF type's own grid (IQ4_NL: blocks of 32, so the tiny model's widths hold it) -> gguf-grid
    "gptq-gguf-iq4nl": ("gptq", {"gguf_type": "IQ4_NL"}),
    # microscaling weights -> mx
    "gptq-nvfp4": ("gptq", {"wfmt": "nvfp4"}),
    "rtn-mxfp4": ("rtn", {"wfmt": "mxfp4"}),
}


def saved(root: Path, case: str) -> Path:
    """The tiny Llama quantized with ``EXPORT_CASES[case]`` and saved (once per module)."""
    if case not in _saved or not _saved[case].exists():
        import bitmosaic
        from bitmosaic.io import save_quantized

        method, options = EXPORT_CASES[case]
        model = tiny_llama()
        bitmosaic.quantize_(model, method, calib(), progress=False, **options)
        _saved[case] = save_quantized(model, root / case, {"method": method})
    return _saved[case]


def test_every_kind_is_registered_once():
    assert MODULE_KINDS is KINDS
    assert {
        "packed",
        "packed+csr",
        "dpq",
        "fp8",
        "huffman",
        "sfmp",
        "mosaic",
        "sq-weight",
        "packed+sq-act",
    } <= set(KINDS)
    for kind, cls in KINDS.items():
        assert issubclass(cls, QuantModule) and cls.kind == kind
    with pytest.raises(TypeError, match="taken"):
        type("Other", (QuantModule,), {"kind": "packed"})


# (case, format) -> None: exports; else a piece of the one-line refusal
GPTQ, CT = "gptq", "compressed-tensors"
REFUSED = {
    ("gptq-act", CT): "act-order groups",
    ("smoothquant-w8a8", GPTQ): "GPTQ checkpoints hold weights only",
    ("dpq", GPTQ): "DPQ's weights are nearest_FP8",
    ("dpq", CT): "DPQ's weights are nearest_FP8",
    ("ssqr", GPTQ): "CSR outliers",
    ("ssqr", CT): "CSR outliers",
    ("hptq", GPTQ): "Huffman-coded",
    ("hptq", CT): "Huffman-coded",
    ("hrtn", GPTQ): "Huffman-coded",
    ("hrtn", CT): "Huffman-coded",
    ("fp8", GPTQ): "floating-point weights are not an INT grid",
    ("sq-weights", GPTQ): "SQ-format weights",
    ("sq-weights", CT): "SQ-format weights",
    ("sq-acts", GPTQ): "SQ-format activations",
    ("sq-acts", CT): "SQ-format activations",
    ("sq-acts-static", GPTQ): "SQ-format activations",
    ("sq-acts-static", CT): "SQ-format activations",
    ("sfmp", GPTQ): "SFMP's block-wise bit widths",
    ("sfmp", CT): "SFMP's block-wise bit widths",
    ("sfmp-gptq", GPTQ): "SFMP's block-wise bit widths",
    ("sfmp-gptq", CT): "SFMP's block-wise bit widths",
    ("mosaic", GPTQ): "block-sparse 4-bit residual",
    ("mosaic", CT): "block-sparse 4-bit residual",
    ("mosaic-w4a8-dense", GPTQ): "GPTQ checkpoints hold weights only",
    ("gptq-gguf-iq4nl", GPTQ): "on that GGUF type's own grid",
    ("gptq-gguf-iq4nl", CT): "on that GGUF type's own grid",
    ("gptq-nvfp4", GPTQ): "floats with block scales, not an INT grid",
    ("rtn-mxfp4", GPTQ): "floats with block scales, not an INT grid",
}


def _kind_of_case(root: Path, case: str) -> set[str]:
    from bitmosaic.io import load_quantized

    model, _ = load_quantized(saved(root, case), load_tokenizer=False)
    return {type(m).kind for m in model.modules() if isinstance(m, QuantModule)}


def test_the_export_cases_cover_every_registered_kind(root):
    """A new module kind cannot be added without an export case (exported or refused, both formats)."""
    covered = set().union(*(_kind_of_case(root, c) for c in sorted(EXPORT_CASES)))
    assert set(KINDS) <= covered, f"kinds without an export case: {sorted(set(KINDS) - covered)}"


@pytest.mark.parametrize("fmt", [GPTQ, CT])
@pytest.mark.parametrize("case", sorted(EXPORT_CASES))
def test_every_result_exports_or_is_refused_in_one_line(root, case, fmt, capsys):
    """Each (kind's result, format): exit 0 with bit-identical weights read back by an independent
    reader, or exit 2 with one ``error:`` line naming why and nothing written."""
    from bitmosaic.io import load_quantized

    src = saved(root, case)
    out = root / "exports" / f"{case}-{fmt}"  # apart from the saved cases ("sfmp" + "-gptq" is one)
    rc = main(["export", str(src), "--format", fmt, "--out", str(out)])  # the default checkpoint_format
    err = capsys.readouterr().err.strip()
    why = REFUSED.get((case, fmt))
    if why is None:
        assert rc == 0, err
        model, _ = load_quantized(src, load_tokenizer=False)
        if fmt == CT:  # the independent compressed-tensors package decompresses the same weights
            from tests.io.test_export import ct_decompress

            got = ct_decompress(out)
        else:  # the GPTQ unpacker written from the format's public description
            import json

            from safetensors.torch import load_file

            from tests.io.test_export import gptq_reference_unpack

            sd = load_file(str(out / "model.safetensors"))
            qc = json.loads((out / "config.json").read_text())["quantization_config"]
            names = {k.rsplit(".", 1)[0] for k in sd if k.endswith(".qweight")}
            got = {n: gptq_reference_unpack(sd, n, qc, model.get_submodule(n).in_features) for n in names}
        assert got
        for name, w in got.items():
            ref = model.get_submodule(name).dequantize_reference(w.dtype)
            assert torch.equal(w, ref), name
    else:
        assert rc == 2, f"{case} {fmt}: expected a refusal ({why})"
        assert "\n" not in err and err.startswith(f"error: cannot export as {fmt}"), err
        assert why in err, err
        assert not out.exists()


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("case", ["sfmp", "gptq-act"])
def test_three_load_paths_give_the_same_modules(root, case):
    from transformers import AutoModelForCausalLM

    import bitmosaic
    from bitmosaic.io import load_quantized
    from bitmosaic.modules.sfmp import SFMPLinear

    path = saved(root, case)
    ours, _ = load_quantized(path, load_tokenizer=False)
    short = bitmosaic.load(path)
    hf = AutoModelForCausalLM.from_pretrained(path)
    x = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    sa = _state(ours)
    with torch.no_grad():
        want = ours(x).logits
    for other in (short, hf):
        assert {n: type(m) for n, m in other.named_modules()} == {n: type(m) for n, m in ours.named_modules()}
        sb = _state(other)
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
        for name, m in ours.named_modules():
            if isinstance(m, SFMPLinear):  # the permutation folds happen in every path
                o = other.get_submodule(name)
                assert o._gather_input == m._gather_input, name
                assert (o._emit is None) == (m._emit is None), name
                assert o._emit is None or torch.equal(o._emit, m._emit), name
        assert other.quantization_info == ours.quantization_info
        assert not other.training
        with torch.no_grad():
            assert torch.equal(other(x).logits, want)
    if case == "sfmp":
        assert any(getattr(m, "_emit", None) is not None for m in ours.modules())


def test_load_in_a_fresh_process(root):
    """``bitmosaic.load`` in a new interpreter (an SFMP folder: its permutation fold runs), and the
    transformers registration it relies on: ``import bitmosaic`` alone imports no transformers, and
    registering again (or reloading the package) is harmless."""
    path = saved(root, "sfmp")
    code = (
        "import sys, bitmosaic, torch\n"
        "assert 'transformers' not in sys.modules, 'import bitmosaic imported transformers'\n"
        "m = bitmosaic.load(sys.argv[1])\n"
        "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as Q\n"
        "from bitmosaic.io.saved.hf_integration import BitmosaicHfQuantizer, register\n"
        "assert Q['bitmosaic'] is BitmosaicHfQuantizer\n"
        "register(); register()\n"
        "import importlib; importlib.reload(bitmosaic)\n"
        "print(type(m).__name__, sum(1 for x in m.modules() if hasattr(x, 'kind')), "
        "any(getattr(x, '_emit', None) is not None for x in m.modules()))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC.parent)}
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["LlamaForCausalLM", "14", "True"]


_METHOD_NAMES = re.compile(r"\b(sfmp|mosaic|dpq|ssqr|hptq|hrtn|awq|smoothquant)\b", re.IGNORECASE)


def test_the_io_layer_names_no_method():
    from bitmosaic.cli.commands import cmd_inspect

    texts = {str(p): p.read_text() for p in (SRC / "io").rglob("*.py")}
    texts["cli/export.py"] = (SRC / "cli" / "export.py").read_text()
    texts["cmd_inspect"] = inspect.getsource(cmd_inspect)
    found = {k: sorted(set(_METHOD_NAMES.findall(t))) for k, t in texts.items()}
    assert not {k: v for k, v in found.items() if v}


@pytest.mark.parametrize(
    "case,why,exact",
    [("mosaic", "block-sparse 4-bit residual", False), ("sq-acts", "SQ-format activations", True),
     ("sq-acts-static", "SQ-format activations", True), ("sfmp", "SFMP's block-wise bit widths", True),
     ("sfmp-gptq", "SFMP's block-wise bit widths", True)],
)  # fmt: skip
def test_lossy_drops_what_no_format_holds_and_reports_the_error(root, case, why, exact):
    from bitmosaic.io.export import export_model

    res = export_model(saved(root, case), root / f"{case}-lossy", "gptq", lossy=True, gptq_v2=True)
    named = [why in " ".join(r.changes) for r in res.records]
    assert res.records and (any(named) if case.startswith("sfmp") else all(named))  # SFMP: mixed layers
    # SQ-format activations: the weights themselves are exact (static ones back in column order);
    # SFMP: rows un-permuted, columns as act-order groups, mixed widths widened: the same values
    assert (res.summary()["max_abs"] == 0.0) == exact
