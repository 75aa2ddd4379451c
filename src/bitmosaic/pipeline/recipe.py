"""Quantization recipes: which method and settings each linear gets (``quantize --recipe FILE``).

A recipe is a YAML or JSON mapping::

    method: NAME                      # the default method (required; `bitmosaic methods` lists them)
    scheme: W4A16                     # optional: sets bits + activation quantizer (see formats/act.py)
    settings: {bits: 4, group_size: 128}   # the method's config fields
    overrides:                        # optional, first match wins; `match` is a regex searched in
      - match: 'mlp\\.down_proj$'     # the linear's qualified name (model.layers.3.mlp.down_proj)
        settings: {bits: 8}           # same method: merged over the default settings
      - match: 'layers\\.0\\.self_attn'
        method: OTHER                 # another method: its own settings (and scheme) only
        settings: {bits: 8, group_size: -1}
    skip: ['layers\\.1\\.mlp\\.gate_proj']   # regexes: these linears stay in float
    rotate: hadamard                  # optional: none (default), hadamard, random, spinquant (rotate.py)

``group_size: -1`` means per-channel (``null`` too).  The CLI flags are a one-entry recipe
(:meth:`Recipe.from_options`), so both take one code path: given a recipe,
:func:`bitmosaic.pipeline.pipeline.quantize_model` builds its resolver (:meth:`Recipe.resolver`:
qualified linear name -> ``(MethodSpec, config)`` or ``None`` to skip).  Every mistake is a one-line
:class:`~bitmosaic.errors.OptionError` naming the bad key and the fix.  A pattern that matches no
linear of the model gets a warning line; an entry that matches only linears an earlier entry took (so
it would never apply, e.g. the same pattern twice) is refused.

Linears that read one input (q/k/v, gate/up) are stacked into one solver call only when
they resolve to the same method and config, and a smoothing ``transform`` is
applied to such a group only when all its linears share that method and config (otherwise the
group stays unsmoothed); their static activation quantizers, if any, must be the same.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import OptionError
from .rotate import ROTATIONS, parse_rotation

__all__ = ["Recipe", "Rule", "load_recipe", "method_config"]

_TOP_KEYS = ("method", "scheme", "settings", "overrides", "skip", "rotate")
_RULE_KEYS = ("match", "method", "scheme", "settings")


def method_config(method: str, options: dict, scheme: str | None = None):
    """``(MethodSpec, config)`` for ``method`` with config fields ``options``; ``scheme`` (``W4A8``,
    ``W4A4``, ...) sets ``bits`` and ``act`` at once.  Raises ``ValueError`` (mostly
    :class:`~bitmosaic.errors.OptionError`, from the method's config class) on bad options."""
    from ..formats.act import parse_scheme
    from ..formats.packing import SUPPORTED_BITS
    from ..methods import get_method
    from ..methods.microscale import scheme_options

    spec = get_method(method)
    options = dict(options)
    if options.get("group_size") == -1:
        options["group_size"] = None
    if scheme is not None:
        bits, act = parse_scheme(scheme)
        if options.get("bits", bits) != bits:
            raise ValueError(f"scheme {scheme} says {bits}-bit weights but bits={options['bits']}")
        options = {**options, "bits": bits, "act": act, **scheme_options(spec.name, spec.config_cls, scheme)}
    bits, group = options.get("bits"), options.get("group_size")
    if bits is not None and (type(bits) is not int or bits not in SUPPORTED_BITS):
        raise OptionError(f"bits={bits!r} is not a supported width; use one of {list(SUPPORTED_BITS)}")
    if group is not None and (type(group) is not int or group < 1):
        raise OptionError(f"group_size={group!r} must be a positive integer, or -1 / null for per-channel")
    return spec, spec.make_config(**options)


@dataclass(frozen=True)
class Rule:
    match: str
    method: str | None = None
    scheme: str | None = None
    settings: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Recipe:
    method: str
    settings: dict = field(default_factory=dict)
    scheme: str | None = None
    overrides: tuple[Rule, ...] = ()
    skip: tuple[str, ...] = ()
    rotate: str = "none"  # QuaRot rotation folded into the float model first (pipeline/rotate.py)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d, where: str = "recipe") -> Recipe:
        """Parse and validate (every setting is turned into a config once, so errors come now)."""
        if not isinstance(d, dict):
            raise OptionError(
                f"{where} must be a mapping with keys {list(_TOP_KEYS)}; got {type(d).__name__}"
            )
        _known_keys(d, _TOP_KEYS, where)
        if not isinstance(d.get("method"), str):
            raise OptionError(f"{where} needs 'method: NAME' (see `bitmosaic methods`)")
        settings = _mapping(d.get("settings", {}), f"{where} key 'settings'")
        scheme = _opt_str(d.get("scheme"), f"{where} key 'scheme'")
        rules = []
        overrides = d.get("overrides", [])
        if not isinstance(overrides, list):
            raise OptionError(f"{where} key 'overrides' must be a list of {{match: REGEX, ...}} entries")
        for i, r in enumerate(overrides):
            at = f"{where} overrides[{i}]"
            if not isinstance(r, dict):
                raise OptionError(f"{at} must be a mapping with keys {list(_RULE_KEYS)}")
            _known_keys(r, _RULE_KEYS, at)
            rule = Rule(
                match=_pattern(r.get("match"), f"{at}.match"),
                method=_opt_str(r.get("method"), f"{at}.method"),
                scheme=_opt_str(r.get("scheme"), f"{at}.scheme"),
                settings=_mapping(r.get("settings", {}), f"{at}.settings"),
            )
            rules.append(rule)
        skip = d.get("skip", [])
        if not isinstance(skip, list):
            raise OptionError(f"{where} key 'skip' must be a list of regexes")
        skips = tuple(_pattern(p, f"{where} skip[{i}]") for i, p in enumerate(skip))
        rotate = d.get("rotate", "none")
        if rotate is None or rotate is False:
            rotate = "none"
        try:
            rotate = parse_rotation(rotate).label
        except OptionError:
            raise OptionError(
                f"{where} key 'rotate' must be one of {', '.join(ROTATIONS)} "
                f"(spinquant[:steps=N,lr=X,batch=B]); got {rotate!r}"
            ) from None
        recipe = cls(d["method"], settings, scheme, tuple(rules), skips, rotate)
        recipe._entry_config(None, f"{where} (method/settings/scheme)")
        for i, rule in enumerate(recipe.overrides):
            recipe._entry_config(rule, f"{where} overrides[{i}]")
        return recipe

    @classmethod
    def from_options(cls, method: str, options: dict, rotate: str | None = None) -> Recipe:
        """The one-entry recipe the CLI flags stand for (``options``: config fields, ``act`` may be
        an :class:`~bitmosaic.formats.act.ActQuantSpec`; ``rotate``: ``--rotate``)."""
        d = {"method": method, "settings": jsonable_options(options)}
        if rotate not in (None, "none"):
            d["rotate"] = rotate
        return cls.from_dict(d)

    def to_dict(self) -> dict:
        d: dict = {"method": self.method, "settings": dict(self.settings)}
        if self.scheme is not None:
            d["scheme"] = self.scheme
        if self.overrides:
            d["overrides"] = [
                {"match": r.match, **{k: v for k in ("method", "scheme", "settings") if (v := getattr(r, k))}}
                for r in self.overrides
            ]
        if self.skip:
            d["skip"] = list(self.skip)
        if self.rotate != "none":
            d["rotate"] = self.rotate
        return d

    # -- resolution ----------------------------------------------------------------------------
    def _entry(self, rule: Rule | None) -> tuple[str, dict, str | None]:
        if rule is None:
            return self.method, self.settings, self.scheme
        if rule.method is None or rule.method == self.method:
            return self.method, {**self.settings, **rule.settings}, rule.scheme or self.scheme
        return rule.method, dict(rule.settings), rule.scheme

    def _entry_config(self, rule: Rule | None, where: str):
        method, settings, scheme = self._entry(rule)
        try:
            return method_config(method, settings, scheme)
        except (ValueError, TypeError) as e:
            msg = " ".join(str(e).split())
            raise OptionError(f"{where}: {msg}; fix the settings (see `bitmosaic methods`)") from None

    def default(self):
        """``(MethodSpec, config)`` of the default entry (method, settings, scheme)."""
        return self._entry_config(None, "recipe")

    def pin_recorded_defaults(self, recorded: dict) -> tuple[Recipe, dict]:
        """``(recipe, pinned)``: this recipe with each plain setting that it leaves to a default, where
        that default now differs from ``recorded`` (a saved model's ``config``: the default entry's whole
        config at save time), set to the recorded value -- so a rerun (``bitmosaic reproduce``) does what
        ran after a release changed one of a method's defaults.  Overrides of
        the same method inherit the pin as they inherit every setting; ``act`` and list values are not
        pinned (the scheme and explicit settings record them)."""
        if not isinstance(recorded, dict):
            return self, {}
        now = self.default()[1].to_dict()
        plain = (bool, int, float, str, type(None))
        pinned = {
            k: v
            for k, v in recorded.items()
            if k in now and k != "act" and k not in self.settings
            and isinstance(v, plain) and isinstance(now[k], plain) and now[k] != v
        }  # fmt: skip
        if not pinned:
            return self, {}
        return replace(self, settings={**self.settings, **pinned}), pinned

    def resolver(self, names) -> Callable[[str], tuple | None]:
        """``name -> (MethodSpec, config)`` (``None``: skipped) over the linears ``names``.  A pattern
        that matches none of them gets a warning line (a recipe may serve several models; a typo is
        then at least said); an entry whose every match an earlier entry already took (skips first,
        then overrides in order) would never apply, and is an error naming both."""
        names = list(names)
        _check_entries(self, names)
        configs = {None: self._entry_config(None, "recipe")}
        for i, r in enumerate(self.overrides):
            configs[i] = self._entry_config(r, f"recipe overrides[{i}]")

        def resolve(name: str):
            if any(re.search(p, name) for p in self.skip):
                return None
            i = next((i for i, r in enumerate(self.overrides) if re.search(r.match, name)), None)
            return configs[i]

        resolve.default = configs[None]  # the very config object the default linears get
        return resolve


def load_recipe(path: str | os.PathLike) -> Recipe:
    """A recipe from a ``.yaml``/``.yml`` or ``.json`` file (other names are read as YAML, which
    also reads JSON)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise OptionError(
            f"--recipe {path}: cannot read it ({e.strerror or e}); give a YAML or JSON file"
        ) from None
    except UnicodeDecodeError as e:
        raise OptionError(
            f"--recipe {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
            "give a YAML or JSON file"
        ) from None
    import yaml

    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError, RecursionError) as e:  # RecursionError: nesting too deep
        reason = " ".join(str(e).split())[:200]
        raise OptionError(f"--recipe {path} is not valid YAML/JSON ({reason}); fix the file") from None
    return Recipe.from_dict(data, where=f"recipe {path.name}")


# -- validation helpers ------------------------------------------------------------------------------
def _known_keys(d: dict, allowed, where: str) -> None:
    for k in d:
        if k not in allowed:
            raise OptionError(f"{where}: unknown key {k!r}; allowed keys are {', '.join(allowed)}")


def _mapping(v, where: str) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise OptionError(f"{where} must be a mapping of option: value (e.g. {{bits: 4, group_size: 128}})")
    return dict(v)


def _opt_str(v, where: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise OptionError(f"{where} must be a string, got {v!r}")
    return v


def _pattern(p, where: str) -> str:
    if not isinstance(p, str) or not p:
        raise OptionError(f"{where} must be a non-empty regex string (e.g. 'mlp\\.down_proj$')")
    try:
        re.compile(p)
    except re.error as e:
        raise OptionError(f"{where} {p!r} is not a valid regular expression ({e}); fix the pattern") from None
    return p


def _check_entries(recipe: Recipe, names: list[str]) -> None:
    """Warn about patterns that match nothing; refuse an entry that matches only linears an earlier
    entry took (the resolver's order: skips, then overrides, first match wins)."""
    entries = [(f"recipe skip[{i}]", p) for i, p in enumerate(recipe.skip)]
    entries += [(f"recipe overrides[{i}].match", r.match) for i, r in enumerate(recipe.overrides)]
    taken: dict[str, str] = {}  # linear -> the entry that took it
    for where, p in entries:
        hits = [n for n in names if re.search(p, n)]
        if not hits:
            print(
                f"bitmosaic: warning: {where} {p!r} matches no linear of the model (names look like "
                f"{names[0]!r}), so it does nothing; fix the pattern if it should "
                "(`bitmosaic inspect DIR --layers` lists the names)",
                file=sys.stderr,
            )
            continue
        if all(n in taken for n in hits):
            raise OptionError(
                f"{where} {p!r} matches only linears that {taken[hits[0]]} already took (e.g. {hits[0]!r}), "
                "so it would never apply: each linear gets one entry (skips first, then the first matching "
                "override); remove it or make the patterns disjoint"
            )
        for n in hits:
            taken.setdefault(n, where)


def jsonable_options(options: dict) -> dict:
    """Config options with the activation spec as a plain mapping (what a recipe file holds)."""
    out = {}
    for k, v in options.items():
        out[k] = v.to_dict() if hasattr(v, "to_dict") else v
    return out
