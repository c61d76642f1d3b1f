"""Registry of the PDE families: name -> Problem subclass (see ``base`` for the contract)."""
from __future__ import annotations

import inspect

from ..validation import check_choice
from .base import Axis, Problem
from .burgers import Burgers
from .darcy import Darcy
from .poisson import Poisson
from .poisson3d import Poisson3D
from .reaction_diffusion import ReactionDiffusion

PROBLEMS: dict[str, type[Problem]] = {
    "burgers": Burgers,
    "darcy": Darcy,
    "poisson": Poisson,
    "poisson3d": Poisson3D,
    "reaction_diffusion": ReactionDiffusion,
}


def problem_options(name: str) -> tuple[str, ...]:
    """The keyword options the constructor of problem ``name`` accepts."""
    cls = _lookup(name)
    return tuple(p.name for p in inspect.signature(cls.__init__).parameters.values()
                 if p.kind == inspect.Parameter.KEYWORD_ONLY)


def _lookup(name: str) -> type[Problem]:
    return PROBLEMS[check_choice("problem name", name, sorted(PROBLEMS))]


def get_problem(name: str, **kwargs) -> Problem:
    """Instantiate problem ``name`` with its keyword options (e.g. ``grid=(64, 64)``)."""
    cls = _lookup(name)
    valid = problem_options(name)
    bad = sorted(k for k in kwargs if k not in valid)
    if bad:
        raise ValueError(f"unknown option(s) {bad} for problem {name!r}; valid options: "
                         f"{list(valid)}")
    return cls(**kwargs)


__all__ = ["PROBLEMS", "Problem", "Axis", "get_problem", "problem_options",
           "Burgers", "Darcy", "Poisson", "Poisson3D", "ReactionDiffusion"]
