"""The generic machinery behind :mod:`deepfusion.config`: typed, validated TOML sections.

A section is a ``@dataclass(kw_only=True)`` subclass of :class:`Section` whose fields are made
with :func:`option` (default, help text and declarative constraints in the field metadata).
``Section.__post_init__`` coerces every value to its annotated type and checks the constraints,
raising a :class:`ConfigError` that names the dotted key. The rest turns a section registry
(``{"name": SectionClass}``) into "did you mean" suggestions (:func:`unknown_key`), TOML text
(:func:`dump_tables`) and reference help (:func:`describe_sections`).

Pure Python: no PDE, no model and no MPI.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import re
import typing
from dataclasses import field
from typing import ClassVar


class ConfigError(ValueError):
    """A bad configuration. ``key`` is the dotted key at fault (``None`` for file errors)."""

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(message)
        self.key = key


# ---------------------------------------------------------------------------------------------
# field helper: default + help + declarative constraints (used by validation and describe())
# ---------------------------------------------------------------------------------------------

def option(default, help: str, *, choices=None, ge=None, gt=None, le=None, lt=None,
       item_ge=None, item_gt=None, min_len=None, max_len=None):
    meta = {"help": help}
    for name, value in (("choices", choices), ("ge", ge), ("gt", gt), ("le", le), ("lt", lt),
                        ("item_ge", item_ge), ("item_gt", item_gt), ("min_len", min_len),
                        ("max_len", max_len)):
        if value is not None:
            meta[name] = value
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: copy.deepcopy(d), metadata=meta)
    return field(default=default, metadata=meta)


_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "string", dict: "table"}


def _type_str(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        return f"list[{_TYPE_NAMES[item]}]"
    if origin is dict or tp is dict:
        return "table"
    return _TYPE_NAMES[tp]


def describe_value(value) -> str:
    return f"got {value!r} ({type(value).__name__})"


_TOML_PLAIN = (str, int, float, bool)


def _check_table(key: str, value) -> dict:
    """A free-form options table: string keys, TOML-representable values (no None)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a table (e.g. {key.split('.')[-1]} = {{a = 1}}), "
                          f"{describe_value(value)}", key=key)

    def walk(path, v):
        if isinstance(v, dict):
            for k, item in v.items():
                if not isinstance(k, str):
                    raise ConfigError(f"{path} keys must be strings, got {k!r}", key=path)
                walk(f"{path}.{k}", item)
        elif isinstance(v, (list, tuple)):
            for i, item in enumerate(v):
                walk(f"{path}[{i}]", item)
        elif not isinstance(v, _TOML_PLAIN) or (isinstance(v, float) and not math.isfinite(v)):
            raise ConfigError(f"{path} must hold only strings, finite numbers, booleans, arrays "
                              f"and tables, {describe_value(v)}", key=path)

    walk(key, value)
    return {k: copy.deepcopy(list(v) if isinstance(v, tuple) else v) for k, v in value.items()}


def _coerce_scalar(key: str, value, tp):
    """Check ``value`` against ``tp``; ints are accepted for floats, integral floats for ints."""
    name = _TYPE_NAMES[tp]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be a bool (true or false), {describe_value(value)}", key=key)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key} must be an int, {describe_value(value)}", key=key)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a float, {describe_value(value)}", key=key)
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite float, got {value!r}", key=key)
        return value
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string (quote it in TOML), {describe_value(value)}", key=key)
    raise TypeError(f"unsupported config type {tp!r} for {key}")  # pragma: no cover


def _check_bounds(key: str, value, meta: dict, prefix: str = "") -> None:
    for op, test, word in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                           ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")):
        bound = meta.get(prefix + op)
        if bound is not None and not test(value, bound):
            raise ConfigError(f"{key} must be {word} {bound}, got {value!r}", key=key)


