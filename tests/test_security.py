"""Security checks of the package source (issue 26, section 5): no pickle, ``torch.load`` only with
``weights_only=True``, never ``trust_remote_code=True`` written in the code (only a value the user
passes), YAML through ``safe_load``, no ``eval``/``exec``/``compile``, no ``shell=True``/``os.system``/
``os.popen``, and subprocesses given argument lists.  The checker reads the syntax tree (comments and
strings that merely mention a name do not count), and is itself tested on planted examples, so a check
that stopped finding anything would fail.

Plus the paths: export copies no file from outside the saved folder (a symlink to ``~/.ssh/id_rsa``
in a downloaded folder), and ``compare`` names no run folder outside ``--out`` (a config named ``..``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "bitmosaic"

_PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}
_SHELL_CALLS = {"os.system", "os.popen", "os.execl", "os.execle", "os.execlp", "os.execv", "os.execvp",
                "os.spawnl", "os.spawnlp", "os.spawnv", "os.startfile", "subprocess.getoutput",
                "subprocess.getstatusoutput", "commands.getoutput"}  # fmt: skip
_SUBPROCESS = {"subprocess.run", "subprocess.call", "subprocess.check_call", "subprocess.check_output",
               "subprocess.Popen"}  # fmt: skip
_UNSAFE_YAML = {"yaml.load", "yaml.load_all", "yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load",
                "yaml.full_load_all"}  # fmt: skip
# torch.distributed's object collectives pickle what the other ranks of the same torchrun job send
# (processes of this very command, on the user's own machines); allowed there and nowhere else
ALLOWED = {("pipeline/distributed.py", "torch.distributed.all_gather_object"),
           ("pipeline/distributed.py", "torch.distributed.broadcast_object_list")}  # fmt: skip
_OBJECT_COLLECTIVES = {"torch.distributed.all_gather_object", "torch.distributed.broadcast_object_list",
                       "torch.distributed.gather_object", "torch.distributed.scatter_object_list",
                       "torch.distributed.recv_object_list",
                       "torch.distributed.send_object_list"}  # fmt: skip


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` of a Name/Attribute chain ('' for anything else)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _is_text(node: ast.AST) -> bool:
    """A command written as one string: a literal, an f-string, ``"..." % x``, ``"..." + x``, ``.format``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) or isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mod, ast.Add)):
        return _is_text(node.left) or _is_text(node.right)
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format"


def forbidden(source: str, where: str = "<string>") -> list[str]:
    """The forbidden calls and imports in Python ``source``, one ``where:line: what`` per finding."""
    found = []
    aliases: dict[str, str] = {}  # local name -> module path (import yaml as y; from os import system)
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                if a.name.split(".")[0] in _PICKLING_MODULES:
                    found.append(f"{where}:{node.lineno}: import {a.name} (pickle runs code on load)")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            if node.module.split(".")[0] in _PICKLING_MODULES:
                found.append(f"{where}:{node.lineno}: from {node.module} import (pickle runs code on load)")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        head, _, rest = name.partition(".")
        name = f"{aliases[head]}.{rest}".rstrip(".") if head in aliases else name
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        line = f"{where}:{node.lineno}"
        if name in ("eval", "exec", "compile", "builtins.eval", "builtins.exec", "__import__"):
            found.append(f"{line}: {name}() runs text as code")
        if name in _SHELL_CALLS:
            found.append(f"{line}: {name}() goes through a shell")
        if _is_true(kw.get("shell")):
            found.append(f"{line}: shell=True")
        if name in _SUBPROCESS and node.args and _is_text(node.args[0]):
            found.append(f"{line}: {name}() with a command string; give an argument list")
        if name == "torch.load" and not _is_true(kw.get("weights_only")):
            found.append(f"{line}: torch.load without weights_only=True (unpickles)")
        if name in _UNSAFE_YAML:
            found.append(f"{line}: {name}(); use yaml.safe_load")
        if name in ("numpy.load", "np.load") and _is_true(kw.get("allow_pickle")):
            found.append(f"{line}: numpy.load(allow_pickle=True)")
        if _is_true(kw.get("trust_remote_code")):
            found.append(f"{line}: trust_remote_code=True in the code (only the user may set it)")
        if name in _OBJECT_COLLECTIVES and (where, name) not in ALLOWED:
            found.append(f"{line}: {name}() unpickles what it receives")
    return found


def test_the_package_has_no_forbidden_call():
    found = []
    for f in sorted(SRC.rglob("*.py")):
        found += forbidden(f.read_text(encoding="utf-8"), str(f.relative_to(SRC)))
    assert not found, "\n".join(found)


