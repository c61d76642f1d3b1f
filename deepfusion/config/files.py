"""Reading and writing configurations: TOML files, ``--set key=value`` overrides, dumps.

    cfg = load_config("configs/demo.toml", ["optim.lr=3e-4", "train.epochs=5"])
    text = dump_toml(cfg)            # the resolved config, loadable again

Pure Python: no PDE, no model, no MPI.
"""
from __future__ import annotations

import copy
import re
import sys
import typing

from deepfusion.config.schema import ConfigError, describe_sections, dump_tables, toml_value
from deepfusion.config.sections import SECTIONS, Config, config_from_dict, config_to_dict


def import_toml(version_info=sys.version_info):
    """The TOML reader: ``tomllib`` on Python 3.11+, the ``tomli`` backport on 3.10."""
    if tuple(version_info[:2]) >= (3, 11):
        import tomllib

        return tomllib
    try:
        import tomli
    except ImportError as exc:  # pragma: no cover - depends on the interpreter
        raise ImportError(
            "reading TOML configs on Python < 3.11 needs the 'tomli' package: pip install tomli"
        ) from exc
    return tomli


tomllib = import_toml()


def _parse_value(text: str):
    """A TOML value (number, bool, string, array, inline table), else the bare string."""
    text = text.strip()
    try:
        parsed = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return text
    if set(parsed) != {"v"}:  # e.g. a newline smuggling in a second key: keep it literal
        return text
    return parsed["v"]


def _split_override(item: str) -> tuple[list[str], str]:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"malformed override {item!r}: use the form key=value, "
                          f"e.g. optim.lr=3e-4")
    key, _, text = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p.strip() for p in parts):
        raise ConfigError(f"malformed override {item!r}: the key must be a dotted path like "
                          f"optim.lr (form key=value)")
    return [p.strip() for p in parts], text


_INDEXED = re.compile(r"^(.+)\[(\d+)\]$")


def apply_overrides(raw: dict, overrides: typing.Iterable[str]) -> dict:
    """Return a copy of ``raw`` with each ``"a.b=value"`` applied (value parsed as TOML). A
    part may index an array of tables: ``train.levels[1].steps=40``."""
    out = copy.deepcopy(raw)
    if isinstance(overrides, str):
        overrides = [overrides]
    for item in overrides:
        parts, text = _split_override(item)
        node, last = out, parts[-1]
        for depth, part in enumerate(parts[:-1]):
            node = _child(node, part, ".".join(parts[: depth + 1]), ".".join(parts))
        m = _INDEXED.match(last)
        if m:
            where = ".".join(parts[:-1] + [m.group(1)])
            node = _child(node, m.group(1), where, ".".join(parts), array=True)
            _check_index(node, int(m.group(2)), ".".join(parts))
            node[int(m.group(2))] = _parse_value(text)
        else:
            node[last] = _parse_value(text)
    return out


def _child(node, part: str, where: str, key: str, array: bool = False):
    """The table (or, with ``array``, the array) ``part`` of ``node``, created if missing."""
    m = _INDEXED.match(part)
    if m:
        items = _child(node, m.group(1), where.rsplit("[", 1)[0], key, array=True)
        _check_index(items, int(m.group(2)), key)
        child = items[int(m.group(2))]
    else:
        child = node.setdefault(part, [] if array else {})
    if not isinstance(child, list if array else dict):
        what = "an array" if array else "a table"
        raise ConfigError(f"cannot set {key!r}: {where!r} is a value, not {what}", key=where)
    return child


def _check_index(items: list, i: int, key: str) -> None:
    if i >= len(items):
        raise ConfigError(f"cannot set {key!r}: the array has {len(items)} entries (indices "
                          f"0..{len(items) - 1}); set the whole array to add entries", key=key)


def stated(path: str, section: str, key: str):
    """The value ``path``'s TOML states for ``section.key`` as written (None where it states
    none: the default would apply); ConfigError for a file that cannot be read."""
    table = _read_toml(str(path)).get(section)
    return table.get(key) if isinstance(table, dict) else None


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML in {path}: {exc}") from None


def load_config(path: str | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Read ``path`` (``None``: all defaults), apply ``overrides`` and validate."""
    raw = {} if path is None else _read_toml(str(path))
    overrides = [overrides] if isinstance(overrides, str) else list(overrides)
    raw = apply_overrides(raw, overrides)
    try:
        return config_from_dict(raw)
    except ConfigError as exc:
        overridden = {".".join(_split_override(o)[0]) for o in overrides}
        if path is not None and exc.key not in overridden:
            raise ConfigError(f"{exc} (in {path})", key=exc.key) from None
        raise


# ---------------------------------------------------------------------------------------------
# writing and describing (the generic parts are in config_schema)
# ---------------------------------------------------------------------------------------------

def dump_toml(cfg: Config) -> str:
    """The resolved config as TOML text (round-trips through :func:`load_config`)."""
    header = "# DeepFusion resolved configuration (written by deepfusion.config.dump_toml)"
    return dump_tables(header, config_to_dict(cfg))


def describe() -> str:
    """Every key with its type, default, allowed values and help text."""
    return describe_sections(SECTIONS)


def config_changes(old: dict, new: dict) -> list[str]:
    """``key: old -> new`` for every leaf that differs between two config dicts (as
    :func:`config_to_dict` makes them; array items are keyed ``train.levels[1].steps``, a key
    present on one side only shows ``(unset)`` on the other). What a resume reports."""
    out: list[str] = []

    def walk(a, b, key):
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                walk(a.get(k, _UNSET), b.get(k, _UNSET), f"{key}.{k}" if key else str(k))
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and any(
                isinstance(x, dict) for x in a + b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{key}[{i}]")
        elif a != b:
            out.append(f"{key}: {_show(a)} -> {_show(b)}")

    walk(old, new, "")
    return out


_UNSET = object()


def _show(value) -> str:
    return "(unset)" if value is _UNSET else repr(value)


PROBLEM_OPTIONS = "problem.options."   # the key prefix of a problem's options in --set


def as_set_flags(options: dict) -> str:
    """``--set problem.options.K=V ...`` of ``options`` (V in TOML), for messages."""
    return " ".join(f"--set {PROBLEM_OPTIONS}{k}={toml_value(v)}" for k, v in options.items())
