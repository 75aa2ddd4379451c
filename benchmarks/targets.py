"""Issue 74's table of targets in ONE command, on the machine at hand: each target measured by the
benchmark that already measures it, and its baseline and physical bound in the same run; writes
``benchmarks/results/targets.{md,json}`` (one row per target and thread count: what was measured, the
baseline, the ratio, the target, met / not met, the bound, a note), the table in ``targets_table.py``.

Rows (``--only``, a comma list):

* ``calib``: ``benchmarks/peers/speed.py``'s children: bitmosaic's GPTQ with no option (what
  ``bitmosaic quantize --method gptq`` runs: w4 g128 asym, act-order, static groups, MSE scales) against
  llm-compressor's asymmetric GPTQ with static act-order at g64, the largest group it takes on SmolLM2's
  576-wide inputs (see speed.py) (``--anchor-python``: an interpreter with ``llmcompressor``),
  16 x 512 calibration, perplexity on 20 windows; bound: an approximate FLOP count
  (``real_shapes.layer_flops`` x 30 layers) at the float32 GEMM rate measured here;
* ``layer8b``: ``benchmarks/scale/real_shapes.py write`` of a 3-layer Llama-3-8B-shaped checkpoint and
  ``run --layers 2`` (the CLI, streamed, default scale search): the second layer's seconds against
  its FLOP bound;
* ``decode`` / ``decode_w2``: ``benchmarks/decode/decode.py``'s children: RTN W4 / W2 g128 folders
  loaded with plain ``bitmosaic.load`` (its default, compiled decode) against llama.cpp's binding on
  the GGUF SmolLM2 comes from (Q4_1) and on a Q2_K made by llama.cpp's ``llama-quantize`` from the
  exact F32 export; bound: read bandwidth / the linears' bytes;
* ``prefill``: ``benchmarks/kernels/int_gemm.measure`` on SmolLM2's three shapes at 512 rows: fp32
  against the W4A8 integer kernel; bound: the int8 GEMM rate;
* ``prefill_model``: ``benchmarks/decode/prefill.py``: one 512-token forward of SmolLM2, float against
  SmoothQuant W4A8; bound: the linears' int8 multiply-adds at the int8 rate.

A missing peer (llama.cpp's binding or tools not built, llm-compressor not installed) leaves its row a
one-line note; the other rows still run.  ``--smoke``: tiny sizes (a 2-layer tiny Llama, 8 new tokens,
2 x 64 calibration, 32 prefill rows): it checks the wiring, and its table says it is not a measurement.

    python -m benchmarks.targets --anchor-python /tmp/anchors/bin/python          # the whole table
    python -m benchmarks.targets --smoke --only prefill --json /tmp/t.json        # a quick check
    python -m benchmarks.targets --readme   # README's headline lines from results/targets.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import RESULTS
from benchmarks import targets_table as tt
from benchmarks.harness.child import ROOT, child_env, module_command

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
SMOLLM2_LAYERS = 30
PREFILL_SHAPES = [(576, 576), (1536, 576), (576, 1536)]  # SmolLM2's [out, in]


def _say(msg: str) -> None:
    print(msg, flush=True)


def _env() -> dict[str, str]:
    """A child's environment: the repository and this bitmosaic's source first on ``PYTHONPATH`` (a
    child in another interpreter, ``--anchor-python``, imports the same code)."""
    import bitmosaic

    src = str(Path(bitmosaic.__file__).resolve().parents[1])
    env = child_env({**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    env["PYTHONPATH"] = src + os.pathsep + env["PYTHONPATH"]
    return env


def _module(module: str, args: list[str], python: str = sys.executable, timeout: float | None = None):
    """Run ``python -m module args`` (output echoed to a log tail on failure); returns the process."""
    cmd = [*module_command(module, python), *map(str, args)]
    _say("  $ " + shlex.join(cmd[2:]))
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout)


def _tail(p) -> str:
    lines = (p.stderr or p.stdout or "").strip().splitlines()
    return " | ".join(lines[-2:])[-240:] or f"exit {p.returncode}"


# -- calibration ------------------------------------------------------------------------------------------


def run_calib(a, work: Path) -> list[dict]:
    from benchmarks.harness import gemm_gflops
    from benchmarks.peers.speed import DEFAULTS_ROW, PEER_ROW, SAME_ROW
    from benchmarks.scale.real_shapes import layer_flops

    n, seqlen, windows = (2, 64, 2) if a.smoke else (16, 512, 20)
    out = work / "speed.json"
    args = [
        "--only",
        f"{DEFAULTS_ROW},{SAME_ROW},{PEER_ROW}",
        "--json",
        out,
        "--nsamples",
        n,
        "--seqlen",
        seqlen,
        "--max-windows",
        windows,
        "--threads",
        a.calib_threads,
        "--anchor-python",
        a.anchor_python,
    ]
    p = _module("benchmarks.peers.speed", args)
    if p.returncode != 0 or not out.is_file():
        return [tt.missing("calib", "", "speed.py failed: " + _tail(p))]
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["rows"]}
    skipped = data.get("skipped", {})
    why = skipped.get(PEER_ROW, "")
    if "not installed" in why:
        why = f"llm-compressor is not installed in {a.anchor_python} (pass --anchor-python, see docs)"
    import torch

    torch.set_num_threads(a.calib_threads)
    gemm = gemm_gflops(512, 512, 1024) if a.smoke else gemm_gflops()
    flops = layer_flops(SMOLLM2, n * seqlen, seqlen)["total"] * SMOLLM2_LAYERS
    bound = {"gemm_gflops": gemm, "tflop": flops / 1e12, "seconds": flops / (gemm * 1e9)}
    ours = rows.get(DEFAULTS_ROW)
    why = why or skipped.get(DEFAULTS_ROW, "")
    return tt.calib_rows(ours, rows.get(PEER_ROW), bound, why, rows.get(SAME_ROW))


# -- the 8B-shaped layer ----------------------------------------------------------------------------------


def run_layer8b(a, work: Path) -> list[dict]:
    shape = "tiny" if a.smoke else "llama3-8b"
    ckpt, res = work / f"{shape}-ckpt", work / "real_shapes.json"
    out = work / f"{shape}-gptq-w4g128"
    # a kept work folder must not resume an earlier run (its journal would end the run at once and its
    # old per-layer seconds be read back as this run's) nor leave an earlier result to be read
    for old in (out, out.parent / f".{out.name}.partial", ckpt.parent / f".{ckpt.name}-gptq-w4g128.partial"):
        shutil.rmtree(old, ignore_errors=True)
    res.unlink(missing_ok=True)
    write = ["write", "--shape", shape, "--dir", ckpt] + ([] if a.smoke else ["--write-layers", "3"])
    p = _module("benchmarks.scale.real_shapes", write)
    if p.returncode != 0:
        return [tt.missing("layer8b", shape, "writing the checkpoint failed: " + _tail(p))]
    run = [
        "run",
        "--shape",
        shape,
        "--dir",
        ckpt,
        "--layers",
        0 if a.smoke else 2,
        "--threads",
        a.calib_threads,
        "--json",
        res,
        "--out",
        out,
    ]
    p = _module("benchmarks.scale.real_shapes", run)
    if p.returncode != 0 or not res.is_file():
        return [tt.missing("layer8b", shape, "the streamed run failed: " + _tail(p))]
    return [tt.layer_row(json.loads(res.read_text())["results"])]


# -- decode -----------------------------------------------------------------------------------------------


def _q2k(work: Path) -> tuple[Path | None, str]:
    """llama.cpp's Q2_K of SmolLM2 (``llama-quantize`` of the exact F32 export), or why there is none."""
    from benchmarks.peers.llama_tools import find_or_build, tool

    said: list[str] = []
    folder = find_or_build(build=False, log=said.append)
    if folder is None:
        return None, "llama.cpp tools not built (python -m benchmarks.peers.llama_tools, ~15 min)"
    from bitmosaic.io.export import export_model

    f32, q2k = work / "smollm2.F32.gguf", work / "smollm2.Q2_K.gguf"
    export_model("smollm2-135m", f32, "gguf", gguf_type="F32", lossy=True, overwrite=True)
    p = subprocess.run(
        [str(tool(folder, "llama-quantize")), str(f32), str(q2k), "Q2_K", "2"], capture_output=True, text=True
    )
    f32.unlink(missing_ok=True)
    return (
        (q2k, "")
        if p.returncode == 0 and q2k.is_file()
        else (None, "llama-quantize Q2_K failed: " + _tail(p))
    )