def test_the_allowed_exceptions_are_still_there():
    """An allowance that no longer matches anything is removed (the list stays honest)."""
    for where, name in ALLOWED:
        text = (SRC / where).read_text(encoding="utf-8")
        assert name.rpartition(".")[2] in text, (where, name)


PLANTED = [
    "import pickle\npickle.loads(b'')",
    "from pickle import loads",
    "import dill",
    "import torch\ntorch.load('x.pt')",
    "import torch\ntorch.load('x.pt', weights_only=False)",
    "import torch as t\nt.load(f)",
    "from torch import load\nload(f)",
    "import yaml\nyaml.load(text)",
    "import yaml\nyaml.load(text, Loader=yaml.Loader)",
    "import yaml as y\ny.full_load(text)",
    "eval('1+1')",
    "exec(code)",
    "import os\nos.system('ls')",
    "from os import system\nsystem('ls')",
    "import os\nos.popen('ls')",
    "import subprocess\nsubprocess.run('ls -l', shell=True)",
    "import subprocess\nsubprocess.run(f'ls {x}')",
    "import subprocess\nsubprocess.check_output('ls ' + x)",
    "import subprocess as sp\nsp.Popen('ls %s' % x)",
    "from transformers import AutoModel\nAutoModel.from_pretrained(p, trust_remote_code=True)",
    "import numpy as np\nnp.load(f, allow_pickle=True)",
    "import torch\ntorch.distributed.all_gather_object(out, obj)",
]


@pytest.mark.parametrize("source", PLANTED)
def test_the_checker_finds_a_planted_call(source):
    assert forbidden(source), source


CLEAN = [
    "model.eval()",
    "import torch\ntorch.load('x.pt', weights_only=True)",
    "import yaml\nyaml.safe_load(text)",
    "import subprocess\nsubprocess.run(['ls', '-l'], check=True)",
    "import subprocess\nsubprocess.run(cmd, stdout=f)",
    "from transformers import AutoModel\nAutoModel.from_pretrained(p, trust_remote_code=user_choice)",
    "# pickle.loads(x) in a comment\nx = 'eval(' ",
    "import numpy as np\nnp.load(f)",
]


@pytest.mark.parametrize("source", CLEAN)
def test_the_checker_passes_safe_code(source):
    assert not forbidden(source), forbidden(source)


# -- paths ------------------------------------------------------------------------------------------
def test_export_copies_no_file_from_outside_the_saved_folder(tmp_path):
    """A symlink in the saved folder pointing outside it (``tokenizer.json -> ~/.ssh/id_rsa``) would have
    its target's bytes copied into the export; it is refused in one line and nothing is written."""
    from bitmosaic.errors import BitmosaicError
    from bitmosaic.io.export import export_model as export
    from tests.helpers import quantized_dir

    src = quantized_dir(tmp_path / "q")
    secret = tmp_path / "secret.txt"
    secret.write_text("private key")
    (src / "notes.txt").symlink_to(secret)
    with pytest.raises(BitmosaicError, match="symlink"):
        export(src, tmp_path / "out", "gptq")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_export_follows_a_symlink_inside_the_folder(tmp_path):
    from bitmosaic.io.export import export_model as export
    from tests.helpers import quantized_dir

    src = quantized_dir(tmp_path / "q")
    (src / "chat_template.jinja").write_text("{{ x }}")
    (src / "template-link.jinja").symlink_to(src / "chat_template.jinja")
    export(src, tmp_path / "out", "gptq")
    assert (tmp_path / "out" / "template-link.jinja").read_text() == "{{ x }}"


@pytest.mark.parametrize("name", ["..", ".", "../..", "./", "../models", "/etc", "a/../../b"])
def test_compare_run_names_stay_inside_out(name, tmp_path):
    """A config's name becomes ``OUT/runs/NAME.json`` and ``OUT/models/NAME``: never a path that leaves
    those folders (``..``) or names the folder itself (``.``)."""
    from bitmosaic.cli.compare import parse_configs
    from bitmosaic.io.sources.checkpoint import is_file_name

    f = tmp_path / "configs.json"
    f.write_text(f'[{{"name": "{name}", "method": "rtn", "bits": 4}}]')
    (config,) = parse_configs(str(f))
    assert is_file_name(config.slug), config.slug
    assert (tmp_path / "models" / config.slug).resolve().parent == (tmp_path / "models").resolve()
