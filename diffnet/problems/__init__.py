"""The PDE families: the built-in problems, registered by name, and the way to any other.

``get_problem(name, **options)`` builds a problem from a registered name, a
``"package.module:ClassName"`` importable from the PYTHONPATH, or a plugin's entry point
(group ``diffnet.problems``): see :mod:`.contract.registry`. The contract a problem
implements: :mod:`.contract.base`, the three parts :class:`Family`, :class:`Loss` and an answer
head (:mod:`.contract.heads`: ``Plain``, ``Ritz`` for a :class:`QuadraticEnergy`). The split-exact
multilevel norm of a residual: :func:`residual_norm` (:mod:`.contract.residual_norm`); the
norm of a residual preconditioned by a V-cycle of its own operator: :func:`operator_norm`
(:mod:`.contract.operator_norm`); the energy whose gradient is a symmetric residual:
:func:`residual_energy` (:mod:`.contract.residual_energy`).
Boundary data (:mod:`.contract.boundary`): :func:`dirichlet` imposes u = g through a lift,
:func:`neumann` and :func:`robin` are loss terms, :func:`mesh`, :func:`bubble` and
:func:`transfinite_lift` the fields they are built from; :func:`cell_means` coarsens a field
(:mod:`.contract.cells`). The answer residual every problem has from its loss:
:func:`loss_residual` (:func:`residual_kind`: the family's own or that one). The coarse
correction of an answer by its loss's minimiser over its coarse rescalings and the coarse
hats, for any linear PDE:
:func:`coarse_correction` (:mod:`.contract.correction`). The families are in :mod:`.families`, the problem checker in :mod:`.check`.
"""
from __future__ import annotations

import inspect

from diffnet.validation import keyword_options
from diffnet.problems.contract.base import Problem, residual_kind
from diffnet.problems.contract.boundary import (bubble, dirichlet, mesh, neumann, normal_derivative,
                                                robin, transfinite_lift, wall_names)
from diffnet.problems.contract.cells import block_cells, cell_means
from diffnet.problems.contract.correction import check_correction, coarse_correction
from diffnet.problems.contract.derived import check_derived_channels
from diffnet.problems.contract.family import (Axis, Family, check_reference, has_answer_residual,
                                              has_derived_channels, has_reference, refines,
                                              solves_from_inputs)
from diffnet.problems.contract.heads import Plain, QuadraticEnergy, Ritz
from diffnet.problems.contract.loss import Loss
from diffnet.problems.contract.loss_residual import loss_residual
from diffnet.problems.contract.residual_norm import residual_norm
from diffnet.problems.contract.operator_norm import operator_norm
from diffnet.problems.contract.residual_energy import residual_energy
from diffnet.problems.families.burgers import Burgers
from diffnet.problems.families.darcy import Darcy
from diffnet.problems.families.poisson import Poisson
from diffnet.problems.families.poisson3d import Poisson3D
from diffnet.problems.families.reaction_diffusion import ReactionDiffusion
from diffnet.problems.contract.registry import (GROUP, PROBLEMS, available_text, entry_point_names,
                                                problem_spec, register, resolve)

for _cls in (Burgers, Darcy, Poisson, Poisson3D, ReactionDiffusion):
    register(_cls)


def option_names(name) -> tuple[str, ...]:
    """The keyword options the constructor of problem ``name`` (a name or a class) accepts."""
    return tuple(keyword_options(name if inspect.isclass(name) else resolve(name)))


def get_problem(name, **kwargs) -> Problem:
    """Instantiate problem ``name`` (see :func:`resolve`; or a Problem class itself) with its
    keyword options (e.g. ``grid=(64, 64)``)."""
    cls = name if inspect.isclass(name) else resolve(name)
    valid = option_names(cls)
    bad = sorted(k for k in kwargs if k not in valid)
    if bad:
        raise ValueError(f"unknown option(s) {bad} for problem {cls.name!r}; valid options: "
                         f"{list(valid)}")
    return cls(**kwargs)


def replace_options(name, stored: dict, given: dict) -> dict:
    """The options of problem ``name`` (a name or a class): ``stored`` ones (e.g. a checkpoint's,
    every value written out) with ``given`` ones in place. A given option that names a preset
    (the class's ``option_presets``) drops the stored values of the options it presets, so the
    preset gives them, unless they are given too."""
    cls = name if inspect.isclass(name) else resolve(name)
    reset = {k for opt in given for k in cls.option_presets.get(opt, ())}
    return {**{k: v for k, v in stored.items() if k not in reset}, **given}


# The built-in families are reached by name (PROBLEMS, get_problem); Poisson is exported as
# well, for plugins that build on it (tests/plugins/no_reference.py).
__all__ = ["PROBLEMS", "GROUP", "Problem", "Axis", "Family", "Loss", "Plain", "Ritz",
           "QuadraticEnergy", "get_problem", "option_names", "replace_options", "resolve",
           "register", "problem_spec", "has_reference", "solves_from_inputs", "refines",
           "has_answer_residual", "has_derived_channels", "check_derived_channels",
           "check_reference", "entry_point_names", "available_text",
           "residual_norm", "operator_norm", "residual_energy", "dirichlet", "neumann", "robin", "normal_derivative", "mesh",
           "bubble", "transfinite_lift", "wall_names", "cell_means", "block_cells", "loss_residual",
           "coarse_correction", "check_correction",
           "residual_kind", "Poisson"]
