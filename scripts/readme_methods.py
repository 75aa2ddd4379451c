#!/usr/bin/env python3
"""The README's table of methods, generated from the method registry (one row per registered method).

    python scripts/readme_methods.py            # print the Markdown table
    python scripts/readme_methods.py --write    # replace the block between the README's markers

Columns: the registered name; its one-line summary (the method's own ``description``, the line
``bitmosaic methods`` prints, else the first line of its class docstring); its weight bits (the
declared range and default of its config's ``bits`` field, else of its own bit-width fields such as
``target_bits`` or ``avg_bits``, else why it takes no ``--bits``); the module kind its layers
are saved as (``kind`` in a saved ``config.json``, ``bitmosaic inspect --layers``), read from the
module classes its ``pack`` hook builds; and its own CLI flags (its config's fields, in declaration
order: the flags ``bitmosaic methods`` lists).  ``tests/test_readme.py`` regenerates the table and
checks that the README holds exactly this, so a new method cannot be missing from it.
"""

from __future__ import annotations

import inspect
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN, END = "<!-- methods:begin -->", "<!-- methods:end -->"


def _summary(method) -> str:
    text = method.description or (inspect.getdoc(type(method)) or "").split("\n\n")[0]
    return " ".join(text.split()).replace("|", "\\|")


def _flags(method) -> list[str]:
    """The method's own flags, as ``bitmosaic methods`` lists them (shared options such as the
    activation spec left out)."""
    from bitmosaic.methods.options import flag_of, option_spec, used_options

    own: list[str] = []
    for f in used_options(method.config_cls).values():
        if not option_spec(f).shared and flag_of(f) not in own:
            own.append(flag_of(f))
    return own


def _span(f) -> str:
    from bitmosaic.methods.options import default_of, option_spec

    lo, hi = option_spec(f).range or (None, None)
    span = (
        f"{lo:g}"
        if lo == hi and lo is not None
        else f"{lo:g}–{hi:g}"
        if lo is not None and hi is not None
        else ""
    )
    d = default_of(f)
    if d is None or lo == hi:
        return span
    return f"{span} (default {d:g})" if span else f"default {d:g}"


def bits(method) -> str:
    """The weight bits the method takes: its ``bits`` field's range and default, else its own bit-width
    fields (their flags, ranges and defaults), else why it has no ``--bits`` (its config's ``unused``)."""
    from bitmosaic.methods.options import flag_of, used_options

    used = used_options(method.config_cls)
    if "bits" in used:
        return _span(used["bits"])
    own = [f for n, f in used.items() if n.endswith("bits") or n == "bpw"]
    if own:
        return ", ".join(f"`{flag_of(f)}` {_span(f)}".rstrip() for f in own)
    why = getattr(method.config_cls, "unused", {}).get("bits", "")
    return " ".join(why.split()).replace("|", "\\|")


def _names(code: types.CodeType, globals_: dict, seen: set, depth: int = 0) -> set[str]:
    """Every global or imported name the code (and the module-level helpers it calls, a few levels
    deep) refers to."""
    if id(code) in seen or depth > 3:
        return set()
    seen.add(id(code))
    names = set(code.co_names)
    for const in code.co_consts:  # nested functions, comprehensions
        if isinstance(const, types.CodeType):
            names |= _names(const, globals_, seen, depth)
    for name in list(names):
        fn = globals_.get(name)
        if isinstance(fn, types.FunctionType) and fn.__module__.startswith("bitmosaic."):
            names |= _names(fn.__code__, fn.__globals__, seen, depth + 1)
    return names


def module_kind(method) -> str:
    """The saved module kind(s) the method's ``pack`` builds: of the registered module classes its code
    names, the most derived (``SQActLinear`` wraps a ``QuantLinear``); a method whose options choose
    between unrelated kinds (gptq: ``packed``, or ``gguf-grid`` with ``--gguf-type``) lists each."""
    from bitmosaic.modules import KINDS

    pack = type(method).pack
    names = _names(pack.__code__, pack.__globals__, set())
    classes = [c for c in KINDS.values() if c.__name__ in names]
    leaves = [c for c in classes if not any(o is not c and issubclass(o, c) for o in classes)]
    if not leaves:
        raise RuntimeError(f"cannot tell the module kind of method {method.name!r}")
    return " / ".join(sorted((c.kind for c in leaves), key=lambda k: (k != "packed", k)))


def rows() -> list[tuple[str, str, str, str, list[str]]]:
    """(name, summary, bits, module kind, flags) of every registered method, by name."""
    from bitmosaic.methods import get_method, list_methods

    return [
        (n, _summary(m), bits(m), module_kind(m), _flags(m)) for n in list_methods() for m in [get_method(n)]
    ]


def table() -> str:
    from bitmosaic.methods import get_method, list_methods

    no_act = [n for n in list_methods() if "act" in getattr(get_method(n).config_cls, "unused", {})]
    lines = [
        "| method | what it does | weight bits | saved as (module kind) | its flags |",
        "|---|---|---|---|---|",
    ]
    for name, summary, nbits, kind, flags in rows():
        lines.append(f"| `{name}` | {summary} | {nbits} | `{kind}` | {' '.join(f'`{x}`' for x in flags)} |")
    lines.append("")
    tail = "Every method also takes the activation flags `--scheme --abits --afmt --a-*`"
    if no_act:
        who = "it quantizes" if len(no_act) == 1 else "they quantize"
        tail += f" (except {', '.join(f'`{n}`' for n in no_act)}: {who} activations itself)"
    lines.append(tail + ".")
    return "\n".join(lines)


def readme_block(text: str) -> str:
    """What the README holds between the markers (without the marker lines)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"README.md must hold {BEGIN} and {END} once each")
    return text.split(BEGIN + "\n", 1)[1].split("\n" + END, 1)[0]


def write(path: Path = README) -> bool:
    """Replace the README's block by the generated table; True when it changed."""
    text = path.read_text(encoding="utf-8")
    old = readme_block(text)
    new = table()
    if old == new:
        return False
    path.write_text(
        text.replace(BEGIN + "\n" + old + "\n" + END, BEGIN + "\n" + new + "\n" + END), encoding="utf-8"
    )
    return True


def main(argv: list[str]) -> int:
    if "--write" in argv:
        print("README.md: methods table " + ("rewritten" if write() else "already up to date"))
    else:
        print(table())
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    sys.exit(main(sys.argv[1:]))
