"""bitmosaic's GGUF files against llama.cpp's strongest own practice, ``llama-imatrix`` + ``llama-quantize``,
every file measured by llama.cpp's own ``llama-perplexity`` (issue 72).

The tools are built from the llama.cpp source of the ``llama-cpp-python`` sdist (``benchmarks/peers/
llama_tools.py``).  Protocol (the issue's):

- base: SmolLM2-135M-Instruct (bitmosaic's GGUF source, its Q4_1 linears dequantized) exported by
  ``bitmosaic export --format gguf`` as F32 (exact) and F16;
- importance matrix: ``llama-imatrix`` on the F32 file, 16 chunks of 512 tokens of
  ``wikitext-2/valid.txt`` (``-c 512 --chunks 16``: the file's first 16 x 512 tokens, BOS in place of each
  chunk's first token);
- llama.cpp's files: ``llama-quantize`` of the F32 file without and with ``--imatrix`` for each type (its
  own per-tensor mix of the preset, fallbacks for SmolLM2's 576-wide inputs included; IQ2_XS/IQ3_S/
  IQ3_XXS/IQ2_XXS without an importance matrix are refused or poor by llama.cpp's own rule and reported as
  they come);
- bitmosaic's files: ``--method gptq --gguf-type T`` (scales on the type's stored encoding, GPTQ on its
  grid -- IQ3_S / IQ2_XS: a vector GPTQ on the codebook --, exact export) calibrated on *the same* 16 x 512
  token chunks llama-imatrix reads (tokenized by
  bitmosaic's tokenizer of the same vocabulary, BOS in place of each chunk's first token), then
  ``bitmosaic export --format gguf`` (no ``--lossy``);
- ``llama-perplexity -c 512 --chunks 40`` on WikiText-2 raw test (llama.cpp scores the second half of
  each chunk), with ``--kl-divergence`` against the F16 file's logits: perplexity, mean KL and top-1 agreement
  ("same top p") from the same pass.  ``-t 2`` everywhere.

Every step's output stays under ``--work`` and is skipped when there, so the run continues where it
stopped; ``--budget S`` stops it between steps after S seconds (run it again).  Reproduce::

    flock /tmp/locks/heavy python -m benchmarks.gguf.llamacpp_peers --budget 280   # until it says done
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import time
from pathlib import Path

from benchmarks.gguf.peers_report import BPW, CALIB_CHUNKS, CHUNKS, CTX, FRESH, OURS, TYPES, report
from benchmarks.harness import RESULTS, write_results


def _data() -> Path:
    from bitmosaic.data import resolve_data_dir

    d = resolve_data_dir(None)
    if d is None:
        raise SystemExit(
            "set BITMOSAIC_DATA to the shared data folder (wikitext-2/valid.txt, wikitext-2-raw/)"
        )
    return Path(d)


def _run(cmd: list, log: Path) -> str:
    t = time.perf_counter()
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    log.write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"{Path(str(cmd[0])).name} failed ({p.returncode}); log: {log}")
    print(f"  {Path(str(cmd[0])).name} {time.perf_counter() - t:.0f} s", flush=True)
    return p.stdout + p.stderr


def parse_perplexity(text: str) -> dict:
    """PPL (and, with ``--kl-divergence``, mean KL and top-1 agreement) from llama-perplexity's output."""
    out = {}
    m = re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)\s*±\s*([\d.]+)", text) or re.search(
        r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", text
    )
    if m:
        out["ppl"], out["ppl_err"] = float(m[1]), float(m[2])
    m = re.search(r"Mean\s+KLD:\s*([-\d.]+)\s*±\s*([\d.]+)", text)
    if m:
        out["kld"] = float(m[1])
    m = re.search(r"Same top p:\s*([\d.]+)\s*±\s*([\d.]+)", text)
    if m:
        out["top1"] = float(m[1])
    m = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", text)
    if m:
        out["eval_tok_s"] = int(m[2]) / (float(m[1]) / 1000)
    nll = chunk_nll(text)
    if nll:
        out["chunk_nll"] = nll
    return out


def chunk_nll(text: str) -> list[float]:
    """Each chunk's mean NLL, from the running perplexity llama-perplexity prints after every chunk
    (``[k]P_k,`` or, with ``--kl-divergence``, the line ``k  P_k ± ...``): every chunk scores the same
    number of tokens, so chunk ``k``'s mean NLL is ``k ln P_k - (k - 1) ln P_(k-1)``.  The tool prints
    ``P_k`` with 4 decimals, so each value carries a rounding error below ``k * 4e-6`` nats at
    perplexities near 25 (under 2e-4 at chunk 40)."""
    run = [(int(k), float(v)) for k, v in re.findall(r"\[(\d+)\]([\d.]+),", text)]
    if not run:
        run = [(int(k), float(v)) for k, v in re.findall(r"^\s*(\d+)\s+([\d.]+) ±", text, re.M)]
    if not run or [k for k, _ in run] != list(range(1, len(run) + 1)):
        return []
    cum = [k * math.log(v) for k, v in run]
    return [round(c - (cum[i - 1] if i else 0.0), 6) for i, c in enumerate(cum)]


