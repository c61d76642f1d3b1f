"""How ``problem.name`` finds a Problem class, and how a checkpoint finds it again.

A problem is named in one of three ways, tried in this order:

1. a registered name (``"burgers"``): the built-in problems register themselves with
   :func:`register` (``diffnet/problems/__init__.py``);
2. ``"package.module:ClassName"``: any :class:`~diffnet.problems.contract.base.Problem` subclass in a
   module importable from the PYTHONPATH (a user's own PDE, no fork of DiffNet needed);
3. the name of an entry point of group ``diffnet.problems`` declared by an installed package
   (``[project.entry-points."diffnet.problems"] heat = "mypkg.heat:Heat"`` in its
   pyproject.toml); ``"entry-point:NAME"`` names one explicitly.

:func:`problem_spec` gives the string that finds a class again in a new process (the registered
name of a built-in, ``"module:Class"``, or ``"entry-point:NAME"``): checkpoints record it, so
``infer``, ``evaluate``, ``solve`` and ``--resume`` rebuild a plugin's problem without any edit
of DiffNet. Anything that cannot be found or imported is one ValueError naming the spec, the
import path and the underlying error.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import re

from diffnet.problems.contract.base import Problem

GROUP = "diffnet.problems"
ENTRY_POINT = "entry-point:"
HOW_TO_NAME = ("or name your own Problem subclass as 'package.module:ClassName' (importable "
               "from the PYTHONPATH), or install a plugin declaring it as an entry point of "
               f"group {GROUP!r}")
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")

PROBLEMS: dict[str, type[Problem]] = {}   # the registered names (built-ins, and any registered)
_FOUND: dict[type, str] = {}              # classes found by module path or entry point -> spec


def register(cls=None, *, name: str | None = None):
    """Register a Problem subclass under ``name`` (default: its ``name`` attribute).

    Use as ``@register`` or ``@register(name="heat")``, or call ``register(Cls)``. ValueError
    if the class is not a concrete Problem subclass or the name is taken by another class.
    """
    def add(c):
        check_class(c, f"register({getattr(c, '__name__', c)!r})")
        key = name or c.name
        if not isinstance(key, str) or not key or ":" in key:
            raise ValueError(f"register: a problem name must be a non-empty string without "
                             f"':', got {key!r}")
        if PROBLEMS.get(key, c) is not c:
            raise ValueError(f"register: problem name {key!r} is taken by "
                             f"{_where(PROBLEMS[key])}; choose another name")
        PROBLEMS[key] = c
        return c
    return add if cls is None else add(cls)


def check_class(obj, spec: str) -> type[Problem]:
    """``obj`` if it is a concrete Problem subclass with a ``name``; ValueError saying what
    it is instead (``spec``: how it was named, for the message)."""
    if not (inspect.isclass(obj) and issubclass(obj, Problem)):
        what = f"class {_where(obj)}" if inspect.isclass(obj) else f"a {type(obj).__name__}"
        raise ValueError(f"problem {spec!r} is {what}, not a subclass of "
                         f"diffnet.problems.Problem")
    if inspect.isabstract(obj):
        raise ValueError(f"problem {spec!r}: class {_where(obj)} does not implement "
                         f"{sorted(obj.__abstractmethods__)} of the Problem contract")
    if not isinstance(obj.name, str) or not obj.name:
        raise ValueError(f"problem {spec!r}: class {_where(obj)} does not set its class "
                         f"attribute name (e.g. name = {obj.__name__.lower()!r}), which "
                         f"messages and output files show")
    return obj


def resolve(name: str) -> type[Problem]:
    """The Problem class ``name`` stands for (see the module docstring for the three ways)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a problem name must be a non-empty string, got {name!r}: "
                         f"{available_text()}")
    if name in PROBLEMS:
        return PROBLEMS[name]
    if name.startswith(ENTRY_POINT):
        return _from_entry_point(name[len(ENTRY_POINT):], explicit=True)
    if ":" in name:
        return _from_path(name)
    if name in entry_point_names():
        return _from_entry_point(name)
    raise ValueError(unknown_message(name))