def _bounds_text(meta: dict, prefix: str = "") -> str:
    parts = [f"{word} {meta[prefix + op]}" for op, word in
             (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if prefix + op in meta]
    return " and ".join(parts)


class Section:
    """Base of every section: type coercion and declarative checks in ``__post_init__``."""

    _section: ClassVar[str] = ""

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            key = f"{self._section}.{f.name}"
            value = getattr(self, f.name)
            tp = hints[f.name]
            meta = f.metadata
            origin = typing.get_origin(tp)
            if origin is list:
                (item_tp,) = typing.get_args(tp)
                if not isinstance(value, (list, tuple)):
                    example = "[[...]] tables" if item_tp is dict else "[1, 2]"
                    raise ConfigError(f"{key} must be a list of {_TYPE_NAMES[item_tp]} "
                                      f"(e.g. {example}), {describe_value(value)}", key=key)
                try:
                    value = [_check_table(f"{key}[{i}]", v) if item_tp is dict
                             else _coerce_scalar(f"{key}[{i}]", v, item_tp)
                             for i, v in enumerate(value)]
                    for i, v in enumerate(value):
                        _check_bounds(f"{key}[{i}]", v, meta, prefix="item_")
                except ConfigError as exc:  # report the field itself as the key
                    raise ConfigError(str(exc), key=key) from None
                n = len(value)
                lo, hi = meta.get("min_len"), meta.get("max_len")
                if (lo is not None and n < lo) or (hi is not None and n > hi):
                    want = f"exactly {lo}" if lo == hi else f"{lo} to {hi}"
                    raise ConfigError(f"{key} must have {want} entries, got {n}: {value!r}",
                                      key=key)
            elif origin is dict or tp is dict:
                value = _check_table(key, value)
            else:
                value = _coerce_scalar(key, value, tp)
                if "choices" in meta and value not in meta["choices"]:
                    valid = ", ".join(repr(c) for c in meta["choices"])
                    hint = difflib.get_close_matches(str(value), meta["choices"], n=1)
                    extra = f" (did you mean {hint[0]!r}?)" if hint else ""
                    raise ConfigError(f"{key} must be one of {valid}; got {value!r}{extra}",
                                      key=key)
                _check_bounds(key, value, meta)
            setattr(self, f.name, value)
        self._validate()

    def _validate(self) -> None:
        """Checks that involve several fields of the section."""

    def _err(self, name: str, message: str) -> ConfigError:
        key = f"{self._section}.{name}"
        return ConfigError(f"{key} {message}", key=key)



# ---------------------------------------------------------------------------------------------
# unknown keys
# ---------------------------------------------------------------------------------------------

def unknown_key(dotted: str, sections: dict[str, type]) -> ConfigError:
    """'unknown key ...; did you mean ...?' with the closest valid key of ``sections``."""
    section, _, leaf = dotted.partition(".")
    candidates = [f"{s}.{f.name}" for s, cls in sections.items() for f in dataclasses.fields(cls)]
    guess = None
    if not leaf:  # a bare top-level name: a misspelt section, or a key without its section
        same_leaf = [k for k in candidates if k.split(".")[1] == section]
        if same_leaf:
            guess = same_leaf[0]
        else:
            m = difflib.get_close_matches(section, list(sections), n=1, cutoff=0.6)
            guess = m[0] if m else None
        what = "section"
        valid = ", ".join(sections)
    else:
        if section in sections:
            fields = [f.name for f in dataclasses.fields(sections[section])]
            m = difflib.get_close_matches(leaf, fields, n=1, cutoff=0.6)
            if m:
                guess = f"{section}.{m[0]}"
            valid = ", ".join(fields)
        else:
            valid = ", ".join(sections)
        if guess is None:
            same_leaf = [k for k in candidates if k.split(".")[1] == leaf]
            if same_leaf:
                guess = same_leaf[0]
            else:
                m = difflib.get_close_matches(dotted, candidates, n=1, cutoff=0.6)
                guess = m[0] if m else None
        what = "key"
        if section in sections:
            valid = f"valid keys in [{section}]: {valid}"
        else:
            valid = f"valid sections: {valid}"
    msg = f"unknown {what} {dotted!r}"
    if guess:
        msg += f"; did you mean {guess!r}?"
    else:
        msg += f"; {valid}" if what == "key" else f"; valid sections: {valid}"
    return ConfigError(msg, key=dotted)


# ---------------------------------------------------------------------------------------------
# writing and describing
# ---------------------------------------------------------------------------------------------

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key, ensure_ascii=False)


def _toml_value(value, key: str = "") -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON escapes are valid TOML escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v, key) for v in value) + "]"
    if isinstance(value, dict):
        if not value:
            return "{}"
        return "{" + ", ".join(f"{_toml_key(str(k))} = {_toml_value(v, f'{key}.{k}')}"
                               for k, v in value.items()) + "}"
    raise ConfigError(f"{key} cannot be written to TOML: {describe_value(value)}", key=key or None)


def dump_tables(header: str, tables: dict) -> str:
    """TOML text: the comment ``header`` then one ``[name]`` table per entry of ``tables``."""
    lines = [header]
    for name, table in tables.items():
        lines.append("")
        lines.append(f"[{name}]")
        for key, value in table.items():
            lines.append(f"{_toml_key(key)} = {_toml_value(value, f'{name}.{key}')}")
    return "\n".join(lines) + "\n"


def toml_value(value) -> str:
    """``value`` as TOML text, as a config file writes it (``[1, 2]``, ``{a = 1}``, ``"x"``)."""
    return _toml_value(value)


def key_rows(name: str, cls: type) -> list[dict]:
    """One row per key of section ``cls`` (keys named ``name.key``): its type, default (TOML
    text), help text and constraints ("one of ...", ">= 1"). What :func:`describe_sections`
    prints and the manual's configuration reference tabulates."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        meta = f.metadata
        extras = []
        if "choices" in meta:
            extras.append("one of " + ", ".join(repr(c) for c in meta["choices"]))
        rng = _bounds_text(meta)
        if rng:
            extras.append(rng)
        item_rng = _bounds_text(meta, "item_")
        if item_rng:
            extras.append(f"each entry {item_rng}")
        rows.append({"key": f"{name}.{f.name}", "type": _type_str(hints[f.name]),
                     "default": _toml_value(default), "help": meta.get("help", ""),
                     "constraints": "; ".join(extras)})
    return rows


def describe_sections(sections: dict[str, type]) -> str:
    """Every key of ``sections`` with its type, default, allowed values and help text."""
    out = []
    for name, cls in sections.items():
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        out.append(f"{doc}" if doc.startswith("[") else f"[{name}]")
        for row in key_rows(name, cls):
            out.append(f"  {row['key']}: {row['type']} = {row['default']}")
            extra = f" [{row['constraints']}]" if row["constraints"] else ""
            out.append(f"      {row['help']}{extra}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"