def file_types(path: Path) -> dict[str, int]:
    from gguf import GGUFReader

    out: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        if len(t.shape) == 2:
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
    return dict(sorted(out.items()))


def calibration_chunks(tok, path: Path, n: int, ctx: int):
    """The first ``n`` chunks of ``ctx`` tokens of the text at ``path``, as llama-imatrix reads them:
    the whole text tokenized once, each chunk's first token replaced by BOS where the tokenizer adds one."""
    import torch

    from bitmosaic.data import bos_token_id

    ids = tok(path.read_text(), return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    bos = bos_token_id(tok)
    if bos is not None:
        ids = torch.cat([torch.tensor([bos]), ids])
    x = ids[: n * ctx].view(n, ctx).clone()
    if bos is not None:
        x[:, 0] = bos
    return x


class Steps:
    def __init__(self, a):
        from benchmarks.peers.llama_tools import find_or_build, tool

        folder = find_or_build()
        if folder is None:
            raise SystemExit(2)
        self.tool = lambda name: tool(folder, name)
        self.a, self.work = a, Path(a.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.state_path = self.work / "state.json"
        self.state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        self.t0 = time.monotonic()
        d = _data()
        self.valid, self.test = d / "wikitext-2" / "valid.txt", d / "wikitext-2-raw" / "wiki.test.raw"

    def save(self):
        self.state_path.write_text(json.dumps(self.state, indent=2))

    def budget_left(self) -> bool:
        return self.a.budget is None or time.monotonic() - self.t0 < self.a.budget

    def base(self, imatrix: bool = True):
        from bitmosaic.io.export import export_model

        for typ in ("F32", "F16"):
            p = self.work / f"base.{typ}.gguf"
            if not p.exists():
                res = export_model(self.a.model, p, "gguf", gguf_type=typ, lossy=True, overwrite=True)
                self.state[f"export {typ}"] = {"changed": res.changed, "notes": res.notes}
                self.save()
        imat = self.work / "imatrix.gguf"
        if imatrix and not imat.exists():
            _run(
                [
                    self.tool("llama-imatrix"),
                    "-m",
                    self.work / "base.F32.gguf",
                    "-f",
                    self.valid,
                    "-o",
                    imat,
                    "-c",
                    CTX,
                    "--chunks",
                    CALIB_CHUNKS,
                    "-t",
                    self.a.threads,
                ],
                self.work / "imatrix.log",
            )
        kld = self.work / "base.F16.kld"
        if "F16" not in self.state.get("ppl", {}):
            out = _run(
                [
                    self.tool("llama-perplexity"),
                    "-m",
                    self.work / "base.F16.gguf",
                    "-f",
                    self.test,
                    "-c",
                    CTX,
                    "--chunks",
                    CHUNKS,
                    "-t",
                    self.a.threads,
                    "--kl-divergence-base",
                    kld,
                ],
                self.work / "ppl.F16.log",
            )
            self.record("F16", self.work / "base.F16.gguf", parse_perplexity(out))

    def record(self, key: str, path: Path, r: dict):
        r.update(mb=path.stat().st_size / 1e6, types=file_types(path), file=path.name)
        self.state.setdefault("ppl", {})[key] = r
        self.save()
        print(f"  {key}: {r}", flush=True)

    def perplexity(self, key: str, path: Path):
        if key in self.state.get("ppl", {}) or not self.budget_left():
            return
        out = _run(
            [
                self.tool("llama-perplexity"),
                "-m",
                path,
                "-c",
                CTX,
                "--chunks",
                CHUNKS,
                "-t",
                self.a.threads,
                "--kl-divergence-base",
                self.work / "base.F16.kld",
                "--kl-divergence",
            ],
            self.work / f"ppl.{key}.log",
        )
        self.record(key, path, parse_perplexity(out))

    def llama_file(self, typ: str, imatrix: bool) -> Path | None:
        tag = "imatrix" if imatrix else "plain"
        p = self.work / f"llama.{typ}.{tag}.gguf"
        refused = self.state.setdefault("refused", {})
        if p.exists() or f"{typ} {tag}" in refused:
            return p if p.exists() else None
        if not self.budget_left():
            return None
        cmd = [
            self.tool("llama-quantize"),
            *(["--imatrix", self.work / "imatrix.gguf"] if imatrix else []),
            self.work / "base.F32.gguf",
            p.with_suffix(".tmp"),
            typ,
            self.a.threads,
        ]
        try:
            _run(cmd, self.work / f"quantize.{typ}.{tag}.log")
        except RuntimeError as e:
            log = (self.work / f"quantize.{typ}.{tag}.log").read_text().strip().splitlines()
            refused[f"{typ} {tag}"] = next((x for x in reversed(log) if "imatrix" in x.lower()), str(e))[:200]
            self.save()
            return None
        p.with_suffix(".tmp").rename(p)
        return p

    def ours(self, typ: str) -> Path | None:
        p = self.work / f"bitmosaic.{typ}.gguf"
        late = self.a.budget is not None and time.monotonic() - self.t0 > FRESH
        if p.exists() or late:
            return p if p.exists() else None
        import torch

        import bitmosaic
        from bitmosaic.io import load_model, save_quantized
        from bitmosaic.io.export import export_model

        model, tok = load_model(self.a.model)
        calib = calibration_chunks(tok, self.valid, CALIB_CHUNKS, CTX)
        kw, extra = {"gguf_type": typ}, {}
        if typ.startswith(BPW):  # --gguf-target-bpw at the preset's own bits per weight (equal file bytes)
            from bitmosaic.methods.gguf_bpw import preset_bpw

            names = [
                n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n
            ]
            kw = {"gguf_target_bpw": preset_bpw(model, names, typ[len(BPW) :])}
            extra = {"target_bpw": kw["gguf_target_bpw"]}
        t = time.perf_counter()
        bitmosaic.quantize_(model, "gptq", calib, progress=False, source_model=self.a.model, **kw)
        secs = time.perf_counter() - t
        folder = save_quantized(model, self.work / f"bitmosaic.{typ}")
        res = export_model(folder, p, "gguf", overwrite=True)
        self.state.setdefault("ours", {})[typ] = {
            **extra,
            "quant_seconds": secs,
            "changed": res.changed,
            "notes": res.notes,
        }
        self.save()
        return p


def decode_files(work: Path) -> dict[str, Path]:
    """The files the decode column is timed for: the bases, llama.cpp's and bitmosaic's, keyed as the rows."""
    files = {"F32": work / "base.F32.gguf", "F16": work / "base.F16.gguf"}
    for typ in (*TYPES, *(t for t in OURS if t.startswith(BPW))):
        for tag in ("imatrix", "plain"):
            files[f"llama {typ} {tag}"] = work / f"llama.{typ}.{tag}.gguf"
        files[f"bitmosaic {typ}"] = work / f"bitmosaic.{typ}.gguf"
    return {k: f for k, f in files.items() if f.exists()}


def decode(a) -> None:
    from benchmarks.gguf.decode_speed import time_files

    work = Path(a.work)
    state_path = work / "state.json"
    st = json.loads(state_path.read_text())
    st["decode"] = time_files(decode_files(work), a.threads)
    state_path.write_text(json.dumps(st, indent=2))
    write_results(RESULTS / "gguf_vs_llamacpp.json", "gguf_vs_llamacpp", {"protocol": __doc__, **st},
                  report(st, a))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default="runs/gguf_vs_llamacpp")
    p.add_argument("--budget", type=float, default=None, help="stop between steps after this many seconds")
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument(
        "--skip-llama",
        action="store_true",
        help="no imatrix and no llama-quantize files (their rows kept as the state holds them)",
    )
    p.add_argument(
        "--decode",
        action="store_true",
        help="only time decode (tok/s) of every file the work folder holds, in llama.cpp "
        "(benchmarks/gguf/decode_speed.py; run it alone, under the heavy lock, on a quiet machine)",
    )
    a = p.parse_args()
    if a.decode:
        return decode(a)
    import torch

    torch.set_num_threads(a.threads)
    s = Steps(a)
    s.base(imatrix=not a.skip_llama)
    s.perplexity("F32", s.work / "base.F32.gguf")
    types = a.types.split(",")
    for typ in types if not a.skip_llama else ():
        for imatrix in (True, False):
            f = s.llama_file(typ, imatrix)
            if f is not None:
                s.perplexity(f"llama {typ} {'imatrix' if imatrix else 'plain'}", f)
    if not a.skip_ours:
        for typ in OURS:
            if typ in types:
                f = s.ours(typ)
                if f is not None:
                    s.perplexity(f"bitmosaic {typ}", f)
                else:  # too late in this run for a quantization: the next run starts with it
                    break
    done = s.budget_left() and all(
        f"bitmosaic {t}" in s.state.get("ppl", {}) for t in OURS if t in types and not a.skip_ours
    )
    write_results(
        RESULTS / "gguf_vs_llamacpp.json",
        "gguf_vs_llamacpp",
        {"protocol": __doc__, **s.state},
        report(s.state, a),
    )
    print("done" if done else "budget spent: run again to continue", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