def problem_spec(cls: type[Problem]) -> str:
    """The string that finds ``cls`` again in a new process (what checkpoints record).

    ValueError for a class no other process can import (defined in ``__main__`` or inside a
    function): a checkpoint naming it could never be used again."""
    for key, c in PROBLEMS.items():   # a built-in's name is there in every process
        if c is cls and cls.__module__.split(".")[0] == "diffnet":
            return key
    if cls in _FOUND:
        return _FOUND[cls]
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise ValueError(f"problem class {cls.__qualname__} is defined in "
                         f"{'a function' if '<locals>' in cls.__qualname__ else '__main__'}, "
                         f"which a new process (resume, infer, evaluate) cannot import: move "
                         f"it to a module on the PYTHONPATH and name it 'module:ClassName'")
    return f"{cls.__module__}:{cls.__qualname__}"


# ---------------------------------------------------------------------------------------------
# entry points and module paths
# ---------------------------------------------------------------------------------------------

def entry_points() -> dict:
    """Name -> entry point of every installed plugin of group ``diffnet.problems`` (read afresh:
    a package installed while the process runs is seen)."""
    out = {}
    for ep in importlib.metadata.entry_points(group=GROUP):
        out.setdefault(ep.name, ep)   # two distributions declaring one name: the first wins
    return out


def entry_point_names() -> list[str]:
    return sorted(entry_points())


def _from_entry_point(name: str, explicit: bool = False) -> type[Problem]:
    spec = ENTRY_POINT + name
    eps = entry_points()
    if name not in eps:
        raise ValueError(f"problem {spec if explicit else name!r}: no installed package declares "
                         f"an entry point {name!r} in group {GROUP!r}; installed ones: "
                         f"{', '.join(sorted(eps)) or 'none'}")
    ep = eps[name]
    dist = getattr(getattr(ep, "dist", None), "name", None) or "an installed package"
    try:
        obj = ep.load()
    except Exception as e:   # a plugin's import can raise anything: report it as bad input
        raise ValueError(f"problem {name!r}: the entry point {name} = {ep.value!r} of {dist} "
                         f"(group {GROUP!r}) cannot be loaded ({type(e).__name__}: {e})") from None
    cls = check_class(obj, f"{name} = {ep.value}")
    _FOUND[cls] = spec   # the latest way this process found it
    return cls


def _from_path(spec: str) -> type[Problem]:
    module, _, qual = spec.partition(":")
    if not _DOTTED.match(module) or not _DOTTED.match(qual):
        raise ValueError(f"problem {spec!r} is not of the form 'package.module:ClassName' "
                         f"(a module importable from the PYTHONPATH, then the class)")
    try:
        obj = importlib.import_module(module)
    except Exception as e:   # the user's module may fail in any way on import
        raise ValueError(f"problem {spec!r}: cannot import module {module!r} "
                         f"({type(e).__name__}: {e}); put the directory that holds it on the "
                         f"PYTHONPATH (of every rank), or install its package") from None
    for part in qual.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            found = _problem_classes(importlib.import_module(module))
            raise ValueError(f"problem {spec!r}: module {module!r} "
                             f"({getattr(importlib.import_module(module), '__file__', '?')}) has "
                             f"no attribute {qual!r}; Problem subclasses in it: "
                             f"{', '.join(found) or 'none'}") from None
    cls = check_class(obj, spec)
    _FOUND[cls] = spec   # the latest way this process found it
    return cls


def _problem_classes(module) -> list[str]:
    return sorted(n for n, v in vars(module).items()
                  if inspect.isclass(v) and issubclass(v, Problem) and not inspect.isabstract(v))


def _where(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', obj)}"


# ---------------------------------------------------------------------------------------------
# messages
# ---------------------------------------------------------------------------------------------

def available_text() -> str:
    """'registered problems: a, b; installed plugins: c; or name your own ...'."""
    plugins = [n for n in entry_point_names() if n not in PROBLEMS]
    return (f"registered problems: {', '.join(sorted(PROBLEMS))}; installed plugins (entry "
            f"points of group {GROUP!r}): {', '.join(plugins) or 'none'}; {HOW_TO_NAME}")


def unknown_message(name: str) -> str:
    """The message for a name that is neither registered nor a plugin's."""
    known = sorted(PROBLEMS) + entry_point_names()
    hint = difflib.get_close_matches(name, known, n=1)
    dotted = "." in name and _DOTTED.match(name)
    if dotted:
        module, _, cls = name.rpartition(".")
        hint_text = f" (a class in a module is written with a colon: '{module}:{cls}')"
    else:
        hint_text = f" (did you mean {hint[0]!r}?)" if hint else ""
    return f"unknown problem {name!r}{hint_text}; {available_text()}"
