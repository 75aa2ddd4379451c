"""The saved bytes of every method on a tiny random Llama (fixed seed): a digest per saved tensor.

``tests/methods/test_saved_bytes.py`` checks them against ``tests/data/saved_bytes.json``, which was written
from the code *before* the architecture change (issue: methods as plugins), so a refactor that moves
code may not change a single saved byte.  Regenerate only for a deliberate format change::

    python tests/methods/saved_bytes.py --write
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "saved_bytes.json"


def capability() -> str:
    """The torch CPU capability the golden digests are keyed by."""
    return torch.backends.cpu.get_cpu_capability()


def golden_digests(case: str) -> list[dict[str, str]]:
    """The recorded digests of ``case``: this machine's capability's alone when recorded, else every
    recorded capability's (a tensor then has to match one of them)."""
    golden = json.loads(GOLDEN.read_text())
    if capability() in golden:
        return [golden[capability()][case]]
    return [g[case] for g in golden.values()]


# name -> (method, options): every method, including the run-state ones (sfmp, mosaic, sq-*)
CASES: dict[str, tuple[str, dict]] = {
    "rtn": ("rtn", {"bits": 4, "group_size": 32}),
    "gptq-act": ("gptq", {"bits": 3, "group_size": 32, "order": "act", "static_groups": False}),
    "babai": ("babai", {"bits": 3, "group_size": 32}),
    "awq": ("awq", {"bits": 3, "group_size": 32}),
    "smoothquant-w8a8": ("smoothquant", {"scheme": "W8A8", "group_size": None}),
    "dpq": ("dpq", {"bits": 4, "group_size": 32}),
    "ssqr": ("ssqr", {"bits": 3, "group_size": 32, "outlier_rate": 0.02}),
    "hptq": ("hptq", {"target_bits": 3.5}),
    "hrtn": ("hrtn", {"target_bits": 3.5}),
    "fp8": ("fp8", {}),
    "sq-weights": ("sq-weights", {"sq": "16-(8/4)-0.75"}),
    "sq-acts": ("sq-acts", {"bits": 4, "group_size": 32, "sq": "16-(8/4)-0.5"}),
    "sq-acts-static": ("sq-acts", {"bits": 4, "group_size": 32, "sq": "16-(8/4)-0.5", "strategy": "static"}),
    "sfmp": (
        "sfmp",
        {"bpw": 3.25, "group_size": 32, "block_rows": 64, "fisher_cache": None, "solver": "awq"},
    ),
    "sfmp-gptq": (
        "sfmp",
        {"avg_bits": 2.5, "group_size": 32, "block_rows": 64, "solver": "gptq", "fisher_cache": None},
    ),
    # o_proj unsmoothed under GQA, as recorded (issue 73 made its fold into v_proj the default; that path
    # is checked in float and end to end by tests/methods/test_mosaic_gqa_fold.py)
    "mosaic": ("mosaic", {"scheme": "W4A8", "budget": 0.25, "block": "32x32", "fold_o_proj": False}),
}


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def calib() -> torch.Tensor:
    return torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))


def _digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def saved_digests(case: str, tmp: Path, model_fn=None, tokens=None) -> dict[str, str]:
    """Quantize the tiny model (or ``model_fn()`` on ``tokens``) with ``CASES[case]``, save it to
    ``tmp`` and digest every saved tensor (the safetensors files, read back) and the saved per-layer
    configs."""
    import bitmosaic
    from bitmosaic.io import save_quantized

    method, options = CASES[case]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one reduction order: the digests do not depend on the thread count
    try:
        model = (model_fn or tiny_llama)()
        tokens = calib() if tokens is None else tokens
        bitmosaic.quantize_(model, method, tokens, progress=False, **options)
        out = save_quantized(model, tmp / case, {"method": method})
    finally:
        torch.set_num_threads(threads)
    return folder_digests(out)


def folder_digests(out: Path) -> dict[str, str]:
    """Every tensor of the saved folder ``out`` and its per-layer configs, digested."""
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(out.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    digests = {k: _digest(v) for k, v in sorted(sd.items())}
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    digests["<modules>"] = hashlib.sha256(json.dumps(qc["modules"], sort_keys=True).encode()).hexdigest()[:16]
    return digests


def streamed_digests(case: str, tmp: Path, spec: str, tokens: torch.Tensor) -> dict[str, str] | str:
    """``CASES[case]`` streamed layer by layer from the checkpoint ``spec`` (``bitmosaic.pipeline.stream``)
    into ``tmp``, digested; ``"not streamable"`` for a method with a whole-model step."""
    from bitmosaic.api import as_recipe
    from bitmosaic.io.sources.opener import open_checkpoint
    from bitmosaic.pipeline import RunSettings
    from bitmosaic.pipeline.stream import quantize_streaming, streamable

    method, options = CASES[case]
    options = dict(options)
    recipe = as_recipe(method, options, options.pop("scheme", None))
    if streamable(recipe):
        return "not streamable"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ckpt, tok = open_checkpoint(spec)
        quantize_streaming(ckpt, tok, tmp / f"{case}-streamed", recipe, tokens, RunSettings(progress=False))
    finally:
        torch.set_num_threads(threads)
    return folder_digests(tmp / f"{case}-streamed")


def main(argv: list[str]) -> int:
    """``--write``: regenerate the golden file; ``--smollm2 OUT.json``: the same digests on
    SmolLM2-135M (8 x 256 WikiText-2 tokens, seed 0; block and group sizes of the real shapes), in memory
    and streamed (``CASE@stream``), written to ``OUT.json`` for comparing two versions of the code by
    hand (minutes per method; a case already in ``OUT.json`` is kept, so an interrupted run resumes)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        if "--smollm2" in argv:
            out = Path(argv[argv.index("--smollm2") + 1])
            from bitmosaic.data import calibration_samples
            from bitmosaic.io import load_model

            tok = load_model("smollm2-135m")[1]
            tokens = calibration_samples(tok, "wikitext2", 8, 256, seed=0)
            golden = json.loads(out.read_text()) if out.exists() else {}
            for case in CASES:
                opts = CASES[case][1]
                if "group_size" in opts and opts["group_size"]:
                    opts["group_size"] = 64
                if "block_rows" in opts:
                    opts["block_rows"] = 512
                if case not in golden:
                    golden[case] = saved_digests(case, Path(d), lambda: load_model("smollm2-135m")[0], tokens)
                if f"{case}@stream" not in golden:
                    golden[f"{case}@stream"] = streamed_digests(case, Path(d), "smollm2-135m", tokens)
                out.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
                print(case, "done", flush=True)
            return 0
        golden = {case: saved_digests(case, Path(d)) for case in CASES}
    if "--write" in argv:
        every = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        every[capability()] = golden
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(every, indent=1, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN} ({len(golden)} cases, {capability()})")
    else:
        print(json.dumps(golden, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
