"""Builders shared by the ``test_io_*`` files (no tests here); the tiny models and tokenizer come from
:mod:`bitmosaic.testing`."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path

import torch

from bitmosaic.testing import (  # noqa: F401  (re-exported for the tests)
    NWORDS,
    SPECIALS,
    VOCAB,
    quantized_dir,
    save_hf_dir,
    tiny_gemma,
    tiny_llama,
    word_tokenizer,
    words,
)


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (relative name -> bytes): to prove a folder was left untouched."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def is_bitmosaic(path: Path) -> bool:
    qc = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    return qc.get("quant_method") == "bitmosaic"


@contextlib.contextmanager
def compare_in_process(subprocess_if=lambda cmd: False):
    """``bitmosaic compare`` runs each config as ``python -m bitmosaic.cli ...``; here the same argv runs
    through ``main`` in this process, its output going to the same log file (a fresh interpreter costs
    about 3 s of imports per config).  Commands for which ``subprocess_if(cmd)`` holds still run as
    real subprocesses."""
    import bitmosaic.cli.compare as compare
    from bitmosaic.cli import main

    saved = compare._run

    def run(cmd: list[str], log: Path) -> int:
        assert cmd[1:3] == ["-m", "bitmosaic.cli"], cmd
        if subprocess_if(cmd):
            return saved(cmd, log)
        with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            return main(cmd[3:])

    compare._run = run
    try:
        yield
    finally:
        compare._run = saved


@contextlib.contextmanager
def env_var(name: str, value: str):
    """``$name`` set to ``value`` inside the block, restored (or unset) after it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def assert_reload_same_logits(model, ids: torch.Tensor, path: Path, quant_config: dict) -> None:
    """Save ``model`` (quantized) to ``path`` and load it back: its logits on ``ids`` are bit-identical."""
    from bitmosaic.io import load_quantized, save_quantized

    with torch.inference_mode():
        out = model(ids).logits
    loaded, _ = load_quantized(save_quantized(model, path, quant_config), load_tokenizer=False)
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, out)


def cli_quantize_args(tmp_path: Path, scheme: str = "W4A4") -> list[str]:
    """``bitmosaic quantize`` arguments for the tiny Llama saved under ``tmp_path/tiny``: RTN at
    ``scheme``, groups of 32, 4 x 32 tokens of a word file (no ``--out``)."""
    src = save_hf_dir(tmp_path / "tiny", tiny_llama())
    (tmp_path / "calib.txt").write_text(" ".join(f"w{i % 100}" for i in range(3000)))
    return ["quantize", "--model", str(src), "--method", "rtn", "--scheme", scheme, "--group-size", "32",
            "--calib", str(tmp_path / "calib.txt"), "--nsamples", "4", "--seqlen", "32",
            "--no-progress"]  # fmt: skip


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on the loopback (one per process group a torchrun test starts)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def quantized_codes(model) -> dict[str, torch.Tensor]:
    """Every quantized module's integer codes, by name: what two runs must agree on bit for bit."""
    from bitmosaic.io import quantized_modules

    return {n: m.codes().clone() for n, m in sorted(quantized_modules(model).items())}


def transform_every_layer(model, spec, cfg, calib) -> list:
    """Run ``spec``'s transform hook (smoothing searches and folds, no quantization) on every decoder layer
    of ``model`` in order, each layer's float outputs feeding the next; returns each layer's infos."""
    from bitmosaic.models.arch import get_arch
    from bitmosaic.pipeline.calibration import capture_layer_inputs
    from bitmosaic.pipeline.loop import transform_layer

    arch = get_arch(model)
    layers = arch.layers(model)
    inputs, kw = capture_layer_inputs(model, layers, calib, batch_size=4)
    kwargs = next(iter(kw.values()))
    plan = {n: (spec, cfg) for group in arch.sequential for n in group}  # every linear: this method
    infos = []
    for layer in layers:
        infos.append(transform_layer(layer, arch, plan, inputs, kwargs, torch.Generator().manual_seed(0)))
        with torch.inference_mode():
            inputs = [layer(h, **k) for h, k in zip(inputs, kwargs, strict=True)]
            inputs = [x[0] if isinstance(x, tuple) else x for x in inputs]
    return infos


def varied_quantized_dir(path: Path, tokenizer: bool = True) -> Path:
    """A saved W4 folder (RTN g32, with the word tokenizer unless told not to) of the tiny Llama with its
    2-D weights scaled by 8, so its greedy continuations vary (equal tokens then mean something; the
    unscaled model repeats one token)."""
    from bitmosaic import quantize_
    from bitmosaic.io import save_quantized

    m = tiny_llama()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(8)
    calib = torch.randint(len(SPECIALS), VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    quantize_(m, "rtn", calib, bits=4, group_size=32, progress=False)
    tok = word_tokenizer() if tokenizer else None
    return save_quantized(m, path, {"method": "rtn", "bits": 4, "group_size": 32}, tokenizer=tok)