def run_decode(a, work: Path, which: list[str], bandwidth: dict[int, float]) -> list[dict]:
    from benchmarks.decode.decode import _make_quantized, _run_child
    from benchmarks.peers.peer_llama import child_env as llama_env
    from benchmarks.peers.peer_llama import find_or_build
    from bitmosaic.io.sources.loading import _smollm2_gguf

    said: list[str] = []
    peer = find_or_build(build=a.build_peers, log=said.append)
    no_peer = (
        "llama.cpp's binding is not built (--build-peers builds it once, ~7 min)" if peer is None else ""
    )
    ggufs = {"decode": (4, "llama.cpp Q4_1", str(_smollm2_gguf()), "")}
    if "decode_w2" in which:
        q2k, why = _q2k(work) if peer is not None else (None, no_peer)
        ggufs["decode_w2"] = (2, "llama.cpp Q2_K", str(q2k) if q2k else None, why)
    folders = {b: str(_make_quantized(work, b)) for b in sorted({ggufs[t][0] for t in which})}
    new, reps = (8, 1) if a.smoke else (64, 3)
    rows = []
    for t in a.thread_list:
        common = ["--child-threads", str(t), "--new-tokens", str(new), "--repeats", str(reps)]
        for target in which:
            bits, peer_name, gguf, why = ggufs[target]
            ours = _run_child(["--child", f"W{bits} g128 (load)", "--folder", folders[bits], *common])
            theirs = None
            if peer is not None and gguf and ours is not None:
                ids = json.dumps(ours["prompt_ids"])
                theirs = _run_child(
                    ["--child", "llama.cpp", "--folder", gguf, "--prompt-ids", ids, *common],
                    env=llama_env(peer),
                )
                why = why or ("" if theirs else f"{peer_name} child failed")
            rows.append(tt.decode_row(target, t, ours, theirs, peer_name, bandwidth.get(t), why or no_peer))
            _say(
                f"  {target} {t} thread(s): {rows[-1]['ours']} vs {rows[-1]['baseline'] or rows[-1]['note']}"
            )
    return rows


