"""``benchmarks/peers/llama_tools.py`` (llama.cpp's imatrix/quantize/perplexity tools built from the
llama-cpp-python sdist) and the parsing of ``benchmarks/gguf/llamacpp_peers.py``.  The build itself
(CMake, minutes) is replaced by a stand-in that writes the tools or fails: the tests check the commands,
the skip line, that a failed build leaves only its log and a finished one is renamed into place and reused."""

import importlib
import math
import subprocess
from pathlib import Path

import pytest
import torch

import benchmarks.peers.llama_tools
from benchmarks.gguf.llamacpp_peers import chunk_nll, parse_perplexity
from benchmarks.gguf.peers_report import _vs


@pytest.fixture()
def tools(monkeypatch, tmp_path):
    mod = importlib.reload(benchmarks.peers.llama_tools)
    monkeypatch.setenv("BITMOSAIC_PEER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(mod.shutil, "which", lambda name: f"/usr/bin/{name}")
    return mod


def test_commands_build_only_the_three_tools_without_curl(tools, tmp_path):
    cfg = tools.configure_command(tmp_path / "src", tmp_path / "b", "-DGGML_NATIVE=ON")
    assert "-DLLAMA_CURL=OFF" in cfg and "-DCMAKE_BUILD_TYPE=Release" in cfg and cfg[-1] == "-DGGML_NATIVE=ON"
    b = tools.build_command(tmp_path / "b", 2)
    assert b[b.index("-j") + 1] == "2" and b[b.index("--target") + 1 :] == list(tools.TOOLS)


def test_no_build_says_so_in_one_line(tools):
    said = []
    assert tools.find_or_build(build=False, log=said.append) is None
    assert len(said) == 1 and "not built" in said[0]


def test_failed_build_leaves_only_its_log(tools, monkeypatch, tmp_path):
    def fail(version, args, tmp, out, jobs):
        (tmp / "bin").mkdir(parents=True)
        out.write("cmake error\n")
        raise subprocess.CalledProcessError(2, ["cmake"])

    monkeypatch.setattr(tools, "_run_build", fail)
    said = []
    assert tools.find_or_build(log=said.append) is None
    left = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(left) == 1 and left[0].endswith(".log") and "failed" in said[-1]
    assert "cmake error" in (tmp_path / "cache" / left[0]).read_text()


def test_finished_build_is_renamed_into_place_and_reused(tools, monkeypatch, tmp_path):
    def ok(version, args, tmp, out, jobs):
        (tmp / "bin").mkdir(parents=True)
        for t in tools.TOOLS:
            (tmp / "bin" / t).write_text("#!/bin/sh\n")

    monkeypatch.setattr(tools, "_run_build", ok)
    said = []
    folder = tools.find_or_build(log=said.append)
    assert said[0].startswith("building llama.cpp's llama-imatrix") and said[-1].startswith("built")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [folder.name]
    monkeypatch.setattr(tools, "_run_build", lambda *a: pytest.fail("built again"))
    assert tools.find_or_build(log=pytest.fail) == folder
    assert tools.tool(folder, "llama-quantize").is_file()


KLD_OUT = """
Mean PPL(Q)                   :  23.247648 ±   0.700000
Mean PPL(base)                :  22.501500 ±   0.680930
Mean    KLD:   0.021234 ±   0.000400
Same top p:  91.234 ±  0.188 %
llama_perf_context_print: prompt eval time =   25000.00 ms / 20480 tokens
"""


def test_perplexity_output_is_parsed():
    r = parse_perplexity(KLD_OUT)
    assert r["ppl"] == 23.247648 and r["kld"] == 0.021234 and r["top1"] == 91.234
    assert abs(r["eval_tok_s"] - 819.2) < 1e-9
    assert parse_perplexity("Final estimate: PPL = 22.5015 +/- 0.68093\n")["ppl"] == 22.5015


class _Tok:
    bos_token_id = 1
    add_bos_token = True

    def __call__(self, text, return_tensors=None, add_special_tokens=False):
        return {"input_ids": torch.tensor([[ord(c) for c in text]])}


def test_calibration_chunks_are_llama_imatrix_s(tmp_path, monkeypatch):
    """The text's first n x ctx tokens (BOS first), each chunk's first token replaced by BOS."""
    import benchmarks.gguf.llamacpp_peers as peers

    monkeypatch.setattr("bitmosaic.data.bos_token_id", lambda tok: 1)
    p = tmp_path / "t.txt"
    p.write_text("abcdefghijkl")
    x = peers.calibration_chunks(_Tok(), Path(p), 3, 4)
    assert x.tolist() == [[1, 97, 98, 99], [1, 101, 102, 103], [1, 105, 106, 107]]


def _kld_lines(ppls):
    head = "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence\n"
    rows = "".join(
        f"{k + 1:4d}    {p:9.4f} ± {0.5:9.4f}       0.01000 ±    0.00100       0.02000 ±    0.00100\n"
        for k, p in enumerate(ppls)
    )
    return head + rows + "Mean PPL(Q)                   :  23.247648 ±   0.700000\n"


def test_chunk_nll_inverts_the_running_perplexity():
    nll = [3.1, 3.3, 2.9, 3.05, 3.4]  # each chunk's mean NLL; the tool prints exp(running mean)
    run = [math.exp(sum(nll[: k + 1]) / (k + 1)) for k in range(len(nll))]
    for text in (_kld_lines(run), "".join(f"[{k + 1}]{p:.4f}," for k, p in enumerate(run))):
        got = chunk_nll(text)
        assert len(got) == len(nll)
        assert max(abs(g - x) for g, x in zip(got, nll, strict=True)) < 1e-3
    assert parse_perplexity(_kld_lines(run))["chunk_nll"] == chunk_nll(_kld_lines(run))
    assert chunk_nll("[1]20.0,[3]21.0,") == []  # a gap: not a run of every chunk


def test_close_pair_gets_a_paired_interval():
    base = [3.0 + 0.3 * math.sin(k) for k in range(40)]
    imat = {"ppl": 25.0, "mb": 90.0, "chunk_nll": base}
    better = {"ppl": 24.0, "mb": 90.0, "chunk_nll": [x - 0.04 for x in base]}
    wobble = [x + (0.05 if k % 2 else -0.05) for k, x in enumerate(base)]
    noisy = {"ppl": 25.0, "mb": 90.0, "chunk_nll": wobble}
    assert "within noise" not in _vs(better, imat) and "[0.961, 0.961]" in _vs(better, imat)
    assert "within noise" in _vs(noisy, imat)
    assert _vs({"ppl": 24.0, "mb": 90.0}, imat) == "0.9600x ppl, 1.000x MB"  # no chunks kept: no interval
