"""The method flags of ``quantize``, generated from the registered configs' fields.

Each config field declares its flag with :func:`bitmosaic.methods.options.option`; a flag several
configs declare is one argument (each method's own help when they differ, every method's default).
:func:`method_options` turns the flags given into the chosen method's config fields; a flag the
method does not use is a one-line :class:`~bitmosaic.errors.OptionError` naming flag and method.
:func:`methods_table` is ``bitmosaic methods`` (and the README's method table).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field

from ..errors import OptionError
from ..methods.options import config_options, default_of, flag_of, option_spec, used_options

__all__ = ["MethodFlag", "add_method_args", "method_flags", "method_options", "methods_table"]


@dataclass
class MethodFlag:
    flag: str
    dest: str
    is_bool: bool
    negative: str | None = None
    users: dict = field(default_factory=dict)  # method name -> its Field (only methods that use it)
    declared: dict = field(default_factory=dict)  # method name -> its Field (every config with it)

    @property
    def spec(self):
        return option_spec(next(iter({**self.declared, **self.users}.values())))

    def typed(self, value) -> str:
        """The flag as the user typed it (the negative form for a bool given as off)."""
        return self.negative if self.is_bool and value is False else self.flag


def _registry():
    from ..methods import get_method, list_methods

    return [get_method(n) for n in list_methods()]


def method_flags() -> dict[str, MethodFlag]:
    """Every method flag, in declaration order, with the methods that use it."""
    flags: dict[str, MethodFlag] = {}
    for m in _registry():
        used = used_options(m.config_cls)
        for name, f in config_options(m.config_cls).items():
            spec = option_spec(f)
            if spec.shared:
                continue
            flag = flag_of(f)
            is_bool = isinstance(default_of(f), bool) or spec.type is bool  # bool, or None = auto
            d = flags.get(flag)
            if d is None:
                neg = (spec.negative or "--no-" + flag[2:]) if is_bool else None
                d = flags[flag] = MethodFlag(flag, flag[2:].replace("-", "_"), is_bool, neg)
            d.declared[m.name] = f
            if name in used:
                d.users[m.name] = f
    return flags


def _show(f: dataclasses.Field, cls) -> str:
    spec = option_spec(f)
    if spec.sets:  # a composite flag (one --block, two fields): the default of every field it sets
        vals = [default_of(config_options(cls)[n]) for n in spec.sets]
        return "x".join("group" if v is None else str(v) for v in vals)
    v = default_of(f)
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, tuple):
        if len(v) > 4:
            return f"{len(v)} values {v[0]:g}..{v[-1]:g}"
        return ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in v)
    if v is None:
        return "search" if f.name == "alpha" else "auto" if spec.type is bool else "none"
    return str(v)


def _help(d: MethodFlag, n_methods: int) -> str:
    from ..methods import get_method

    by_default: dict[str, list[str]] = {}
    for m, f in d.users.items():
        by_default.setdefault(_show(f, get_method(m).config_cls), []).append(m)
    ranked = sorted(by_default.items(), key=lambda kv: -len(kv[1]))
    default = "default " + "; ".join([ranked[0][0], *(f"{', '.join(ms)}: {v}" for v, ms in ranked[1:])])
    if len(d.users) == n_methods:
        who = ""
    elif len(d.users) > n_methods / 2:
        who = f" [not {', '.join(sorted(set(_names()) - set(d.users)))}]"
    else:
        who = f" [{', '.join(d.users)}]"
    helps: dict[str, list[str]] = {}  # each config says what the flag means for it (and its choices)
    same = d.spec.choices is None or _same_choices(d) is not None
    for m, f in d.users.items():
        spec = option_spec(f)
        own = f" {{{'|'.join(map(str, spec.choices))}}}" if spec.choices and not same else ""
        helps.setdefault(spec.help + own, []).append(m)
    text = next(iter(helps), d.spec.help) if len(helps) <= 1 else "; ".join(
        f"{', '.join(ms)}: {h}" for h, ms in helps.items()
    )
    return (text + who + f" ({default})").replace("%", "%%")


def _names() -> list[str]:
    from ..methods import list_methods

    return list_methods()


def _same_choices(d: MethodFlag):
    sets = {option_spec(f).choices for f in d.users.values()}
    return next(iter(sets)) if len(sets) == 1 and None not in sets else None


class _Toggle(argparse.Action):
    """A bool option as one help entry: ``--x`` sets it, its negative (``--no-x``, ``--asym``) clears it."""

    def __init__(self, option_strings, dest, negative: str, **kw):
        self.negative = negative
        super().__init__(option_strings, dest, nargs=0, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string != self.negative)


class _Deprecated(argparse.Action):
    """An old spelling: warns, then stores into the new flag's dest."""

    def __init__(self, option_strings, dest, new: str, const=None, **kw):
        self.new = new
        super().__init__(option_strings, dest, nargs=0 if const is not None else None, const=const, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(
            f"bitmosaic: warning: {option_string} is deprecated and goes away in the next release; "
            f"use {self.new}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, self.const if self.const is not None else values)


def add_method_args(p: argparse.ArgumentParser) -> None:
    """One argument group per method (its own flags) and one for the flags several methods share."""
    methods = _registry()
    flags = method_flags()
    groups: dict[str, argparse._ArgumentGroup] = {}
    for d in flags.values():
        if not d.users:
            continue
        if len(d.users) == len(methods):
            key = "options of every method"
        elif len(d.users) > 1 and _one_class(d):
            key = "methods " + ", ".join(d.users)
        elif len(d.users) == 1:
            key = "method " + next(iter(d.users))
        else:
            key = "options of several methods (the methods in [brackets])"
        if key not in groups:
            groups[key] = p.add_argument_group(key)
        g = groups[key]
        strings = [d.flag, *d.spec.aliases]
        if d.is_bool:
            g.add_argument(
                *strings, d.negative, dest=d.dest, action=_Toggle, negative=d.negative, default=None,
                help=_help(d, len(methods)),
            )  # fmt: skip
        else:
            choices = _same_choices(d)
            metavar = None if choices else d.dest.upper()
            convs = {_converter(f) for f in d.users.values()}
            typ = convs.pop() if len(convs) == 1 and convs & {int, float} else None  # else: per method
            g.add_argument(
                *strings, dest=d.dest, default=None, metavar=metavar, help=_help(d, len(methods)), type=typ,
                choices=None if choices is None else [typ(c) if typ else str(c) for c in choices],
            )  # fmt: skip
        for f in d.declared.values():
            for old in option_spec(f).deprecated:
                if old not in p._option_string_actions:
                    const = (old != d.negative) if d.is_bool else None
                    p.add_argument(
                        old, dest=d.dest, action=_Deprecated, new=d.flag, const=const, help=argparse.SUPPRESS
                    )


def _one_class(d: MethodFlag) -> bool:
    from ..methods import get_method

    return len({get_method(m).config_cls for m in d.users}) == 1


def _converter(f: dataclasses.Field):
    spec, default = option_spec(f), default_of(f)
    return spec.parse or spec.type or (type(default) if default is not None else str)


def _convert(d: MethodFlag, f: dataclasses.Field, raw):
    spec = option_spec(f)
    if isinstance(raw, list):  # argparse reads `--block=--` as an empty list
        raise OptionError(f"{d.flag} got no value (argparse takes '--' as the end of the options)")
    if isinstance(raw, bool) or not isinstance(raw, str):
        return raw
    parse = _converter(f)
    try:
        value = parse(raw)
    except ValueError as e:
        shown = raw if raw.isprintable() else repr(raw)  # a newline in the text stays on one line
        raise OptionError(f"{d.flag} {shown}: {e}") from None
    if spec.choices and value not in spec.choices:
        raise OptionError(f"{d.flag} {raw!r} must be one of {', '.join(map(str, spec.choices))}")
    return value


def method_options(args, method) -> dict:
    """The config fields the flags in ``args`` give for ``method`` (a registered method); a flag
    the method does not use is an :class:`OptionError`."""
    from .args import act_spec_from_args

    cls = method.config_cls
    unused = getattr(cls, "unused", {})
    fields = config_options(cls)
    opts: dict = {}
    for d in method_flags().values():
        value = getattr(args, d.dest, None)
        if value is None:
            continue
        own = [f for f in fields.values() if flag_of(f) == d.flag and not option_spec(f).shared]
        if not own or any(f.name in unused for f in own):
            why = next((unused[f.name] for f in own if f.name in unused), None)
            where = f"; it is used by {', '.join(d.users)}" if d.users and not why else ""
            raise OptionError(
                f"{d.typed(value)} does not apply to method {method.name!r}{': ' + why if why else where}"
            )
        for f in own:
            v = _convert(d, f, value)
            sets = option_spec(f).sets
            opts[f.name] = v[sets.index(f.name)] if sets else v
    args.bits_given = args.bits is not None
    if args.bits is not None:
        args.bits = int(args.bits)
    act = act_spec_from_args(args)  # may set args.bits from --scheme
    if args.bits is not None and "bits" not in unused:
        opts["bits"] = args.bits
    if act is not None or args.scheme or args.abits is not None:
        if "act" in unused:
            raise OptionError(
                f"--scheme/--abits/--afmt do not apply to method {method.name!r}: {unused['act']}"
            )
        opts["act"] = act
    return opts


def methods_table(markdown: bool = False) -> str:
    """The registered methods with their description and every flag they use (their config's
    fields, in declaration order): ``bitmosaic methods`` and the README's method table."""
    rows, no_act = [], [m.name for m in _registry() if "act" in getattr(m.config_cls, "unused", {})]
    for m in _registry():
        own = []
        for f in used_options(m.config_cls).values():
            if not option_spec(f).shared and flag_of(f) not in own:
                own.append(flag_of(f))
        rows.append((m.name, m.description, own))
    if not markdown:
        return "\n".join(f"{n:<12} {desc}\n{'':<12} {' '.join(fl)}" for n, desc, fl in rows)
    return "\n".join(
        [
            "| method | what it does | its flags |",
            "|---|---|---|",
            *(f"| `{n}` | {desc} | {' '.join(f'`{x}`' for x in fl)} |" for n, desc, fl in rows),
            "",
            f"Every method also takes the activation flags `--scheme --abits --afmt --a-*`{_except(no_act)}.",
        ]
    )


def _except(names: list[str]) -> str:
    if not names:
        return ""
    who = "it quantizes" if len(names) == 1 else "they quantize"
    return f" (except {', '.join(f'`{n}`' for n in names)}: {who} activations itself)"
