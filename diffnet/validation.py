"""Argument checks shared by all of diffnet: the one place that says what a valid number,
integer, choice, flag, range, pair (or n-tuple), grid (2-D or n-D) or field array
is, and how a bad one is reported.

Every check returns the value normalised (float, int, str, bool, tuple or float64 array) or
raises ValueError worded ``"<name> must be <what is allowed>, got <what was given>"``, so the
user reads which argument is wrong and what would be accepted. Checks that need knowledge of
one problem or solver (a diffusivity's shape, a sequence of stencil names) stay with that code
and build on these. :func:`keyword_options` says which options a problem or a generator takes.
"""
from __future__ import annotations

import inspect
import math

import numpy as np


def keyword_options(cls) -> dict:
    """The keyword-only options of ``cls``'s constructor, each with its default: the options a
    problem or a generator takes (``problem.options``, ``model.options``)."""
    return {p.name: p.default for p in inspect.signature(cls.__init__).parameters.values()
            if p.kind == inspect.Parameter.KEYWORD_ONLY}


def _bounds_text(lo: float, hi: float, lo_open: bool, hi_open: bool) -> str:
    parts = []
    if lo > -math.inf:
        parts.append(f"{'>' if lo_open else '>='} {lo}")
    if hi < math.inf:
        parts.append(f"{'<' if hi_open else '<='} {hi}")
    return "a finite number" + (" " + " and ".join(parts) if parts else "")


def check_number(name: str, value, *, lo: float = -math.inf, hi: float = math.inf,
                 lo_open: bool = False, hi_open: bool = False, what: str = "") -> float:
    """A finite real number in [lo, hi] (an end excluded with lo_open / hi_open) as a float.

    ``what`` replaces the generated description of the allowed values in the message. Bools are
    refused: True is not a number a user means.
    """
    desc = what or _bounds_text(lo, hi, lo_open, hi_open)
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be {desc}, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {desc}, got {value!r}") from None
    below = v <= lo if lo_open else v < lo
    above = v >= hi if hi_open else v > hi
    if not math.isfinite(v) or below or above:
        raise ValueError(f"{name} must be {desc}, got {value!r}")
    return v


def check_int(name: str, value, lo: int, hi: int | None = None, *, what: str = "") -> int:
    """An integer (Python or numpy) in [lo, hi] as an int; bools and floats such as 4.0 refused."""
    desc = what or (f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {desc}, got {value!r}")
    return int(value)


def check_choice(name: str, value, allowed) -> str:
    """One of the strings ``allowed`` (any iterable of names, e.g. a tuple or a dict's keys)."""
    allowed = tuple(allowed)
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def check_bool(name: str, value) -> bool:
    """A real bool (Python or numpy), not a truthy number or string."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _whole(v) -> int:
    """int(v) for an integer-valued number; ValueError for 64.5, True or "64"."""
    if isinstance(v, (bool, np.bool_, str, bytes)) or float(v) != int(v):
        raise ValueError(v)
    return int(v)


def _pair(name: str, value, form: str, convert=float, noun: str = "numbers") -> tuple:
    """Two values converted by ``convert``; ValueError showing the expected ``form`` otherwise."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{name} must be a pair {form} of {noun}, got {value!r}")
    try:
        a, b = (convert(v) for v in value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be a pair {form} of {noun}, got {value!r}") from None
    return a, b


def check_range(name: str, value, *, allow_equal: bool = False) -> tuple[float, float]:
    """A finite (lo, hi) with lo < hi (lo <= hi with allow_equal)."""
    lo, hi = _pair(name, value, "(lo, hi)")
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if hi < lo or (hi == lo and not allow_equal):
        raise ValueError(f"{name} must satisfy lo < hi (an empty or reversed range), got {value!r}")
    return lo, hi


def check_positive_pair(name: str, value, form: str = "(a, b)") -> tuple[float, float]:
    """Two finite numbers > 0, such as a grid spacing or domain lengths (``form`` names them)."""
    a, b = _pair(name, value, form)
    if not all(math.isfinite(v) and v > 0 for v in (a, b)):
        raise ValueError(f"{name} must be two finite numbers > 0 {form}, got {value!r}")
    return a, b


def check_grid(grid, name: str = "grid", minimum: int = 4) -> tuple[int, int]:
    """A node grid (H, W) of integers >= minimum per axis (default 4: the one-sided stencils)."""
    h, w = _pair(name, grid, "(H, W)", convert=_whole, noun="integers")
    if h < minimum or w < minimum:
        raise ValueError(f"{name} must have at least {minimum} nodes per axis, got {grid!r}")
    return h, w


_COUNTS = {2: "pair", 3: "triple"}


def _ntuple(name: str, value, n: int, form: str, convert=float, noun: str = "numbers") -> tuple:
    """Exactly ``n`` values converted by ``convert`` (the n-axis form of ``_pair``)."""
    what = f"a {_COUNTS.get(n, f'{n}-tuple')} {form} of {noun}"
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    try:
        out = tuple(convert(v) for v in value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be {what}, got {value!r}") from None
    if len(out) != n:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return out


def check_positive_tuple(name: str, value, n: int, form: str) -> tuple[float, ...]:
    """``n`` finite numbers > 0, one per axis (a 3-D spacing or domain lengths: n = 3)."""
    out = _ntuple(name, value, n, form)
    if not all(math.isfinite(v) and v > 0 for v in out):
        raise ValueError(f"{name} must be {n} finite numbers > 0 {form}, got {value!r}")
    return out


def check_node_grid(grid, dims: int, name: str = "grid", minimum: int = 4) -> tuple[int, ...]:
    """A node grid of ``dims`` integers >= minimum per axis: (H, W) or (D, H, W).

    ``check_grid`` is the 2-D case with its own wording; this is the same check for any number
    of axes (a 3-D problem's grid).
    """
    axes = ("D", "H", "W")[-dims:] if dims <= 3 else tuple(f"n{i}" for i in range(dims))
    form = "(" + ", ".join(axes) + ")"
    out = _ntuple(name, grid, dims, form, convert=_whole, noun="integers")
    if min(out) < minimum:
        raise ValueError(f"{name} must have at least {minimum} nodes per axis, got {grid!r}")
    return out


def grid_axes(ndim: int) -> str:
    """The array dimensions of an ``ndim``-axis node grid as messages name them: "H, W" (2-D),
    "D, H, W" (3-D)."""
    return ", ".join("DHW"[-ndim:])


def check_array(name: str, value, *, ndim: int | None = None, form: str = "",
                positive: bool = False) -> np.ndarray:
    """A float64 copy of a real array with ``ndim`` dimensions, finite (and > 0 with positive).

    ``form`` describes the expected shape in messages, e.g. "(N, H, W)".
    """
    shape = f" {form}" if form else ""
    try:
        # asarray, then a copy: np.array(..., copy=True) warns on torch tensors (numpy 2)
        a = np.asarray(value, dtype=np.float64).copy()
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real array{shape}, got "
                         f"{type(value).__name__}") from None
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-D array{shape}, got shape {a.shape}")
    bad = int(a.size - np.count_nonzero(np.isfinite(a)))
    if bad:
        raise ValueError(f"{name} must be finite everywhere, got {bad} non-finite value(s)")
    if positive and a.size and not np.all(a > 0):
        raise ValueError(f"{name} must be > 0 everywhere, got min {a.min():g}")
    return a
