"""Where in a problem's own source a failure of the problem checker lies: the file and line of
the method a check exercised, so that ``deepfusion check-problem`` names them
(``[Heat.loss_terms at mylab/heat.py:57]``).

A method that raised is placed at the innermost line of the traceback in the problem's own
files (its class and its bases outside the contract), which is where it failed; a method that
returned a wrong value at its ``def`` line (``inspect.getsourcelines``); a class attribute at
the line that sets it. A method the problem inherits from the contract
(``diffnet.problems.contract``) is not the problem's: the next method the check names is
tried, then the class itself.
"""
from __future__ import annotations

import inspect
import os
import re
import traceback

CONTRACT = "diffnet.problems.contract"


def own_classes(cls) -> list[type]:
    """``cls`` and its bases that are the problem's own: not the contract's, not builtins."""
    return [k for k in inspect.getmro(cls)
            if k.__module__ not in ("builtins", "abc") and not k.__module__.startswith(CONTRACT)]


def shown(path: str) -> str:
    """``path`` relative to the working directory when it lies below it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def source_file(obj) -> str | None:
    try:
        path = inspect.getsourcefile(obj)
    except (TypeError, OSError):
        return None
    return os.path.realpath(path) if path else None


def locate(cls, method: str = "", raised: BaseException | None = None) -> str:
    """``"Owner.method at path:line"`` for the failure of check-problem's ``method`` label (the
    words of a :class:`~.methods.Fault`'s method, e.g. "loss_terms (term 'pde')"), from the
    traceback of ``raised`` when it is given; "" when no source is found."""
    mine = own_classes(cls)
    if raised is not None:
        files = {f for f in map(source_file, mine) if f}
        frames = [(f.f_code, line) for f, line in traceback.walk_tb(raised.__traceback__)
                  if os.path.realpath(f.f_code.co_filename) in files]
        if frames:
            code, line = frames[-1]
            name = getattr(code, "co_qualname", code.co_name)      # Python >= 3.11
            return f"{name} at {shown(code.co_filename)}:{line}"
    for word in re.findall(r"[A-Za-z_]\w*", method):
        owner = next((k for k in inspect.getmro(cls) if word in vars(k)), None)
        if owner is None or owner not in mine:
            continue
        found = _member(owner, word)
        if found:
            return found
    return _class_line(cls) if mine and mine[0] is cls else ""


def _member(owner, name: str) -> str:
    """Where ``owner`` defines ``name``: a function's def line, or the line setting it."""
    obj = vars(owner)[name]
    if isinstance(obj, property):
        obj = obj.fget
    obj = getattr(obj, "__func__", obj)           # classmethod, staticmethod
    if inspect.isfunction(obj):
        obj = inspect.unwrap(obj)
        path = source_file(obj)
        if path:
            try:
                line = inspect.getsourcelines(obj)[1]
            except (OSError, TypeError):
                return ""
            return f"{owner.__qualname__}.{name} at {shown(path)}:{line}"
    path = source_file(owner)
    try:
        lines, first = inspect.getsourcelines(owner)
    except (OSError, TypeError):
        return ""
    setting = re.compile(rf"^\s+{re.escape(name)}\s*(:[^=]*)?=")
    for k, text in enumerate(lines):
        if setting.match(text):
            return f"{owner.__qualname__}.{name} at {shown(path)}:{first + k}"
    return f"{owner.__qualname__} at {shown(path)}:{first}"


def _class_line(cls) -> str:
    path = source_file(cls)
    try:
        line = inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        return ""
    return f"class {cls.__qualname__} at {shown(path)}:{line}" if path else ""
