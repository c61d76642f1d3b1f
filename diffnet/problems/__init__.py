"""The PDE families: the built-in problems, registered by name, and the way to any other.

``get_problem(name, **options)`` builds a problem from a registered name, a
``"package.module:ClassName"`` importable from the PYTHONPATH, or a plugin's entry point
(group ``diffnet.problems``): see :mod:`.registry`. The contract a problem implements:
:mod:`.base`.
"""
from __future__ import annotations

import inspect

from ..validation import keyword_options
from .base import Axis, Problem
from .burgers import Burgers
from .darcy import Darcy
from .poisson import Poisson
from .poisson3d import Poisson3D
from .reaction_diffusion import ReactionDiffusion
from .registry import (GROUP, PROBLEMS, available_text, check_reference, entry_point_names,
                       has_reference, problem_spec, register, resolve)

for _cls in (Burgers, Darcy, Poisson, Poisson3D, ReactionDiffusion):
    register(_cls)


def problem_options(name) -> tuple[str, ...]:
    """The keyword options the constructor of problem ``name`` (a name or a class) accepts."""
    return tuple(keyword_options(name if inspect.isclass(name) else resolve(name)))


def get_problem(name, **kwargs) -> Problem:
    """Instantiate problem ``name`` (see :func:`resolve`; or a Problem class itself) with its
    keyword options (e.g. ``grid=(64, 64)``)."""
    cls = name if inspect.isclass(name) else resolve(name)
    valid = problem_options(cls)
    bad = sorted(k for k in kwargs if k not in valid)
    if bad:
        raise ValueError(f"unknown option(s) {bad} for problem {cls.name!r}; valid options: "
                         f"{list(valid)}")
    return cls(**kwargs)


__all__ = ["PROBLEMS", "GROUP", "Problem", "Axis", "get_problem", "problem_options", "resolve",
           "register", "problem_spec", "has_reference", "check_reference", "entry_point_names",
           "available_text", "Burgers", "Darcy", "Poisson", "Poisson3D", "ReactionDiffusion"]
