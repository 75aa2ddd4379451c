"""The package's shape: no import cycle, dependencies point one way, the generic layers (pipeline, io,
cli) name no method, and a method's footprint stays small (``scripts/method_footprint.py``)."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "src" / "bitmosaic"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every bitmosaic module ``name`` imports, at module level or inside a function."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _from_module(node, name, is_pkg)
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _from_module(node: ast.ImportFrom, name: str, is_pkg: bool) -> str:
    """The absolute module a ``from ... import`` in module ``name`` reads from."""
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def test_no_import_cycle():
    graph = _graph()
    index, low, stack, on, cycles = {}, {}, [], set(), []
    sys.setrecursionlimit(10_000)

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


# layer -> the layers it must not import (formats <- algorithms <- modules/kernels <- methods <-
# pipeline/io <- cli; models/ holds the declarative maps the upper layers read)
FORBIDDEN = {
    "formats": ("algorithms", "modules", "kernels", "methods", "pipeline", "io", "cli", "models", "eval"),
    "algorithms": ("modules", "kernels", "methods", "pipeline", "io", "cli", "models", "eval"),
    "kernels": ("modules", "methods", "pipeline", "io", "cli", "models", "eval"),
    "modules": ("methods", "pipeline", "io", "cli", "models", "eval"),
    "methods": ("pipeline", "io", "cli", "models", "eval"),
    "models": ("algorithms", "modules", "kernels", "methods", "pipeline", "io", "cli", "eval"),
    "pipeline": ("cli", "eval", "api"),
    "io": ("cli", "eval", "pipeline", "api"),
    "eval": ("cli",),
}


def test_dependencies_point_one_way():
    bad = []
    for mod, deps in _graph().items():
        parts = mod.split(".")
        if len(parts) < 2 or parts[1] not in FORBIDDEN:
            continue
        for d in deps:
            dp = d.split(".")
            if len(dp) > 1 and dp[1] in FORBIDDEN[parts[1]]:  # api is the module bitmosaic.api
                bad.append(f"{mod} -> {d}")
    assert not bad, "imports that point up the layers:\n" + "\n".join(sorted(bad))


def _footprint():
    path = REPO / "scripts" / "method_footprint.py"
    spec = importlib.util.spec_from_file_location("method_footprint", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# names that are only methods (gptq, rtn and fp8 also name a checkpoint format, a rounding rule used
# by lossy export and a number format, so the generic layers may say them)
METHOD_ONLY = ("sfmp", "mosaic", "smoothquant", "awq", "dpq", "ssqr", "hptq", "hrtn", "sq-weights", "sq-acts")


@pytest.mark.parametrize("layer", ["pipeline", "io", "cli"])
def test_generic_layers_name_no_method(layer):
    code_text = _footprint().code_text
    pat = re.compile(r"(?<![a-z0-9])(" + "|".join(re.escape(m) for m in METHOD_ONLY) + r")(?![a-z0-9])")
    hits = []
    for p in sorted((PKG / layer).rglob("*.py")):
        found = sorted(set(pat.findall(code_text(p).lower())))
        if found:
            hits.append(f"{p.relative_to(PKG)}: {', '.join(found)}")
    assert not hits, "method names in a generic layer:\n" + "\n".join(hits)


# the registration lines: the list of methods, the list of module kinds, the list of C++ extensions
REGISTRATION = {"methods/__init__.py", "modules/__init__.py", "kernels/build.py"}


def test_a_method_touches_few_files():
    """A method is its algorithms file, its methods file and, for a new storage format, its module
    kind and kernel, plus registration lines (the issue's bound: SFMP at most 7 files in all)."""
    fp = _footprint().footprint()
    assert len(fp["sfmp"]) <= 7, fp["sfmp"]
    for m in ("sfmp", "mosaic", "ssqr", "hptq/hrtn", "sq-weights", "sq-acts", "smoothquant", "awq", "dpq"):
        own = [f for f in fp[m] if f not in REGISTRATION]
        assert len(own) <= 5, (m, own)


def test_the_forbidden_table_names_real_layers():
    """A typo in FORBIDDEN would silently allow an import: every layer it names exists."""
    layers = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    layers |= {p.stem for p in PKG.glob("*.py")}
    named = set(FORBIDDEN) | {d for deps in FORBIDDEN.values() for d in deps}
    assert named <= layers, sorted(named - layers)


def _private_imports(path: Path, name: str, mods: dict[str, Path]) -> list[str]:
    """``from X import _name`` where X is another bitmosaic module (a private name crossing files)."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom):
            continue
        mod = _from_module(node, name, is_pkg)
        if not mod.startswith("bitmosaic"):
            continue
        for a in node.names:
            if a.name.startswith("_") and not a.name.startswith("__") and f"{mod}.{a.name}" not in mods:
                out.append(f"{name}:{node.lineno} imports {a.name} from {mod}")
    return out


def test_no_private_name_crosses_files():
    mods = _modules()
    bad = [line for m, p in sorted(mods.items()) for line in _private_imports(p, m, mods)]
    why = "private names imported from another file (make them public or move them):\n"
    assert not bad, why + "\n".join(bad)


def _functions():
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).as_posix()
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                n_params = len(names) + (a.vararg is not None) + (a.kwarg is not None)
                yield f"{rel}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1, n_params


def test_functions_stay_short():
    """At most three functions of the package exceed 80 lines, none 120 (the run-path issue's bound)."""
    long = sorted((n, where) for where, n, _ in _functions() if n > 80)
    assert len(long) <= 3 and all(n <= 120 for n, _ in long), long


def test_run_path_functions_take_few_parameters():
    """No function in pipeline/, cli/ or api.py takes more than 8 parameters (a settings object counts
    as one), and the driver, the API entry and the CLI's quantize command are at most 80 lines."""
    many = [(where, k) for where, _, k in _functions()
            if k > 8 and where.startswith(("pipeline/", "cli/", "api.py"))]  # fmt: skip
    assert not many, many
    sizes = {where.split(" ")[1]: n for where, n, _ in _functions()
             if where.startswith(("pipeline/pipeline.py", "api.py", "cli/quantize.py"))}  # fmt: skip
    for fn in ("quantize_model", "quantize_", "cmd_quantize", "_quantize"):
        assert sizes[fn] <= 80, (fn, sizes[fn])


# a registered method that is another's variant and lives in that method's file (the Babai paper's HRTN
# "mirrors HPTQ but replaces GPTQ with RTN": one config, one algorithm call, one packed format)
VARIANT_OF = {"hrtn": "hptq"}


def test_method_files_are_named_by_method_and_stand_alone():
    """Every registered method lives in ``methods/<its name>.py``, no method file imports another, and
    no method's config derives from another method's config (what several share stands on the small
    bases in ``methods/common.py``), so a change to one method's file or config moves that method."""
    from bitmosaic.methods import get_method, list_methods

    methods = {n: get_method(n) for n in list_methods()}
    files = {n: type(m).__module__ for n, m in methods.items()}
    wrong = {
        n: f for n, f in files.items() if f != "bitmosaic.methods." + VARIANT_OF.get(n, n).replace("-", "_")
    }
    assert not wrong, f"methods not in a file named by the method: {wrong}"
    configs = {m.config_cls for m in methods.values()}
    borrowed = {n: [b.__name__ for b in m.config_cls.__mro__[1:] if b in configs] for n, m in methods.items()}
    borrowed = {n: b for n, b in borrowed.items() if b}
    assert not borrowed, f"configs derived from another method's: {borrowed}"
    graph, own = _graph(), set(files.values())
    cross = sorted(f"{m} -> {d}" for m in own for d in graph[m] if d in own)
    assert not cross, "method files importing another method's file:\n" + "\n".join(cross)