# -- prefill ----------------------------------------------------------------------------------------------


def run_prefill(a, bounds: dict[int, tuple[float, float]]) -> list[dict]:
    import torch

    from benchmarks.kernels.int_gemm import measure

    m = 32 if a.smoke else 512
    g = torch.Generator().manual_seed(0)
    rows = []
    for t in a.thread_list:
        torch.set_num_threads(t)
        rate, bw = bounds[t]
        shapes = [{**measure(n, k, m, g, rate, bw), "threads": t} for n, k in PREFILL_SHAPES]
        rows.append(tt.prefill_row(t, shapes))
        _say(f"  prefill {t} thread(s): {rows[-1]['ours']}")
    return rows


def run_prefill_model(a, work: Path) -> list[dict]:
    out = work / "prefill.json"
    args = ["--threads", a.threads, "--json", out]
    args += ["--tokens", 64, "--nsamples", 2, "--seqlen", 64, "--budget", 0.2] if a.smoke else []
    p = _module("benchmarks.decode.prefill", args)
    if p.returncode != 0 or not out.is_file():
        return [tt.prefill_model_row(None, "prefill.py failed: " + _tail(p))]
    return [tt.prefill_model_row(r) for r in json.loads(out.read_text())["rows"]]


# -- the run ----------------------------------------------------------------------------------------------


def _commit() -> str:
    p = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return (p.stdout.strip() or "?") + (" (with uncommitted changes)" if dirty else "")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(tt.ORDER), help=f"comma list of {', '.join(tt.ORDER)}")
    p.add_argument(
        "--threads", default="1,2", help="decode and prefill thread counts (calibration: the largest)"
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the wiring, measures nothing")
    p.add_argument("--anchor-python", default=sys.executable, help="an interpreter with llmcompressor")
    p.add_argument(
        "--build-peers",
        action="store_true",
        help="build llama.cpp's binding where it is missing (~7 min) instead of a note in its rows",
    )
    p.add_argument(
        "--json", default=None, help="default benchmarks/results/targets.json (--smoke: a temp file)"
    )
    p.add_argument(
        "--work", default=None, help="folder for the checkpoints and GGUFs (default: a temp folder)"
    )
    p.add_argument(
        "--readme",
        action="store_true",
        help="measure nothing: rewrite README.md's targets lines from the --json results",
    )
    a = p.parse_args(argv)
    a.only_list = [w for w in a.only.split(",") if w]
    unknown = sorted(set(a.only_list) - set(tt.ORDER))
    if unknown:
        p.error(f"--only names no row: {', '.join(unknown)} (rows: {', '.join(tt.ORDER)})")
    a.thread_list = [int(t) for t in a.threads.split(",")]
    a.calib_threads = max(a.thread_list)
    if a.json is None:
        a.json = str(
            Path(tempfile.gettempdir()) / "bitmosaic-targets-smoke.json"
            if a.smoke
            else RESULTS / "targets.json"
        )
    return a


def main(argv=None) -> None:
    a = parse(argv)
    if a.readme:
        changed = tt.rewrite_readme(ROOT / "README.md", json.loads(Path(a.json).read_text()))
        _say(f"README.md {'rewritten' if changed else 'unchanged'} from {a.json}")
        return
    from benchmarks.harness import machine_bounds, machine_info, write_results

    command = "python -m benchmarks.targets " + shlex.join(
        sys.argv[1:] if argv is None else list(map(str, argv))
    )
    load_before, t0 = os.getloadavg(), time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bitmosaic-targets-") as tmp:
        work = Path(a.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        want = a.only_list
        bounds = {}
        if {"decode", "decode_w2", "prefill"} & set(want):  # int8 rate and read bandwidth per thread count
            bounds = {t: machine_bounds(t) for t in a.thread_list}
        for target in tt.ORDER:
            if target not in want or target == "decode_w2" and "decode" in want:
                continue  # decode_w2 runs with decode (the same children per thread count)
            _say(f"== {target}")
            try:
                if target == "calib":
                    rows += run_calib(a, work)
                elif target == "layer8b":
                    rows += run_layer8b(a, work)
                elif target in ("decode", "decode_w2"):
                    which = [t for t in ("decode", "decode_w2") if t in want]
                    rows += run_decode(a, work, which, {t: b[1] for t, b in bounds.items()})
                elif target == "prefill":
                    rows += run_prefill(a, bounds)
                else:
                    rows += run_prefill_model(a, work)
            except Exception as e:  # noqa: BLE001 -- one failed target leaves a note; the others still run
                rows.append(tt.missing(target, "", f"{type(e).__name__}: {e}"))
    machine = machine_info(
        loadavg_before=load_before,
        loadavg_after=os.getloadavg(),
        commit=_commit(),
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    )
    md = tt.markdown(rows, machine, command, a.smoke)
    print("\n" + md)
    out = {
        "command": command,
        "smoke": a.smoke,
        "wall_s": time.perf_counter() - t0,
        "rows": rows,
        "bounds": {str(t): {"int8_gops": b[0], "read_gbs": b[1]} for t, b in bounds.items()},
        "machine": machine,
    }
    write_results(a.json, "targets", out, md)


if __name__ == "__main__":
    main()
